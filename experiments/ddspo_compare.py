"""Tables for docs/results/methods.md#ddspo: the comparison of runs, and how good a tiny-world DDSPO pairs folder is.

    python experiments/ddspo_compare.py runs runs/ddspo_cmp          # held-out accuracy per method over seeds
    python experiments/ddspo_compare.py pairs runs/ddspo_pairs/tiny_sd-random_removal-seed0   # verifier on x^w and x^l

``runs``: every ``<method>-s<seed>/results.json`` under the folder; prints base and fine-tuned held-out accuracy
(mean ± s.e. over seeds of the per-run accuracy) and the paired gain (mean ± s.e. over seeds).
``pairs``: decodes x^w and x^l with the tiny model's VAE and scores both against the *original* prompt c with the
shapes-world verifier (needs the prompts' GenEval metadata, as the shipped splits have).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def mean_se(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / len(values) ** 0.5:.3f}"


def runs_table(folder: Path) -> None:
    by_method = defaultdict(list)
    for results in sorted(folder.glob("*-s*/results.json")):
        method = results.parent.name.rsplit("-s", 1)[0]
        r = json.loads(results.read_text())
        variants = r["eval"]["variants"]
        gain = r["eval"]["finetuned_vs_base"]["geneval_shapes/accuracy_gain"]
        by_method[method].append({"base": variants["base"]["geneval_shapes/accuracy"],
                                  "finetuned": variants["finetuned"]["geneval_shapes/accuracy"],
                                  "gain": gain["gain"], "gain_se": gain["se"], "train_s": r["train_seconds"],
                                  "loss": r["history_tail"][-1]["loss"], "acc": r["history_tail"][-1]["implicit_acc"]})
    print("| method | seeds | held-out accuracy (base) | held-out accuracy (fine-tuned) | paired gain | per-seed gains "
          "(± paired s.e.) | final loss / implicit acc | training s |")
    print("|---|---|---|---|---|---|---|---|")
    for method, rows in by_method.items():
        per_seed = ", ".join(f"{x['gain']:+.3f} ± {x['gain_se']:.3f}" for x in rows)
        print(f"| {method} | {len(rows)} | {mean_se([x['base'] for x in rows])} | "
              f"{mean_se([x['finetuned'] for x in rows])} | {mean_se([x['gain'] for x in rows])} | {per_seed} | "
              f"{statistics.mean(x['loss'] for x in rows):.3f} / {statistics.mean(x['acc'] for x in rows):.2f} | "
              f"{statistics.mean(x['train_s'] for x in rows):.0f} |")


def pairs_table(folder: Path) -> None:
    import torch

    from diffalign.config.compose import asset_path
    from diffalign.data.ddspo_pairs import DDSPOPairs
    from diffalign.models.stable_diffusion import StableDiffusionPolicy
    from diffalign.rewards.geneval_shapes import GenevalShapes

    torch.set_num_threads(1)
    data = DDSPOPairs(str(folder))
    policy = StableDiffusionPolicy.from_pretrained(asset_path("tiny_sd"))
    verifier = GenevalShapes()
    correct = {"w": [], "l": []}
    tags = []
    for start in range(0, len(data), 128):
        batch = data.collate(list(range(start, min(start + 128, len(data)))))
        metadata = [{"prompt": p, **m} for p, m in zip(batch["prompts"], batch["metadata"])]
        tags += [m.get("tag", "") for m in batch["metadata"]]
        for side in ("w", "l"):
            with torch.no_grad():
                images = policy.decode(batch[f"latents_{side}"])
            out = verifier(images, batch["prompts"], metadata)
            correct[side] += out.info["correct"].float().tolist()
    n = len(correct["w"])
    print(f"{n} pairs: x^w meets c in {sum(correct['w']) / n:.3f}, x^l meets c in {sum(correct['l']) / n:.3f}; "
          f"x^w right and x^l wrong {sum(w > lo for w, lo in zip(correct['w'], correct['l'])) / n:.3f}, "
          f"the reverse {sum(w < lo for w, lo in zip(correct['w'], correct['l'])) / n:.3f}")
    for tag in sorted(set(tags)):
        idx = [i for i, t in enumerate(tags) if t == tag]
        print(f"  {tag}: n={len(idx)}  x^w {sum(correct['w'][i] for i in idx) / len(idx):.2f}  "
              f"x^l {sum(correct['l'][i] for i in idx) / len(idx):.2f}")


if __name__ == "__main__":
    {"runs": runs_table, "pairs": pairs_table}[sys.argv[1]](Path(sys.argv[2]))
