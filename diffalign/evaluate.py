"""Evaluation: generate for a prompt set with fixed per-image seeds, score with rewards, write grids and metrics.

The image for prompt ``p`` (its index in the prompt list) and seed ``s`` is generated with its own
``torch.Generator().manual_seed(image_seed(s, p))``, so the base model and every checkpoint see the same initial
noise, and any single image can be re-made alone. Seeds are written to ``samples.jsonl``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchvision.utils import make_grid, save_image

from diffalign.samplers.rollout import rollout

TAG_ORDER = ("single_object", "colors", "counting", "two_object", "color_attr", "position")


@dataclass
class EvalConfig:
    """Evaluation settings (``eval`` in the Hydra config).

    Attributes:
        prompts: a shipped split (``"heldout"``, ``"train"``) or a path to a GenEval jsonl / plain txt prompt file.
        prompts_per_tag: at most this many prompts per GenEval tag (all when None), chosen evenly through the file.
        seeds: seeds per prompt; the image seed is ``image_seed(seed, prompt_index)``.
        num_inference_steps, guidance_scale, eta: sampler settings (DDIM).
        batch_size: images per sampling batch.
        grid_images: how many images go into each grid PNG.
    """

    prompts: str = "heldout"
    prompts_per_tag: int | None = None
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    eta: float = 0.0
    batch_size: int = 64
    grid_images: int = 64


def eval_config_from(node) -> EvalConfig:
    """`EvalConfig` from the Hydra ``eval`` node (its ``enabled`` switch belongs to the training loop)."""
    from omegaconf import OmegaConf

    return EvalConfig(**{k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "enabled"})


def image_seed(seed: int, prompt_index: int) -> int:
    """The generator seed of the image for `prompt_index` under `seed`."""
    return seed * 1_000_003 + prompt_index


def select_prompts(rows: list[dict], prompts_per_tag: int | None) -> list[dict]:
    """At most `prompts_per_tag` rows per tag, evenly spaced through each tag's rows (rows without a tag count as
    one tag)."""
    if prompts_per_tag is None:
        return list(rows)
    if prompts_per_tag < 1:
        raise ValueError(f"eval.prompts_per_tag must be >= 1 or null, got {prompts_per_tag}")
    by_tag: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_tag[r.get("tag", "all")].append(r)
    out = []
    for tag_rows in by_tag.values():
        n = min(prompts_per_tag, len(tag_rows))
        out += [tag_rows[math.floor(i * len(tag_rows) / n)] for i in range(n)]
    return out


@torch.no_grad()
def generate(policy, rows: list[dict], seeds: list[int], cfg: EvalConfig, use_reference: bool = False):
    """Images `(N, 3, H, W)` in [0, 1] for every (seed, prompt) and their records (prompt, seed, image_seed, tag).

    With `use_reference` the policy samples under ``policy.reference()`` (the adapter-disabled base model).
    """
    jobs = [(s, p, row) for s in seeds for p, row in enumerate(rows)]
    images, records = [], []
    for start in range(0, len(jobs), cfg.batch_size):
        chunk = jobs[start:start + cfg.batch_size]
        gens = [torch.Generator(device="cpu").manual_seed(image_seed(s, p)) for s, p, _ in chunk]
        prompts = [row["prompt"] for _, _, row in chunk]
        if use_reference:
            with policy.reference():
                traj = rollout(policy, prompts, num_inference_steps=cfg.num_inference_steps,
                               guidance_scale=cfg.guidance_scale, eta=cfg.eta, generator=gens)
        else:
            traj = rollout(policy, prompts, num_inference_steps=cfg.num_inference_steps,
                           guidance_scale=cfg.guidance_scale, eta=cfg.eta, generator=gens)
        images.append(traj.images.float().cpu())
        records += [{"prompt": row["prompt"], "seed": s, "image_seed": image_seed(s, p), "prompt_index": p,
                     "tag": row.get("tag")} for s, p, row in chunk]
    return torch.cat(images), records


def _mean_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def score(rewards: dict, images: torch.Tensor, rows: list[dict], records: list[dict]) -> dict[str, dict]:
    """Runs every reward on the images; returns ``{reward name: {"scores": [...], "correct": [...]?}}``."""
    by_prompt = {r["prompt"]: r for r in rows}
    metadata = [by_prompt[rec["prompt"]] for rec in records]
    prompts = [rec["prompt"] for rec in records]
    out = {}
    for name, reward in rewards.items():
        res = reward(images, prompts, metadata)
        entry = {"scores": res.scores.float().tolist()}
        if "correct" in res.info:
            entry["correct"] = [bool(c) for c in res.info["correct"]]
            entry["failed"] = res.info.get("failed")
        out[name] = entry
    return out


def summarize(scored: dict[str, dict], records: list[dict]) -> dict:
    """Means and standard errors per reward, and GenEval-style accuracy overall and per tag."""
    summary: dict = {"num_images": len(records)}
    for name, entry in scored.items():
        m, se = _mean_se(entry["scores"])
        summary[f"{name}/mean"], summary[f"{name}/se"] = m, se
        if "correct" in entry:
            acc, acc_se = _mean_se([float(c) for c in entry["correct"]])
            summary[f"{name}/accuracy"], summary[f"{name}/accuracy_se"] = acc, acc_se
            tags = sorted({rec["tag"] for rec in records if rec["tag"]}, key=lambda t: (t not in TAG_ORDER,
                                                                                       TAG_ORDER.index(t) if t in
                                                                                       TAG_ORDER else 0, t))
            for tag in tags:
                vals = [float(c) for c, rec in zip(entry["correct"], records) if rec["tag"] == tag]
                a, s = _mean_se(vals)
                summary[f"{name}/accuracy/{tag}"] = {"accuracy": a, "se": s, "n": len(vals)}
    return summary


def compare(scored_a: dict, scored_b: dict, label_a: str, label_b: str) -> dict:
    """Paired differences b − a (same prompts and seeds): mean, standard error and their ratio, per reward."""
    out = {}
    for name, entry_a in scored_a.items():
        key = "correct" if "correct" in entry_a else "scores"
        diff = [float(b) - float(a) for a, b in zip(entry_a[key], scored_b[name][key])]
        m, se = _mean_se(diff)
        metric = "accuracy" if key == "correct" else "mean"
        out[f"{name}/{metric}_gain"] = {"gain": m, "se": se, "gain_over_se": m / se if se > 0 else float("inf"),
                                        "of": f"{label_b} - {label_a}"}
    return out


def write_grid(images: torch.Tensor, path: Path, nrow: int = 8) -> None:
    """Saves up to len(images) images `(N, 3, H, W)` in [0, 1] as one PNG grid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_image(make_grid(images.clamp(0, 1), nrow=nrow, padding=1, pad_value=0.5), path)


def evaluate_policy(policy, rows: list[dict], rewards: dict, cfg: EvalConfig, out_dir: Path,
                    variants: dict[str, bool], log=print) -> dict:
    """Generates and scores each variant (``{label: use_reference}``) on `rows`, writes ``<label>_grid.png``,
    ``samples.jsonl`` and ``metrics.json`` under `out_dir`; returns the metrics (with paired gains of every variant
    over the first one)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not rows:
        raise ValueError("eval.prompts selected no prompts; point eval.prompts at a non-empty file")
    metrics: dict = {"prompts": cfg.prompts, "num_prompts": len(rows), "seeds": list(cfg.seeds), "variants": {}}
    scored_all, samples = {}, []
    for label, use_reference in variants.items():
        images, records = generate(policy, rows, list(cfg.seeds), cfg, use_reference=use_reference)
        scored = score(rewards, images, rows, records)
        scored_all[label] = scored
        metrics["variants"][label] = summarize(scored, records)
        write_grid(images[: cfg.grid_images], out_dir / f"{label}_grid.png")
        for i, rec in enumerate(records):
            samples.append({"variant": label, **rec, **{f"{n}": e["scores"][i] for n, e in scored.items()},
                            **{f"{n}/correct": e["correct"][i] for n, e in scored.items() if "correct" in e}})
        log(f"eval {label}: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics["variants"][label].items()
                                          if isinstance(v, float)))
    labels = list(variants)
    for other in labels[1:]:
        metrics[f"{other}_vs_{labels[0]}"] = compare(scored_all[labels[0]], scored_all[other], labels[0], other)
    (out_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics
