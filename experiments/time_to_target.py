"""Held-out verifier accuracy along training, for a time-to-target comparison (issue 34 item 3: DGPO's claim of
reaching a GenEval target ~20x sooner than Flow-GRPO, arXiv:2510.08425).

For every run folder (a ``diffalign-train`` / ``diffalign-bench`` run with checkpoints and its own evaluation), each
intermediate ``checkpoint-<step>/`` is scored by ``diffalign-eval`` on the run's held-out prompts and seeds (the run's
evaluation settings are given with ``--eval-overrides``; the base's images of the run's own evaluation are the pairs,
so ``--check-base`` re-samples the base once and asserts it matches them), and the run's ``final/`` is its own
evaluation. Per run and checkpoint it prints the epoch, the training seconds up to it (``history.jsonl``'s
``train_seconds``, sampling and updates, evaluation excluded), the rollouts, and the paired accuracy change over the
base ± its s.e. over images; then per method (runs grouped by ``--label``) the mean over seeds at each epoch ± s.e.
over seeds, and the first epoch whose mean reaches ``--target``.

    python experiments/time_to_target.py --label dgpo runs/bench/runs/dgpo-verifier-s* \\
        --label flow_grpo runs/bench/runs/flow_grpo-verifier-s* --target 0.03 \\
        --eval-overrides model=tiny_sd3_wide "eval.seeds=[0,1,2,3,4,5,6,7]"
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path


def correct_by_image(samples: Path, variant: str) -> dict[tuple[int, int], float]:
    """``{(prompt_index, seed): 0/1}`` of one variant's rows of an evaluation's ``samples.jsonl``."""
    out = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        if row["variant"] == variant:
            out[(row["prompt_index"], row["seed"])] = float(row["geneval_shapes/correct"])
    return out


def paired_change(base: dict, tuned: dict) -> tuple[float, float, int]:
    """Mean paired change over the images both scored, its s.e. over images, and their number."""
    diffs = [tuned[k] - base[k] for k in base if k in tuned]
    if len(diffs) < 2:
        raise ValueError(f"only {len(diffs)} paired images")
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)


def history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def evaluate_checkpoint(run: Path, ckpt: Path, overrides: list[str], with_base: bool) -> Path:
    out = run / f"eval_{ckpt.name}"
    if not (out / "metrics.json").is_file():
        cmd = ["diffalign-eval", f"checkpoint={ckpt}", f"include_base={str(with_base).lower()}", "reward=[geneval_shapes]",
               "report=false", f"output_dir={out}", *overrides]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)  # the table alone on stdout
    return out / "samples.jsonl"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", nargs="+", action="append", required=True, metavar=("LABEL", "RUN"),
                   help="a method's label, then its run folders (repeat per method)")
    p.add_argument("--target", type=float, required=True, help="accuracy change over the base to reach")
    p.add_argument("--eval-overrides", nargs="*", default=[], help="diffalign-eval overrides: the runs' evaluation")
    p.add_argument("--check-base", action="store_true",
                   help="also sample the base with the first checkpoint and assert its images' verdicts equal the run's")
    args = p.parse_args(argv)
    curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
    print("method\trun\tepoch\ttrain_s\trollouts\tchange\tse_images\timages")
    first = True
    for label, *runs in args.label:
        for run in map(Path, runs):
            base = correct_by_image(run / "eval" / "samples.jsonl", "base")
            rows = history(run)
            steps_per_epoch = rows[-1]["step"] / rows[-1]["epoch"]
            points = []
            for ckpt in sorted(run.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1])):
                epoch = round(int(ckpt.name.split("-")[1]) / steps_per_epoch)
                if epoch >= rows[-1]["epoch"]:
                    continue  # the last checkpoint is final/, scored by the run's own evaluation
                samples = evaluate_checkpoint(run, ckpt, args.eval_overrides, with_base=args.check_base and first)
                if args.check_base and first:
                    resampled = correct_by_image(samples, "base")
                    if resampled != {k: base[k] for k in resampled}:
                        raise SystemExit(f"the base re-sampled with {args.eval_overrides} does not match {run}/eval")
                    first = False
                points.append((epoch, correct_by_image(samples, "checkpoint")))
            points.append((rows[-1]["epoch"], correct_by_image(run / "eval" / "samples.jsonl", "finetuned")))
            for epoch, tuned in points:
                row = rows[epoch - 1]
                change, se, n = paired_change(base, tuned)
                curves.setdefault(label, {}).setdefault(epoch, []).append((change, row["train_seconds"]))
                print(f"{label}\t{run.name}\t{epoch}\t{row['train_seconds']:.0f}\t{row.get('rollouts', '')}\t"
                      f"{change:+.4f}\t{se:.4f}\t{n}")
    print(f"\nmean over seeds (target {args.target:+.3f})")
    print("method\tepoch\tseeds\ttrain_s\tchange\tse_seeds")
    for label, by_epoch in curves.items():
        reached = None
        for epoch in sorted(by_epoch):
            changes = [c for c, _ in by_epoch[epoch]]
            seconds = statistics.fmean(s for _, s in by_epoch[epoch])
            mean = statistics.fmean(changes)
            se = statistics.stdev(changes) / math.sqrt(len(changes)) if len(changes) > 1 else math.nan
            print(f"{label}\t{epoch}\t{len(changes)}\t{seconds:.0f}\t{mean:+.4f}\t{se:.4f}")
            if reached is None and mean >= args.target:
                reached = (epoch, seconds)
        print(f"{label}: target reached at " + (f"epoch {reached[0]} ({reached[1]:.0f} s of training)" if reached
                                                 else "no evaluated epoch"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
