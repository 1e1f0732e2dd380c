"""Is SePPO's anchor-based flipper (AAF) a signal or a coin flip at the tiny recipe's budget?

The AAF decides per sample, from ONE draw of (t, ε) shared by θ and θ_r, whether the reference sample x^r is a loser
(s = +1: ℓ_θr(x^w) > ℓ_θ(x^w)) or a likely winner (s = −1) — docs/methods/algorithms.md#seppo. This probe takes a
finished SePPO run (its final LoRA θ and the reference pool's snapshots θ_r in
checkpoint-N/reference_state.safetensors) and, for winners x^w (ground-truth renders of train prompts), computes the
anchor gap g = ℓ_θr(x^w) − ℓ_θ(x^w) over many draws per image. It prints, per snapshot θ_r: the image-level mean gap
(the sign the AAF tries to read), the single-draw noise, and the fraction of single draws whose sign agrees with the
image's mean — 0.5 means the AAF's decision is a coin flip, 1.0 a clean signal.

    python experiments/seppo_aaf_probe.py runs/<seppo run>/checkpoint-100 [--images 64 --draws 64]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffalign.models.stable_diffusion import StableDiffusionPolicy
from diffalign.objectives.common import per_sample_mse
from diffalign.world.prompts import load_prompts
from diffalign.world.render import render_spec, to_tensor


def lora_params(policy) -> dict[str, torch.nn.Parameter]:
    return {n.replace(".default", ""): p for n, p in policy.unet.named_parameters() if "lora_" in n and ".default" in n}


@torch.no_grad()
def losses(policy, latents, embeds, timesteps, noise) -> torch.Tensor:
    noisy = policy.add_noise(latents, noise, timesteps)
    return per_sample_mse(policy.predict(noisy, timesteps, embeds), policy.training_target(latents, noise, timesteps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=8)
    args = p.parse_args()
    ckpt = Path(args.checkpoint)
    policy = StableDiffusionPolicy.from_pretrained(str(Path(__file__).resolve().parents[1] / "diffalign/assets/tiny_sd"),
                                                   lora_rank=args.lora_rank, lora_alpha=args.lora_rank)
    params = lora_params(policy)
    ref = load_file(ckpt / "reference_state.safetensors")
    meta = json.loads((ckpt / "reference_state.json").read_text())
    snaps = sorted({int(k.split(".")[2]) for k in ref if k.startswith("reference_state.snapshots.")})
    steps = meta.get("snapshot_steps", snaps)
    policy.load_lora_weights(ckpt)
    final = {k: v.detach().clone() for k, v in params.items()}
    rows = load_prompts("train")[:: max(1, len(load_prompts("train")) // args.images)][: args.images]
    images = torch.stack([to_tensor(render_spec(r, 1000 + i)) for i, r in enumerate(rows)])
    latents = policy.encode_images(images)
    embeds = policy.encode_prompts([r["prompt"] for r in rows], do_classifier_free_guidance=False)
    g = torch.Generator().manual_seed(0)
    n_t = policy.scheduler.config.num_train_timesteps
    draws = [(torch.randint(0, n_t, (len(rows),), generator=g), torch.randn(latents.shape, generator=g))
             for _ in range(args.draws)]
    own = torch.stack([losses(policy, latents, embeds, t, e) for t, e in draws], 1)  # (images, draws) under θ
    print(f"θ = {ckpt}; pool snapshots {snaps} (save_every {meta.get('save_every')}); "
          f"{len(rows)} winners × {args.draws} draws; ℓ_θ mean {own.mean():.4f}")
    print("| θ_r | mean gap ℓ_θr − ℓ_θ | single-draw s.d. | images with |mean| > 2 s.e. | single-draw sign = image's sign |")
    print("|---|---|---|---|---|")
    for s in snaps:
        prefix = f"reference_state.snapshots.{s}."
        state = {k[len(prefix):]: v for k, v in ref.items() if k.startswith(prefix)}
        with torch.no_grad():
            for k, prm in params.items():
                prm.copy_(state[k])
        other = torch.stack([losses(policy, latents, embeds, t, e) for t, e in draws], 1)
        with torch.no_grad():
            for k, prm in params.items():
                prm.copy_(final[k])
        gap = other - own  # (images, draws)
        mean, sd = gap.mean(1), gap.std(1)
        signif = (mean.abs() > 2 * sd / math.sqrt(args.draws)).float().mean()
        agree = (torch.sign(gap) == torch.sign(mean)[:, None]).float().mean()
        print(f"| snapshot of step {steps[s]} | {mean.mean():+.2e} (image s.d. {mean.std():.1e}) | {sd.mean():.1e} | "
              f"{signif:.2f} | {agree:.3f} |")


if __name__ == "__main__":
    main()
