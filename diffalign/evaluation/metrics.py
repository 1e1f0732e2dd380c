"""An evaluation's results as files and lines: ``metrics.json`` and ``metrics.csv`` (each variant's statistics and its
comparison with the first), the overview and per-prompt grids, and the console's comparison lines.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from diffalign.evaluation.files import checkpoint_step, write_samples
from diffalign.evaluation.generation import EvalConfig
from diffalign.evaluation.scoring import compare, summarize
from diffalign.runtime.storage import atomic_file, write_text


def write_grid(images: torch.Tensor, path: Path, nrow: int = 8) -> None:
    """Saves up to len(images) images `(N, 3, H, W)` in [0, 1] as one PNG grid."""
    from torchvision.utils import make_grid, save_image  # (torchvision pulls in torch._dynamo: seconds at start-up)

    grid = make_grid(images.clamp(0, 1), nrow=nrow, padding=1, pad_value=0.5)
    atomic_file(path, lambda tmp: save_image(grid, tmp, format="PNG"), what=str(path))


def prompt_grid(cells: list[list[Image.Image]], row_labels: list[str], col_labels: list[str], title: str,
                min_cell: int = 128) -> Image.Image:
    """One labelled PNG-ready grid: a row per checkpoint (`row_labels`), a column per seed (`col_labels`) and the
    prompt as `title`. Small images are enlarged by an integer factor (nearest neighbour) to at least `min_cell`
    pixels, so that 32×32 images stay readable."""
    w, h = cells[0][0].size
    scale = max(1, math.ceil(min_cell / max(w, h)))
    cw, ch = w * scale, h * scale
    font = ImageFont.load_default(size=13)
    pad = 4
    left = max(int(font.getlength(t)) for t in row_labels) + 2 * pad
    width = left + len(col_labels) * (cw + pad) + pad
    title_lines, line = [], ""
    for word in title.split():  # wrap the prompt to the grid's width
        if line and font.getlength(f"{line} {word}") > width - 2 * pad:
            title_lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    title_lines.append(line)
    top = 18 * len(title_lines) + 18 + pad
    canvas = Image.new("RGB", (width, top + len(row_labels) * (ch + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for k, text in enumerate(title_lines):
        draw.text((pad, pad + 18 * k), text, fill="black", font=font)
    for j, text in enumerate(col_labels):
        draw.text((left + j * (cw + pad), top - 18), text, fill="black", font=font)
    for i, (text, images) in enumerate(zip(row_labels, cells)):
        y = top + i * (ch + pad)
        draw.text((pad, y + ch // 2 - 7), text, fill="black", font=font)
        for j, im in enumerate(images):
            canvas.paste(im.convert("RGB").resize((cw, ch), Image.NEAREST), (left + j * (cw + pad), y))
    return canvas


def write_metrics(samples: list[dict], rows: list[dict], variants: dict, rewards: dict, cfg: EvalConfig,
                   out_dir: Path, slugs: dict[str, str], log, context: dict | None, sampler: str | None = None) -> dict:
    """`evaluate_policy`'s last stage: the sorted ``samples.jsonl``, the statistics of each variant and its comparison
    with the first, the overview and per-prompt grids, ``metrics.json`` and ``metrics.csv``; returns the metrics."""
    labels, seeds = list(variants), list(cfg.seeds)
    order = {label: k for k, label in enumerate(labels)}
    samples = sorted((s for s in samples if s["variant"] in order),
                     key=lambda s: (order[s["variant"]], s["seed"], s["prompt_index"]))
    write_samples(out_dir / "samples.jsonl", samples)
    by_variant = {label: [s for s in samples if s["variant"] == label] for label in labels}
    boot = {"num_resamples": cfg.bootstrap_resamples, "confidence": cfg.confidence, "seed": cfg.bootstrap_seed}
    scored_all = {}
    metrics: dict = {"prompts": cfg.prompts, "num_prompts": len(rows), "seeds": seeds, "labels": labels,
                     "checkpoints": {label: str(v) if v not in (True, False) else ("base" if v else "policy")
                                     for label, v in variants.items()},
                     "steps": {label: checkpoint_step(label) for label in labels}, "config": asdict(cfg),
                     "sampler": sampler, "context": context, "variants": {}}
    for label in labels:
        records = by_variant[label]
        scored_all[label] = {n: {"scores": [r[n] for r in records],
                                 **({"correct": [r[f"{n}/correct"] for r in records]}
                                    if f"{n}/correct" in records[0] else {})} for n in rewards}
        metrics["variants"][label] = summarize(scored_all[label], records, **boot)
        grid = [torch.from_numpy(np.array(Image.open(out_dir / r["image"]).convert("RGB"))).permute(2, 0, 1) / 255
                for r in records[: cfg.grid_images]]
        write_grid(torch.stack(grid), out_dir / f"{slugs[label]}_grid.png")
        metrics.setdefault("overview_grids", {})[label] = f"{slugs[label]}_grid.png"
        log(f"eval {label}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics["variants"][label].items()
                                          if isinstance(v, float)))
    groups = [r["prompt_index"] for r in by_variant[labels[0]]]
    for other in labels[1:]:
        metrics[f"{other}_vs_{labels[0]}"] = compare(scored_all[labels[0]], scored_all[other], labels[0], other,
                                                     groups=groups, **boot)
    metrics["grids"] = []
    cell = {(s["variant"], s["prompt_index"], s["seed"]): s["image"] for s in samples}
    for p, row in enumerate(rows):
        cells = [[Image.open(out_dir / cell[label, p, s]) for s in seeds] for label in labels]
        path = out_dir / "grids" / f"p{p:05d}.png"
        grid_image = prompt_grid(cells, labels, [f"seed {s}" for s in seeds], row["prompt"])
        atomic_file(path, lambda tmp, grid_image=grid_image: grid_image.save(tmp, format="PNG"), what=str(path))
        metrics["grids"].append({"prompt_index": p, "prompt": row["prompt"], "tag": row.get("tag"),
                                 "path": str(path.relative_to(out_dir))})
    write_text(out_dir / "metrics.json", json.dumps(metrics, indent=2), what=str(out_dir / "metrics.json"))
    write_metrics_csv(metrics, out_dir / "metrics.csv")
    return metrics


def metrics_table(metrics: dict) -> list[dict]:
    """metrics.json as flat rows ``{checkpoint, metric, tag, value, se, ci_low, ci_high, n}`` (the CSV's rows): each
    variant's statistics, then each comparison's gains and win rates (``checkpoint`` = the compared variant)."""
    out = []

    def add(checkpoint, metric, value, se=None, ci=None, n=None, tag=None):
        out.append({"checkpoint": checkpoint, "metric": metric, "tag": tag, "value": value, "se": se,
                    "ci_low": ci[0] if ci else None, "ci_high": ci[1] if ci else None, "n": n})

    for label, summary in metrics["variants"].items():
        n = summary["num_images"]
        for k, v in summary.items():
            parts = k.split("/")
            if len(parts) == 2 and parts[1] in ("mean", "accuracy"):
                se_key = f"{parts[0]}/se" if parts[1] == "mean" else f"{k}_se"
                add(label, k, v, summary[se_key], summary.get(f"{k}_ci"), n)
            elif len(parts) == 2 and parts[1] == "accuracy_tag_mean":
                add(label, k, v)
            elif len(parts) == 3:
                add(label, "/".join(parts[:2]), v[parts[1]], v["se"], v.get("ci"), v["n"], tag=parts[2])
    for label in metrics["labels"][1:]:
        for k, v in metrics.get(f"{label}_vs_{metrics['labels'][0]}", {}).items():
            if k.endswith("/win_rate"):
                add(label, k, v["win_rate"], ci=v["ci"], n=v["n"])
            else:
                add(label, k, v["gain"], v["se"])
    return out


def comparison_lines(metrics: dict) -> list[str]:
    """One line per compared variant for the console: each statistic's paired gain ± s.e. against the first variant
    and each reward's win rate with its interval, e.g. ``finetuned vs base: geneval_shapes/mean +0.071 ± 0.018 (4.0
    s.e.); geneval_shapes/win_rate 0.61 [0.55, 0.67]`` (metrics.json / metrics.csv hold every figure)."""
    base, lines = metrics["labels"][0], []
    for label in metrics["labels"][1:]:
        parts = []
        for k, v in metrics.get(f"{label}_vs_{base}", {}).items():
            if k.endswith("/win_rate"):
                parts.append(f"{k} {v['win_rate']:.2f} [{v['ci'][0]:.2f}, {v['ci'][1]:.2f}]")
            else:
                ratio = f" ({v['gain'] / v['se']:.1f} s.e.)" if v.get("se") else ""
                parts.append(f"{k} {v['gain']:+.3f} ± {v['se']:.3f}{ratio}")
        lines.append(f"{label} vs {base}: " + "; ".join(parts))
    return lines


def headline(metrics: dict) -> dict | None:
    """The evaluation's headline figure, as the report's "gain over" column gives it: the last variant against the
    first (the fine-tuned model against the base in a training run) on the first reward that reports correctness
    (a verifier: the accuracy change), else on the first reward (the mean change); the paired difference over every
    (prompt, seed) pair with its standard error (`diffalign.evaluation.scoring.compare`).

    Returns:
        ``{"reward", "statistic", "baseline", "variant", "start", "end", "gain", "se", "num_prompts", "num_seeds"}``,
        or None for an evaluation of one variant.
    """
    labels = metrics["labels"]
    if len(labels) < 2:
        return None
    base, other = labels[0], labels[-1]
    gains = metrics.get(f"{other}_vs_{base}", {})
    keys = [k for k in gains if k.endswith("/accuracy_gain")] or [k for k in gains if k.endswith("/mean_gain")]
    if not keys:
        return None
    reward, stat = keys[0].split("/")[0], keys[0].split("/")[1].removesuffix("_gain")
    return {"reward": reward, "statistic": stat, "baseline": base, "variant": other,
            "start": metrics["variants"][base][f"{reward}/{stat}"], "end": metrics["variants"][other][f"{reward}/{stat}"],
            "gain": gains[keys[0]]["gain"], "se": gains[keys[0]]["se"], "num_prompts": metrics["num_prompts"],
            "num_seeds": len(metrics["seeds"])}


def headline_line(metrics: dict) -> str | None:
    """`headline` as one console line, e.g. ``[diffalign] headline: geneval_shapes accuracy 0.412 → 0.483, paired
    gain +0.071 ± 0.018 (3.9 s.e.; finetuned − base over 117 prompts × 6 seeds)``; None when there is none."""
    h = headline(metrics)
    if h is None:
        return None
    ratio = f"{h['gain'] / h['se']:.1f} s.e.; " if h["se"] > 0 else ""
    return (f"[diffalign] headline: {h['reward']} {h['statistic']} {h['start']:.3f} → {h['end']:.3f}, paired gain "
            f"{h['gain']:+.3f} ± {h['se']:.3f} ({ratio}{h['variant']} − {h['baseline']} over {h['num_prompts']} "
            f"prompts × {h['num_seeds']} seeds)")


def write_metrics_csv(metrics: dict, path: Path) -> None:
    """Writes `metrics_table(metrics)` as a CSV with a header row."""
    rows = metrics_table(metrics)

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["checkpoint", "metric", "tag", "value", "se", "ci_low", "ci_high",
                                                   "n"])
            writer.writeheader()
            writer.writerows(rows)

    atomic_file(path, write, what=str(path))
