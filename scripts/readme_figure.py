"""The README's picture: base vs fine-tuned samples of a finished `diffalign-train` run, with the verifier's verdicts.

Reads `<run>/eval/samples.jsonl` and `<run>/eval/images/`, picks the `--num-prompts` held-out prompts whose verifier
accuracy rose the most (the picture says so in its title, with the run's overall paired gain from
`<run>/eval/metrics.json`), and writes one PNG: per prompt a base row and a fine-tuned row, one column per seed, each
image framed green where the verifier (`geneval_shapes/correct`) accepts it and red where it rejects it.

    diffalign-train output_dir=runs/main && python scripts/readme_figure.py runs/main docs/assets/main_job.png
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

GREEN, RED, BLACK, WHITE = (40, 200, 80), (220, 50, 50), (0, 0, 0), (255, 255, 255)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="a finished diffalign-train output_dir (with eval/)")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--cell", type=int, default=64, help="pixels per image (nearest-neighbour upscaling)")
    args = parser.parse_args(argv)

    eval_dir = args.run / "eval"
    rows = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    gain = json.loads((eval_dir / "metrics.json").read_text())["finetuned_vs_base"]["geneval_shapes/accuracy_gain"]
    correct = collections.defaultdict(lambda: [0, 0])
    by_key, prompts = {}, {}
    for r in rows:
        correct[r["prompt_index"]][r["variant"] == "finetuned"] += bool(r["geneval_shapes/correct"])
        by_key[(r["prompt_index"], r["variant"], r["seed"])] = r
        prompts[r["prompt_index"]] = r["prompt"]
    seeds = sorted({r["seed"] for r in rows})
    chosen = sorted(correct, key=lambda i: (correct[i][0] - correct[i][1], i))[:args.num_prompts]

    cell, pad, label_w, line = args.cell, 4, 96, 18
    font = ImageFont.load_default()
    width = label_w + len(seeds) * (cell + pad)
    height = 2 * line + len(chosen) * (line + 2 * (cell + pad))
    canvas = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 2), f"held-out verifier accuracy {gain['gain']:+.3f} ± {gain['se']:.3f} (paired s.e.); "
                      f"the {len(chosen)} prompts that gained most", fill=BLACK, font=font)
    draw.text((4, 2 + line // 1), "green frame: the verifier accepts the image; red: it rejects it", fill=BLACK,
              font=font)
    y = 2 * line
    for i in chosen:
        draw.text((4, y + 2), f'"{prompts[i]}"', fill=BLACK, font=font)
        y += line
        for variant in ("base", "finetuned"):
            draw.text((4, y + cell // 2 - 6), variant.replace("finetuned", "fine-tuned"), fill=BLACK, font=font)
            for k, s in enumerate(seeds):
                r = by_key[(i, variant, s)]
                img = Image.open(eval_dir / r["image"]).convert("RGB").resize((cell - 6, cell - 6), Image.NEAREST)
                x = label_w + k * (cell + pad)
                draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=GREEN if r["geneval_shapes/correct"] else RED)
                canvas.paste(img, (x + 3, y + 3))
            y += cell + pad
    args.out.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(args.out, optimize=True)
    print(args.out)


if __name__ == "__main__":
    main()
