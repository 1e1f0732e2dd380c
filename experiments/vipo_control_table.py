"""ViPO vs GRPO with random-score controls: the contrasts of two `compare_vipo.py` outputs, video by video.

`compare_vipo.py` run twice with the same options, once with the verifier as reward and once with
`reward=[random_control]` (another `--out`), scores the base and every run on the same held-out prompts and seeds.
This script reads both evaluations' per-video records (`<out>/eval/samples.jsonl`) and prints, for the verifier's
binary accuracy and its dense score, every contrast of the table in docs/results/video.md:

- each arm against the base, with the verifier and with random scores;
- verifier − control per arm (what the reward, not the updates, did);
- ViPO − GRPO with each reward, and the interaction (ViPO's verifier − control minus GRPO's).

Every contrast is a seeds × videos table d_si (seed s of both arms, video i); its mean is reported with three
standard errors: over seeds (std of the S per-seed means / √S), over videos (std of the I per-video means / √I), and
the crossed one of `diffalign.evaluation.bench.crossed_se` (two-way random effects: each variance component counted
once), whose gain/s.e. is printed.

Usage::

    python experiments/vipo_control_table.py runs/video_verifier runs/video_control --reward video_motion
    python experiments/vipo_control_table.py ... --json table.json   # also write every figure
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from compare_vipo import ARMS  # the arms' names, as compare_vipo.py writes its runs' folders

from diffalign.evaluation.bench import crossed_se

SCORES = ("accuracy", "dense")


def per_video(out: Path, reward: str) -> dict[str, dict[str, dict[tuple[int, int], float]]]:
    """``{score: {variant: {(prompt_index, seed): value}}}`` from ``<out>/eval/samples.jsonl``, read once: score
    "accuracy" is ``<reward>/correct`` as 0/1, "dense" is ``<reward>`` (the dense score in [0, 1])."""
    path = Path(out) / "eval" / "samples.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: not found; pass the --out folder of a finished compare_vipo.py run")
    tables: dict[str, dict[str, dict[tuple[int, int], float]]] = {score: {} for score in SCORES}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        key = (r["prompt_index"], r["seed"])
        tables["accuracy"].setdefault(r["variant"], {})[key] = float(r[f"{reward}/correct"])
        tables["dense"].setdefault(r["variant"], {})[key] = float(r[reward])
    return tables


def seeds_of(table: dict) -> list[int]:
    first = next(iter(ARMS))
    return sorted({int(v.split("-s")[1].split("/")[0]) for v in table if v.startswith(f"{first}-s")})


def contrasts(verifier: dict, control: dict) -> dict[str, dict[str, float]]:
    """Every contrast's mean and its three s.e. (see the module docstring). Raises SystemExit if the two evaluations
    did not score the same base videos or the same seeds."""
    if verifier["base"] != control["base"]:
        raise SystemExit("the two evaluations' base videos differ: run both with the same --eval-seeds, prompts and "
                         "evaluation overrides")
    seeds = seeds_of(verifier)
    if seeds != seeds_of(control) or len(seeds) < 2:
        raise SystemExit(f"seeds {seeds} vs {seeds_of(control)}: both runs need the same ≥ 2 training seeds")
    videos = sorted(verifier["base"])

    def run(t, arm, s):
        return t[f"{arm}-s{s}/final"]

    defs = {
        **{f"{arm} {name} − base": (lambda s, i, a=arm, t=t: run(t, a, s)[i] - t["base"][i])
           for arm in ARMS for name, t in (("verifier", verifier), ("control", control))},
        **{f"{arm} verifier − control": (lambda s, i, a=arm: run(verifier, a, s)[i] - run(control, a, s)[i])
           for arm in ARMS},
        **{f"vipo − grpo ({name})": (lambda s, i, t=t: run(t, "vipo", s)[i] - run(t, "grpo", s)[i])
           for name, t in (("verifier", verifier), ("control", control))},
        "interaction": lambda s, i: ((run(verifier, "vipo", s)[i] - run(control, "vipo", s)[i])
                                     - (run(verifier, "grpo", s)[i] - run(control, "grpo", s)[i])),
    }
    out = {}
    for name, f in defs.items():
        table = [{i: f(s, i) for i in videos} for s in seeds]
        per_seed = [statistics.fmean(row.values()) for row in table]
        per_video_mean = [statistics.fmean(row[i] for row in table) for i in videos]
        mean = statistics.fmean(per_seed)
        se = crossed_se(table)
        out[name] = {"mean": mean, "per_seed": per_seed,
                     "se_seeds": statistics.stdev(per_seed) / len(seeds) ** 0.5,
                     "se_videos": statistics.stdev(per_video_mean) / len(videos) ** 0.5,
                     "se_crossed": se, "gain_over_se": mean / se if se > 0 else float("nan")}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("verifier", type=Path, help="--out of the compare_vipo.py run with the verifier as reward")
    p.add_argument("control", type=Path, help="--out of the same run with reward=[random_control]")
    p.add_argument("--reward", default="video_motion", help="the evaluation reward (its <reward>/correct and <reward>)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args()
    result = {}
    verifier, control = per_video(args.verifier, args.reward), per_video(args.control, args.reward)
    for score in SCORES:
        v, c = verifier[score], control[score]
        result[score] = contrasts(v, c)
        base = statistics.fmean(v["base"].values())
        print(f"## {args.reward} {score}: base {base:.3f} on {len(v['base'])} videos")
        for name, r in result[score].items():
            print(f"{name:28s} {r['mean']:+.3f}  ± {r['se_seeds']:.3f} seeds  ± {r['se_videos']:.3f} videos  "
                  f"± {r['se_crossed']:.3f} crossed ({r['gain_over_se']:+.1f})  per seed "
                  + ", ".join(f"{x:+.3f}" for x in r["per_seed"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
