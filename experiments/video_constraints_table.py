"""Per-constraint rates of a video evaluation: which part of the motion verifier's dense score moved?

Reads an evaluation folder written by ``diffalign-eval`` with ``reward=[video_motion]`` (its ``samples.jsonl`` and the
GIF of every video), re-runs the motion verifier (`diffalign.world.video.verify_video`) on each video and prints, per
variant (base, each checkpoint):

- ``identity``: the fraction of named objects kept across frames (one object of the colour and shape in every frame);
- ``motion``: the fraction of named objects whose track moves the named way (the verifier's ``motion/i``);
- ``direction_sign``: of the moving objects found in every frame, the fraction whose first→last displacement points
  the named way and dominates the other axis (0.25 for a direction drawn at random);
- ``no_extra``: the fraction of videos with no frame holding more objects than the prompt names;
- ``dense`` and ``strict``: the verifier's score and accuracy (they match the evaluation's own figures).

    python experiments/video_constraints_table.py runs/cmp_video/eval

GIFs are stored as 8-bit palettes, so a re-verified video can differ from the one scored in memory at a colour
threshold; the script prints the agreement of its dense score with ``samples.jsonl``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("eval_dir", type=Path)
    args = p.parse_args(argv)
    import imageio.v3 as iio

    from diffalign.world.video import direction_sign, parse_video_caption, verify_video

    rows = [json.loads(line) for line in (args.eval_dir / "samples.jsonl").open()]
    if not rows or "video" not in rows[0]:
        raise SystemExit(f"{args.eval_dir}/samples.jsonl has no videos: pass a video evaluation folder")
    stats: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        spec = parse_video_caption(r["prompt"])
        video = np.asarray(iio.imread(args.eval_dir / r["video"], index=None))[..., :3]
        v = verify_video(video, spec)
        s = stats[r["variant"]]
        for name, ok in v.constraints.items():
            s[name.split("/")[0]].append(ok)
        s["direction_sign"] += direction_sign(v.tracks, spec)
        s["dense"].append(v.score)
        s["strict"].append(v.correct)
        s["agree"].append(abs(v.score - r.get("video_motion", v.score)) < 1e-6)
    cols = ["identity", "motion", "direction_sign", "no_extra", "dense", "strict"]
    print("| variant | videos | " + " | ".join(cols) + " | dense agrees with samples.jsonl |")
    print("|---|---|" + "---|" * len(cols) + "---|")
    for variant, s in stats.items():
        cells = []
        for c in cols:
            x = np.asarray(s[c], dtype=float)
            cells.append(f"{x.mean():.3f} ± {x.std(ddof=1) / np.sqrt(len(x)):.3f} (n {len(x)})" if len(x) > 1 else "–")
        print(f"| {variant} | {len(s['dense'])} | " + " | ".join(cells) + f" | {np.mean(s['agree']):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
