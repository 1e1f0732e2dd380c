"""Is the held-out verifier drop of every run a property of the base model's samples rather than of what a method
learns? (docs/results/verifier.md, "Verifier drift".)

Builds a policy as ``diffalign-train`` would (recipe + overrides), samples the held-out prompts at the benchmark's
evaluation settings (20 steps, CFG 4, the evaluation's per-image seeds) from the adapter-disabled base, then from the
policy with its LoRA ``B`` matrices set to random N(0, sigma^2) values — update directions that carry no reward
signal at all — and scores both with the verifier. For each sigma and each random direction it prints the image drift
(mean |fine-tuned − base| pixel difference), the accuracy change, and how many images the verifier flipped each way.
A symmetric verifier and a base at no special point would lose as many images as it gains.

    python experiments/verifier_fragility_probe.py recipe=tiny_dgpo --sigmas 0.002 0.005 --directions 4
"""

from __future__ import annotations

import argparse
import math

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sigmas", nargs="+", type=float, default=[0.002, 0.005])
    p.add_argument("--directions", type=int, default=4)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--prompts-per-tag", type=int, default=8, help="0 = every held-out prompt")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from hydra import compose, initialize_config_dir

    from diffalign.config.compose import CONFIG_DIR, setup_hydra
    from diffalign.evaluation.generation import EvalConfig, generate, select_prompts
    from diffalign.lora.initial import build_policy
    from diffalign.rewards.geneval_shapes import GenevalShapes
    from diffalign.world.prompts import load_prompts

    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/fragility", *args.overrides])
    policy = build_policy(cfg)
    rows = select_prompts(load_prompts("heldout"), args.prompts_per_tag or None)
    ecfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": 20, "guidance_scale": 4.0}, batch_size=64)
    verifier = GenevalShapes()

    def run(use_reference: bool):
        images, records = generate(policy, rows, args.seeds, ecfg, use_reference=use_reference)
        meta = {r["prompt"]: r for r in rows}
        res = verifier(images, [r["prompt"] for r in records], [meta[r["prompt"]] for r in records])
        return images, torch.as_tensor(res.info["correct"], dtype=torch.float32), res.scores.float()

    base_img, base_ok, base_dense = run(True)
    n = len(base_ok)
    print(f"base: {n} images, accuracy {base_ok.mean():.3f}, dense {base_dense.mean():.3f}; per seed "
          + ", ".join(f"{s}: {base_ok.view(len(args.seeds), -1)[i].mean():.3f}" for i, s in enumerate(args.seeds)))
    lora_b = [(name, prm) for name, prm in policy.denoiser.named_parameters() if prm.requires_grad and "lora_B" in name]
    print(f"{len(lora_b)} LoRA B matrices")
    print("sigma\tdirection\timage_drift\tacc_change\tse\tdense_change\tlost\tgained")
    totals = {}
    for sigma in args.sigmas:
        for d in range(args.directions):
            gen = torch.Generator().manual_seed(1000 + d)
            with torch.no_grad():
                for _, prm in lora_b:
                    prm.copy_(torch.randn(prm.shape, generator=gen) * sigma)
            img, ok, dense = run(False)
            diff = ok - base_ok
            drift = float((img - base_img).abs().mean())
            lost, gained = int((diff < 0).sum()), int((diff > 0).sum())
            se = float(diff.std() / math.sqrt(n))
            t = totals.setdefault(sigma, [0, 0, []])
            t[0] += lost
            t[1] += gained
            t[2].append(float(diff.mean()))
            print(f"{sigma}\t{d}\t{drift:.4f}\t{diff.mean():+.3f}\t{se:.3f}\t{(dense - base_dense).mean():+.3f}\t"
                  f"{lost}\t{gained}", flush=True)
    with torch.no_grad():
        for _, prm in lora_b:
            prm.zero_()
    for sigma, (lost, gained, changes) in totals.items():
        m = sum(changes) / len(changes)
        s = (sum((c - m) ** 2 for c in changes) / (len(changes) - 1)) ** 0.5 / math.sqrt(len(changes)) \
            if len(changes) > 1 else float("nan")
        print(f"sigma {sigma}: mean change {m:+.3f} ± {s:.3f} over {len(changes)} directions; lost {lost}, "
              f"gained {gained}")


if __name__ == "__main__":
    main()
