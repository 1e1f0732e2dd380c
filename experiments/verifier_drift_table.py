"""Per-run figures for the verifier-drift study (docs/results/verifier.md, "Verifier drift"): for each benchmark run
folder, the held-out verifier change (accuracy and dense score, paired over the evaluation's images), how far the
fine-tuned images moved from the base's at the same prompt and seed (image drift: mean absolute pixel difference in [0,
1]), how many images the verifier flipped each way, and from history.jsonl the training reward's first-2 / last-3 epoch
means, the mean fraction of zero-variance groups, the last epoch's KL to the base and the mean clip fraction and
approximate KL of the updates.

    python experiments/verifier_drift_table.py runs/v/runs/*-s0-*      # one row per finished run
    python experiments/verifier_drift_table.py --flips runs/v/runs/*/  # per image: how many runs lost / fixed it
    python experiments/verifier_drift_table.py --seeds 0,1 runs/a runs/b  # over evaluation seeds 0 and 1 only
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SKIP = ("eval.", "trainer.log_with", "recipe=", "eval_reward=", "seed=", "data.seed=")


def figures(run: Path, variant: str = "finetuned", eval_dir: Path | None = None,
            seeds: set[int] | None = None) -> dict | None:
    """One run's figures; or, with `eval_dir`, those of `variant` in a ``diffalign-eval`` folder of checkpoints; with
    `seeds`, over the images of those evaluation seeds only (runs evaluated on more seeds then pair with the others)."""
    if eval_dir is None and not (run / "results.json").is_file():
        return None
    res = json.loads((run / "results.json").read_text()) if eval_dir is None else {}
    eval_dir = eval_dir or run / "eval"
    rows = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines()]
    base = {(r["prompt_index"], r["seed"]): r for r in rows if r["variant"] == "base"}
    ft = {(r["prompt_index"], r["seed"]): r for r in rows if r["variant"] == variant}
    keys = sorted(k for k in base.keys() & ft.keys() if seeds is None or k[1] in seeds)
    if not keys or "geneval_shapes/correct" not in base[keys[0]]:
        return None  # a run evaluated without the verifier
    acc = np.array([float(ft[k]["geneval_shapes/correct"]) - float(base[k]["geneval_shapes/correct"]) for k in keys])
    dense = np.array([ft[k]["geneval_shapes"] - base[k]["geneval_shapes"] for k in keys])
    drift = []
    for k in keys:
        a = np.asarray(Image.open(eval_dir / base[k]["image"]).convert("RGB"), dtype=np.float32) / 255
        b = np.asarray(Image.open(eval_dir / ft[k]["image"]).convert("RGB"), dtype=np.float32) / 255
        drift.append(float(np.abs(a - b).mean()))
    n = len(keys)
    out = {"run": run.name if variant == "finetuned" else variant, "acc_base": float(np.mean([base[k]["geneval_shapes/correct"] for k in keys])),
           "dense_base": float(np.mean([base[k]["geneval_shapes"] for k in keys])),
           "acc_change": acc.mean(), "acc_se": acc.std(ddof=1) / math.sqrt(n),
           "dense_change": dense.mean(), "dense_se": dense.std(ddof=1) / math.sqrt(n),
           "image_drift": statistics.fmean(drift), "lost": int((acc < 0).sum()), "gained": int((acc > 0).sum()),
           "seconds": res.get("total_seconds")}
    if "brightness" in rows[0]:
        out["brightness_change"] = float(np.mean([ft[k]["brightness"] - base[k]["brightness"] for k in keys]))
    over = run / "bench_overrides.json"
    out["overrides"] = " ".join(o for o in json.loads(over.read_text()) if not o.startswith(SKIP)) if over.is_file() else ""
    hist = run / "history.jsonl"
    if hist.is_file():
        h = [json.loads(line) for line in hist.read_text().splitlines()]
        curve = [r["reward/mean"] for r in h if "reward/mean" in r]
        z = [r["advantage/zero_std_fraction"] for r in h if "advantage/zero_std_fraction" in r]
        if len(curve) >= 5:
            out["train_first2"] = statistics.fmean(curve[:2])
            out["train_last3"] = statistics.fmean(curve[-3:])
        if z:
            out["zero_std"] = statistics.fmean(z)
        for key, name in (("kl", "kl_last"), ("clipfrac", "clipfrac_mean"), ("approx_kl", "approx_kl_mean")):
            values = [r[key] for r in h if key in r]
            if values:
                out[name] = values[-1] if name.endswith("_last") else statistics.fmean(values)
    return out


def flips(paths: list[str]) -> None:
    """Over runs evaluated on the same images: per base-correct image the fraction of runs that lost it, per base-wrong
    image the fraction that fixed it, and the mean numbers lost and gained per run."""
    lost: dict = {}
    gained: dict = {}
    base_ok: dict | None = None
    runs = 0
    for p in paths:
        samples = Path(p) / "eval" / "samples.jsonl"
        if not samples.is_file():
            continue
        rows = [json.loads(line) for line in samples.read_text().splitlines()]
        if "geneval_shapes/correct" not in rows[0]:
            continue
        b = {(r["prompt_index"], r["seed"]): r for r in rows if r["variant"] == "base"}
        f = {(r["prompt_index"], r["seed"]): r["geneval_shapes/correct"] for r in rows if r["variant"] == "finetuned"}
        if base_ok is None:
            base_ok = {k: r["geneval_shapes/correct"] for k, r in b.items()}
        if {k: r["geneval_shapes/correct"] for k, r in b.items()} != base_ok or f.keys() != base_ok.keys():
            continue  # another evaluation set or base
        runs += 1
        for k, ok in base_ok.items():
            if ok and not f[k]:
                lost[k] = lost.get(k, 0) + 1
            if f[k] and not ok:
                gained[k] = gained.get(k, 0) + 1
    if not runs:
        print("no run with a verifier evaluation")
        return
    prompt = {(r["prompt_index"], r["seed"]): r["prompt"] for r in rows}
    right = sorted((k for k in base_ok if base_ok[k]), key=lambda k: -lost.get(k, 0))
    wrong = sorted((k for k in base_ok if not base_ok[k]), key=lambda k: -gained.get(k, 0))
    print(f"{runs} runs on {len(base_ok)} images ({len(right)} correct in the base)")
    print(f"per run: lost {sum(lost.values()) / runs:.1f}, gained {sum(gained.values()) / runs:.1f}")
    print("base-correct images, fraction of runs losing each:",
          " ".join(f"{lost.get(k, 0) / runs:.2f}" for k in right))
    print("base-wrong images, fraction of runs fixing each:", " ".join(f"{gained.get(k, 0) / runs:.2f}" for k in wrong))
    for k in right[:4]:
        print(f"  most often lost: {prompt[k]!r} seed {k[1]} ({lost.get(k, 0) / runs:.2f})")


def main(paths: list[str], seeds: set[int] | None = None) -> None:
    """Rows for run folders; a ``diffalign-eval`` folder (``samples.jsonl`` at its top) gives a row per variant."""
    cols = ["run", "overrides", "acc_base", "dense_base", "acc_change", "acc_se", "dense_change", "dense_se", "image_drift", "lost", "gained",
            "brightness_change", "train_first2", "train_last3", "zero_std", "kl_last", "clipfrac_mean",
            "approx_kl_mean", "seconds"]
    print("\t".join(cols))
    for p in paths:
        if (Path(p) / "samples.jsonl").is_file():  # a diffalign-eval folder: every variant against its base
            variants = dict.fromkeys(json.loads(line)["variant"] for line in (Path(p) / "samples.jsonl").open())
            found = [figures(Path(p), v, eval_dir=Path(p), seeds=seeds) for v in variants if v != "base"]
        else:
            found = [figures(Path(p), seeds=seeds)]
        for f in found:
            if f is None:
                continue
            print("\t".join(f"{f[c]:.4f}" if isinstance(f.get(c), float) else str(f.get(c, "")) for c in cols))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--flips"]:
        flips(sys.argv[2:])
    elif sys.argv[1:2] == ["--seeds"]:  # --seeds 0,1 <run folders>: the images of evaluation seeds 0 and 1 only
        main(sys.argv[3:], {int(s) for s in sys.argv[2].split(",")})
    else:
        main(sys.argv[1:])
