"""ViPO vs GRPO on the tiny world, same budget: verifier accuracy of the fine-tuned models on held-out prompts.

Both arms run the same recipe (`--recipe`, default `tiny_vipo_image`: the tiny SD3-format flow model, Flow-GRPO SDE
rollouts, initial noise shared in a group, no KL, 60 % of the transitions, the same epochs, prompts, learning rate and
seeds). They differ only in the advantage:

- `vipo`: the Perceptual Structuring Module's maps and the per-position clipped ratio (`method.reduction=per_position`);
- `grpo`: all-ones maps with `method.reduction=scalar_weighted`, which is GRPO (DanceGRPO) exactly (tested).

Every run trains with evaluation off; then one `diffalign-eval` call scores the base and every run's `final/` LoRA on
the same held-out prompts and per-image seeds, and the script reports per arm the mean held-out accuracy over seeds
± its standard error (between seeds), and the mean paired gain over the base.

Usage::

    python experiments/compare_vipo.py --seeds 0 1 2 --epochs 30 --out runs/compare_vipo
    python experiments/compare_vipo.py --recipe tiny_vipo_wan --model tiny_wan_t2v --reward video_motion \
        --metric mean --out runs/compare_vipo_video  # video: the Wan-format base, the motion verifier
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

METRIC = ["accuracy"]
ARMS = {"vipo": ["method.map=psm", "method.reduction=per_position"],
        "grpo": ["method.map=ones", "method.reduction=scalar_weighted"]}


def train_cmd(arm: str, seed: int, args) -> tuple[Path, list[str] | None]:
    out = Path(args.out) / f"{arm}-s{seed}"
    if (out / "final" / "pytorch_lora_weights.safetensors").is_file() and not args.force:
        return out, None
    return out, ["diffalign-train", f"recipe={args.recipe}", f"seed={seed}", f"online.num_epochs={args.epochs}",
                 "eval.enabled=false", "trainer.log_with=none", f"output_dir={out}", *ARMS[arm], *args.overrides]


def train_all(args) -> dict[str, list[Path]]:
    """Every (arm, seed) run, `--jobs` at a time (each process single-threaded via OMP_NUM_THREADS)."""
    jobs = [(arm, seed, *train_cmd(arm, seed, args)) for arm in ARMS for seed in args.seeds]
    pending, running = [j for j in jobs if j[3] is not None], []
    while pending or running:
        while pending and len(running) < args.jobs:
            arm, seed, out, cmd = pending.pop(0)
            print("$", " ".join(cmd), flush=True)
            out.mkdir(parents=True, exist_ok=True)
            log = open(out.parent / f"{arm}-s{seed}.log", "w")  # noqa: SIM115 - closed when the process ends
            running.append((out, time.time(), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        for item in list(running):
            out, t, proc, log = item
            if proc.poll() is not None:
                log.close()
                if proc.returncode:
                    raise RuntimeError(f"training run {out} failed (exit {proc.returncode}); see {log.name}")
                (out / "wall_seconds.txt").write_text(f"{time.time() - t:.1f}\n")
                running.remove(item)
        time.sleep(2)
    return {arm: [out for a, _, out, _ in jobs if a == arm] for arm in ARMS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="tiny_vipo_image")
    p.add_argument("--model", default="tiny_sd3", help="model config of the evaluation (the recipe's model)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--eval-seeds", default="[0,1,2,3]")
    p.add_argument("--reward", default="geneval_shapes", help="the evaluation reward whose accuracy is reported")
    p.add_argument("--eval-overrides", nargs="*", default=[])
    p.add_argument("--out", default="runs/compare_vipo")
    p.add_argument("--force", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="training runs at a time")
    p.add_argument("--metric", default="accuracy", choices=["accuracy", "mean"],
                   help="what is compared: the reward's binary accuracy or its mean (dense) score")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every training run")
    args = p.parse_args()
    METRIC[0] = args.metric
    runs = train_all(args)
    ckpts = ["base"] + [str(r / "final") for arm in ARMS for r in runs[arm]]
    eval_dir = Path(args.out) / "eval"
    cmd = ["diffalign-eval", f"model={args.model}", f"checkpoints=[{','.join(ckpts)}]", f"eval.seeds={args.eval_seeds}",
           f"output_dir={eval_dir}", "report=false", *args.eval_overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    summary = summarise(metrics, runs, args)
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def accuracy_of(metrics: dict, label: str, reward: str) -> float:
    return float(metrics["variants"][label][f"{reward}/{METRIC[0]}"])


def summarise(metrics: dict, runs: dict, args) -> dict:
    labels = metrics["labels"]
    base = accuracy_of(metrics, labels[0], args.reward)
    out = {"recipe": args.recipe, "metric": f"{args.reward}/{args.metric}", "epochs": args.epochs, "seeds": args.seeds, "reward": args.reward,
           "base_accuracy": base, "eval_images_per_model": metrics["variants"][labels[0]].get("num_images"),
           "arms": {}}
    for arm, arm_runs in runs.items():
        accs = [accuracy_of(metrics, f"{r.name}/final", args.reward) for r in arm_runs]
        se = statistics.stdev(accs) / len(accs) ** 0.5 if len(accs) > 1 else float("nan")
        wall = [float((r / "wall_seconds.txt").read_text()) for r in arm_runs if (r / "wall_seconds.txt").is_file()]
        out["arms"][arm] = {"per_seed": accs, "mean": statistics.mean(accs), "se": se,
                            "gain_over_base": statistics.mean(accs) - base,
                            "train_wall_seconds_mean": statistics.mean(wall) if wall else None}
    v, g = out["arms"]["vipo"], out["arms"]["grpo"]
    diffs = [a - b for a, b in zip(v["per_seed"], g["per_seed"])]
    out["vipo_minus_grpo"] = {"per_seed": diffs, "mean": statistics.mean(diffs),
                              "se": statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else float("nan")}
    return out


if __name__ == "__main__":
    main()
