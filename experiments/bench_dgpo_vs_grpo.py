"""Benchmark: wall time and rollouts DGPO and Flow-GRPO need to reach the same held-out target.

Both start from the same base model (the tiny world's SD3-format flow model) and the same train prompts, with their
tiny-world recipes (`recipe=tiny_dgpo`, `recipe=tiny_flow_grpo`, each at its recipe's number of epochs unless
`--epochs` is given). During training the hacking monitor measures held-out figures on fixed prompts and seeds every
`--monitor-every` optimizer steps (with 1, after every epoch). For each method and seed the script reports the training
seconds (rollouts + updates, monitor time excluded) and the number of rollouts at the first measurement that reaches
the target, then the ratio Flow-GRPO / DGPO (the DGPO paper reports ≈20× fewer GPU-hours, ≈30× on GenEval). Runs
that never reach the target count as censored at their budget ('+').

Two rewards (`--reward`):

- ``verifier`` (the default): both train on the verifier's dense score; the figure is the held-out accuracy
  (`monitor/gold/geneval_shapes/accuracy`); the target is the base model's accuracy plus `--target-gain`.
- ``brightness``: both train on the toy reward `brightness` (docs/results/learning.md); the figure is the held-out
  brightness (`monitor/gold/brightness/mean`, the verifier's accuracy and the sample diversity monitored beside it).
  Per seed the target is Flow-GRPO's final held-out brightness (so Flow-GRPO reaches it by construction, at the latest
  at its last epoch), and a second, lower target is the base plus `--second-target` × Flow-GRPO's final gain.

Usage (2 CPU cores; a tiny_flow_grpo run is 10–20 minutes with the monitor every epoch, a tiny_dgpo run 3–6)::

    python experiments/bench_dgpo_vs_grpo.py --seeds 0 1 2 --epochs 60 --out runs/bench_dgpo
    python experiments/bench_dgpo_vs_grpo.py --reward brightness --seeds 0 --monitor-every 1 --monitor-prompts 16 \
        --monitor-seeds 4 --out runs/ttt
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

KEYS = {"verifier": "monitor/gold/geneval_shapes/accuracy", "brightness": "monitor/gold/brightness/mean"}
KEY = KEYS["verifier"]
REWARD_OVERRIDES = {"verifier": [],  # the recipes' own reward: the verifier's dense score
                    "brightness": ["reward=[brightness]", "eval_reward=[brightness,geneval_shapes]"]}


def run(method: str, seed: int, args) -> Path:
    out = Path(args.out) / f"{method}-s{seed}"
    if (out / "history.jsonl").is_file() and not args.force:
        return out
    epochs = [] if args.epochs is None else [f"online.num_epochs={args.epochs}"]
    cmd = ["diffalign-train", f"recipe=tiny_{method}", f"seed={seed}", *epochs, *REWARD_OVERRIDES[args.reward],
           f"monitor.every={args.monitor_every}", f"monitor.num_prompts={args.monitor_prompts}",
           f"monitor.seeds=[{','.join(str(i) for i in range(args.monitor_seeds))}]",
           f"monitor.diversity={str(args.reward == 'brightness').lower()}", "monitor.save_samples=false",
           "eval.enabled=false", "trainer.log_with=none", f"output_dir={out}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out


def first_reach(history: list[dict], target: float, key: str = KEY) -> dict | None:
    """The first history row whose monitored `key` is at least `target` (`None` if none is)."""
    for h in history:
        if key in h and h[key] >= target:
            return h
    return None


def time_to_target(histories: dict, args) -> dict:
    """``--reward brightness``: per seed, the targets from Flow-GRPO's curve, each method's first epoch reaching them,
    its rollouts and training seconds, and the ratios Flow-GRPO / DGPO; prints the table, returns the summary."""
    key, out = KEYS["brightness"], {"targets": {}, "runs": {}}
    acc, div = KEYS["verifier"], "monitor/diversity"
    print(f"{'target':<8} {'seed':>4} {'value':>6} {'method':<10} {'epoch':>6} {'rollouts':>9} {'train s':>8}"
          f" {'verifier acc':>12} {'diversity':>9}")
    ratios: dict[str, dict[str, list[float]]] = {}
    for seed in args.seeds:
        grpo = [h for h in histories["flow_grpo", seed] if key in h]
        base, final = grpo[0][key], grpo[-1][key]
        targets = {"final": final, "lower": base + args.second_target * (final - base)}
        out["targets"][seed] = {"base": base, **targets}
        for name, target in targets.items():
            hits = {}
            for method in args.methods:
                h = histories[method, seed]
                hit = first_reach(h, target, key)
                row = hit or h[-1]
                hits[method] = row if hit else None
                out["runs"][f"{name}/{method}/s{seed}"] = {
                    "reached": hit is not None, "epoch": row["epoch"], "rollouts": row["rollouts"],
                    "train_seconds": row["train_seconds"], "value": row.get(key), "verifier_accuracy": row.get(acc),
                    "diversity": row.get(div), "best": max(x[key] for x in h if key in x)}
                mark = "" if hit else "+"
                print(f"{name:<8} {seed:>4} {target:>6.3f} {method:<10} {row['epoch']:>5}{mark:1} {row['rollouts']:>8}"
                      f"{mark:1} {row['train_seconds']:>7.0f}{mark:1} {row.get(acc, float('nan')):>12.3f}"
                      f" {row.get(div, float('nan')):>9.3f}")
            if hits.get("dgpo") and hits.get("flow_grpo"):
                d, g = hits["dgpo"], hits["flow_grpo"]
                r = ratios.setdefault(name, {"rollouts": [], "seconds": []})
                r["rollouts"].append(g["rollouts"] / max(1, d["rollouts"]))
                r["seconds"].append(g["train_seconds"] / max(1e-9, d["train_seconds"]))
    for name, r in ratios.items():
        n = len(r["rollouts"])
        print(f"\nratio Flow-GRPO / DGPO at the {name} target ({n} seed(s) where both reached it): rollouts "
              f"{', '.join(f'{x:.2f}' for x in r['rollouts'])} (median {statistics.median(r['rollouts']):.2f}x), "
              f"wall {', '.join(f'{x:.2f}' for x in r['seconds'])} (median {statistics.median(r['seconds']):.2f}x)")
    out["ratios"] = ratios
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--reward", choices=list(KEYS), default="verifier",
                   help="verifier: held-out accuracy, target base + --target-gain; brightness: held-out brightness, "
                        "target Flow-GRPO's final value (and the lower one of --second-target)")
    p.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: each recipe's own)")
    p.add_argument("--second-target", type=float, default=0.5,
                   help="brightness: the lower target, base + this fraction of Flow-GRPO's final gain")
    p.add_argument("--monitor-every", type=int, default=10, help="optimizer steps between accuracy measurements")
    p.add_argument("--monitor-prompts", type=int, default=117, help="held-out prompts (117 = all)")
    p.add_argument("--monitor-seeds", type=int, default=1, help="images per prompt at each measurement")
    p.add_argument("--target-gain", type=float, default=0.05)
    p.add_argument("--methods", nargs="+", default=["dgpo", "flow_grpo"])
    p.add_argument("--out", default="runs/bench_dgpo")
    p.add_argument("--force", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = p.parse_args()
    if args.reward == "brightness" and "flow_grpo" not in args.methods:  # (before any run starts)
        p.error("--reward brightness takes its target from Flow-GRPO's curve: keep flow_grpo in --methods")

    histories = {}
    for method in args.methods:
        for seed in args.seeds:
            out = run(method, seed, args)
            histories[method, seed] = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    if args.reward == "brightness":
        summary = time_to_target(histories, args)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2))
        return
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
