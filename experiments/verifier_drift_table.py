"""Per-run figures for the verifier-drift study (docs/results/verifier.md, "Verifier drift"): for each benchmark run
folder, the held-out verifier change (accuracy and dense score, paired over the evaluation's images), how far the
fine-tuned images moved from the base's at the same prompt and seed (image drift: mean absolute pixel difference in [0,
1]), how many images the verifier flipped each way, and from history.jsonl the training reward's first-2 / last-3 epoch
means, the mean fraction of zero-variance groups, the last epoch's KL to the base and the mean clip fraction and
approximate KL of the updates; the change of each evaluation reward it finds (brightness, clip_score), paired over the
images. ``--pool FIELD`` adds, over the runs given (seeds of one setting, scored on the same images), the mean paired
change of a per-image column with its s.e. over runs, the s.e. over images of the run-averaged per-image change, and
the change over the s.e. of a mean over runs crossed with images (`diffalign.evaluation.bench.crossed_se`, the
benchmark's convention and code).

    python experiments/verifier_drift_table.py runs/v/runs/*-s0-*      # one row per finished run
    python experiments/verifier_drift_table.py --flips runs/v/runs/*/  # per image: how many runs lost / fixed it
    python experiments/verifier_drift_table.py --seeds 0,1 runs/a runs/b  # over evaluation seeds 0 and 1 only
    python experiments/verifier_drift_table.py --seeds 0,1 --pool clip_score runs/s0 runs/s1 runs/s2  # + the pooled row
    python experiments/verifier_drift_table.py --pool clip_score --control runs/c0 runs/s0 runs/s1  # + minus a control
    python experiments/verifier_drift_table.py --by-tag --control runs/c0 --control runs/c1 runs/s0 runs/s1  # per tag
    python experiments/verifier_drift_table.py --failures position runs/s0  # which constraints the wrong images fail
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
from PIL import Image

REWARDS = ("brightness", "clip_score")  # evaluation rewards whose paired change is reported beside the verifier's
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
    for name in REWARDS:
        if name in rows[0]:
            change = np.array([ft[k][name] - base[k][name] for k in keys])
            out[f"{name}_base"] = float(np.mean([base[k][name] for k in keys]))
            out[f"{name}_change"], out[f"{name}_se"] = float(change.mean()), float(change.std(ddof=1) / math.sqrt(n))
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


def _gains(paths: list[str], field: str, seeds: set[int] | None) -> list[dict[str, float]]:
    from diffalign.evaluation.bench import image_gains

    gains = [image_gains(Path(p) / "eval", field) for p in paths]
    if seeds is not None:
        gains = [{k: v for k, v in g.items() if int(k.rsplit("_s", 1)[1]) in seeds} for g in gains]
    return [g for g in gains if g]


def prompt_clustered(gains: list[dict[str, float]]) -> str:
    """The s.e. of the run-averaged mean change with the images clustered by prompt (``p<prompt>_s<seed>``): the s.e.
    over prompts of each prompt's mean change, the images of one prompt counted as one draw. It is the s.e. to read when
    the question is about new prompts rather than new seeds of these prompts; a ratio to the per-image s.e. well above
    1 says the images of a prompt move together (design effect 1 + (m − 1)ρ for m images per prompt)."""
    keys = sorted(set(gains[0]).intersection(*gains[1:]))
    by_prompt: dict[str, list[float]] = {}
    for k in keys:
        by_prompt.setdefault(k.rsplit("_s", 1)[0], []).append(float(np.mean([g[k] for g in gains])))
    means = [float(np.mean(v)) for v in by_prompt.values()]
    if len(means) < 2:
        return "clustered by prompt: fewer than 2 prompts"
    mean, se = statistics.fmean(means), statistics.stdev(means) / math.sqrt(len(means))
    return f"clustered by prompt ({len(means)} prompts): {mean:+.4f} ± {se:.4f} ({mean / se:.1f})"


def pooled(paths: list[str], field: str, seeds: set[int] | None = None, controls: list[str] = ()) -> None:
    """Over runs scored on the same images (e.g. seeds of one setting): the mean paired change of ``field`` ± its s.e.
    over runs, the s.e. over images of the run-averaged per-image change, and the change over `crossed_se`; with
    `controls` (e.g. random-score runs on the same images), the change minus the controls' run-averaged change, with
    the s.e. over images of that per-image difference."""
    from diffalign.evaluation.bench import _image_se, _mean_se, crossed_se

    gains = _gains(paths, field, seeds)
    if not gains:
        print(f"--pool {field}: no run has that column in eval/samples.jsonl")
        return
    mean, se_runs = _mean_se([float(np.mean(list(g.values()))) for g in gains])
    se_images = _image_se(gains) if len(gains) > 1 else math.nan
    combined = crossed_se(gains) if len(gains) > 1 else math.nan
    print(f"pooled {field} over {len(gains)} runs, {len(gains[0])} images: change {mean:+.4f} ± {se_runs:.4f} over runs "
          f"({mean / se_runs:.1f}); ± {se_images:.4f} over images, runs averaged ({mean / se_images:.1f}); combined "
          f"± {combined:.4f} ({mean / combined:.1f}); {prompt_clustered(gains)}")
    against = _gains(list(controls), field, seeds)
    if against and all(set(g) == set(gains[0]) for g in against):
        keys = sorted(gains[0])
        diff = np.array([np.mean([g[k] for g in gains]) - np.mean([c[k] for c in against]) for k in keys])
        se = diff.std(ddof=1) / math.sqrt(len(diff))
        print(f"  minus {len(against)} control run(s): {diff.mean():+.4f} ± {se:.4f} over images ({diff.mean() / se:.1f})")


def _eval_dir(path: str) -> Path:
    """The folder holding ``samples.jsonl``: a ``diffalign-eval`` folder itself, or a run folder's ``eval/``."""
    return Path(path) if (Path(path) / "samples.jsonl").is_file() else Path(path) / "eval"


def _tag_changes(path: str, seeds: set[int] | None) -> dict[str, list[float]]:
    """One run's paired accuracy changes (fine-tuned − base, per image: −1, 0 or 1), grouped by prompt tag; a
    ``diffalign-eval`` folder (``samples.jsonl`` at its top, one checkpoint against the base) reads the same way."""
    samples = _eval_dir(path) / "samples.jsonl"
    if not samples.is_file():
        return {}
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    if not rows or "geneval_shapes/correct" not in rows[0]:
        return {}
    base = {(r["prompt_index"], r["seed"]): r for r in rows if r["variant"] == "base"}
    out: dict[str, list[float]] = {}
    for r in rows:
        k = (r["prompt_index"], r["seed"])
        if r["variant"] != "base" and k in base and (seeds is None or k[1] in seeds):
            change = float(r["geneval_shapes/correct"]) - float(base[k]["geneval_shapes/correct"])
            out.setdefault(r.get("tag") or "untagged", []).append(change)
    return out


def by_tag(paths: list[str], seeds: set[int] | None = None, controls: list[str] = ()) -> None:
    """Per prompt tag: the number of images per run, the mean over runs of the run's paired accuracy change ± its s.e.
    over runs, and with `controls` the controls' mean change and the difference (s.e. of the difference of two
    independent means over runs). A split whose tags carry unequal weight (the shapes world's held-out split: 80 of
    117 prompts are ``position``) is read here tag by tag."""
    from diffalign.evaluation.bench import _mean_se

    runs = [c for c in (_tag_changes(p, seeds) for p in paths) if c]
    ctrl = [c for c in (_tag_changes(p, seeds) for p in controls) if c]
    if not runs:
        print("--by-tag: no run with a verifier evaluation")
        return
    tags = sorted({t for r in runs for t in r}, key=lambda t: -len(runs[0].get(t, [])))
    print(f"accuracy change by tag over {len(runs)} run(s)" + (f", minus {len(ctrl)} control(s)" if ctrl else ""))
    print("tag\timages\tchange\tse_runs" + ("\tcontrol\tse_control\tdifference\tse_difference" if ctrl else ""))

    def change(run: dict[str, list[float]], tag: str) -> float:
        values = [v for vs in run.values() for v in vs] if tag == "all" else run.get(tag, [])
        return float(np.mean(values)) if values else math.nan

    for tag in ["all", *tags]:
        mean, se = _mean_se([change(r, tag) for r in runs])
        n = sum(len(v) for v in runs[0].values()) if tag == "all" else len(runs[0].get(tag, []))
        line = f"{tag}\t{n}\t{mean:+.4f}\t{se:.4f}"
        if ctrl:
            cmean, cse = _mean_se([change(r, tag) for r in ctrl])
            diff_se = math.hypot(se, cse) if not (math.isnan(se) or math.isnan(cse)) else math.nan
            line += f"\t{cmean:+.4f}\t{cse:.4f}\t{mean - cmean:+.4f}\t{diff_se:.4f}"
        print(line)


def failures(paths: list[str], tag: str, seeds: set[int] | None = None) -> None:
    """For each run folder (or ``diffalign-eval`` folder) and variant, over the images of prompts tagged `tag` (``all``:
    every image): how many are wrong, and how many images fail each kind of constraint (``count``, ``color``,
    ``position``, ``no_extra``; an image failing two objects' counts is counted once), re-scored with
    `diffalign.world.verifier.verify` on the saved images."""
    from diffalign.world.prompts import all_prompts
    from diffalign.world.verifier import parse_caption, verify

    specs = {r["prompt"]: r for split in all_prompts().values() for r in split}
    kinds = ("count", "color", "position", "no_extra")
    print("run\tvariant\timages\twrong\t" + "\t".join(kinds))
    for p in paths:
        folder = _eval_dir(p)
        if not (folder / "samples.jsonl").is_file():
            continue
        counts: dict[str, dict[str, int]] = {}
        for line in (folder / "samples.jsonl").read_text().splitlines():
            r = json.loads(line)
            if (tag != "all" and r.get("tag") != tag) or (seeds is not None and r["seed"] not in seeds):
                continue
            image = np.asarray(Image.open(folder / r["image"]).convert("RGB"))
            verdict = verify(image, specs.get(r["prompt"]) or parse_caption(r["prompt"]))
            c = counts.setdefault(r["variant"], dict.fromkeys(("images", "wrong", *kinds), 0))
            c["images"] += 1
            c["wrong"] += not verdict.correct
            for kind in {f.split("/")[0] for f in verdict.failed}:
                c[kind] += 1
        for variant, c in counts.items():
            print(f"{Path(p).name}\t{variant}\t" + "\t".join(str(c[k]) for k in ("images", "wrong", *kinds)))


def main(paths: list[str], seeds: set[int] | None = None) -> None:
    """Rows for run folders; a ``diffalign-eval`` folder (``samples.jsonl`` at its top) gives a row per variant."""
    cols = ["run", "overrides", "acc_base", "dense_base", "acc_change", "acc_se", "dense_change", "dense_se", "image_drift", "lost", "gained",
            *(f"{name}_{part}" for name in REWARDS for part in ("base", "change", "se")), "train_first2", "train_last3", "zero_std", "kl_last", "clipfrac_mean",
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flips", action="store_true", help="per image: how many runs lost / fixed it")
    parser.add_argument("--seeds", help="evaluation seeds to read, comma-separated (e.g. 0,1); default all")
    parser.add_argument("--pool", action="append", default=[], metavar="FIELD",
                        help="a per-image column of samples.jsonl (e.g. clip_score) to pool over the runs; repeatable")
    parser.add_argument("--control", action="append", default=[], metavar="RUN",
                        help="with --pool or --by-tag: a control run on the same images (e.g. random scores) to "
                             "subtract; repeatable")
    parser.add_argument("--by-tag", action="store_true",
                        help="the paired accuracy change per prompt tag, pooled over the runs (and --control runs)")
    parser.add_argument("--failures", metavar="TAG",
                        help="per variant, the images of prompts with this tag (or 'all') failing each kind of constraint")
    parser.add_argument("paths", nargs="+", help="run folders (or diffalign-eval folders)")
    args = parser.parse_args()
    if args.flips:
        flips(args.paths)
        sys.exit(0)
    chosen = {int(s) for s in args.seeds.split(",")} if args.seeds else None
    if args.by_tag:
        by_tag(args.paths, chosen, args.control)
        sys.exit(0)
    if args.failures:
        failures(args.paths, args.failures, chosen)
        sys.exit(0)
    main(args.paths, chosen)
    for column in args.pool:
        pooled(args.paths, column, chosen, args.control)
