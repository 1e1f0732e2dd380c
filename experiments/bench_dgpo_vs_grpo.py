"""Benchmark: wall time and rollouts DGPO and Flow-GRPO need to reach the same held-out verifier accuracy.

Both start from the same base model (the tiny world's SD3-format flow model) and the same train prompts, with their
tiny-world recipes (`recipe=tiny_dgpo`, `recipe=tiny_flow_grpo`). During training the hacking monitor measures the
held-out accuracy of the verifier (`monitor/gold/geneval_shapes/accuracy`) on fixed prompts and seeds every
`--monitor-every` optimizer steps. The target is the base model's accuracy plus `--target-gain`; for each method and
seed the script reports the training seconds (rollouts + updates, monitor time excluded) and the number of rollouts
at the first measurement that reaches it, then the ratio Flow-GRPO / DGPO of the medians (the DGPO paper reports
≈20× fewer GPU-hours, ≈30× on GenEval). Runs that never reach the target count as censored at their budget.

Usage (about 4 minutes per run on 2 CPU cores)::

    python experiments/bench_dgpo_vs_grpo.py --seeds 0 1 2 --epochs 60 --out runs/bench_dgpo
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

KEY = "monitor/gold/geneval_shapes/accuracy"


def run(method: str, seed: int, args) -> Path:
    out = Path(args.out) / f"{method}-s{seed}"
    if (out / "history.jsonl").is_file() and not args.force:
        return out
    cmd = ["diffalign-train", f"recipe=tiny_{method}", f"seed={seed}", f"online.num_epochs={args.epochs}",
           f"monitor.every={args.monitor_every}", f"monitor.num_prompts={args.monitor_prompts}",
           f"monitor.seeds=[{','.join(str(i) for i in range(args.monitor_seeds))}]", "monitor.diversity=false", "eval.enabled=false", "trainer.log_with=none",
           f"output_dir={out}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out


def first_reach(history: list[dict], target: float) -> dict | None:
    for h in history:
        if KEY in h and h[KEY] >= target:
            return h
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--monitor-every", type=int, default=10, help="optimizer steps between accuracy measurements")
    p.add_argument("--monitor-prompts", type=int, default=117, help="held-out prompts (117 = all)")
    p.add_argument("--monitor-seeds", type=int, default=1, help="images per prompt at each measurement")
    p.add_argument("--target-gain", type=float, default=0.05)
    p.add_argument("--methods", nargs="+", default=["dgpo", "flow_grpo"])
    p.add_argument("--out", default="runs/bench_dgpo")
    p.add_argument("--force", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args()

    histories = {}
    for method in args.methods:
        for seed in args.seeds:
            out = run(method, seed, args)
            histories[method, seed] = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    base = statistics.mean(h[0][KEY] for h in histories.values() if KEY in h[0])
    target = base + args.target_gain
    print(f"\nbase held-out accuracy {base:.3f} ({args.monitor_prompts} prompts x {args.monitor_seeds} seeds); target {target:.3f}\n")
    print(f"{'method':<10} {'seed':>4} {'reached':>8} {'seconds':>8} {'rollouts':>9} {'best acc':>9} {'final acc':>9}"
          f" {'train reward first/last 5 epochs':>34}")
    summary = {}
    for method in args.methods:
        secs, rolls = [], []
        for seed in args.seeds:
            h = histories[method, seed]
            hit = first_reach(h, target)
            accs = [x[KEY] for x in h if KEY in x]
            last = h[-1]
            s = hit["train_seconds"] if hit else last["train_seconds"]
            r = hit["rollouts"] if hit else last["rollouts"]
            secs.append(s)
            rolls.append(r)
            train_r = [x["reward/mean"] for x in h if "reward/mean" in x]
            first, last = statistics.mean(train_r[:5]), statistics.mean(train_r[-5:])
            print(f"{method:<10} {seed:>4} {'yes' if hit else 'no':>8} {s:>8.0f}{'' if hit else '+'} {r:>9}"
                  f"{'' if hit else '+'} {max(accs):>9.3f} {accs[-1]:>9.3f} {first:>22.3f} / {last:.3f}")
        summary[method] = {"median_seconds": statistics.median(secs), "median_rollouts": statistics.median(rolls),
                           "reached": sum(first_reach(histories[method, s], target) is not None for s in args.seeds)}
    if {"dgpo", "flow_grpo"} <= set(summary):
        d, g = summary["dgpo"], summary["flow_grpo"]
        print(f"\nratio Flow-GRPO / DGPO: wall time {g['median_seconds'] / d['median_seconds']:.2f}x, rollouts "
              f"{g['median_rollouts'] / d['median_rollouts']:.2f}x (medians; '+' = target not reached, censored at "
              f"the budget; reached: DGPO {d['reached']}/{len(args.seeds)}, Flow-GRPO {g['reached']}/{len(args.seeds)})")
    (Path(args.out) / "summary.json").write_text(json.dumps({"base": base, "target": target, **summary}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
