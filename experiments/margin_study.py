"""How close the tiny world's training renders sit to the verifier's thresholds, with the world's default scene margins
and with the wide margins of the stronger base's training data (docs/results/tiny_world.md, "A stronger base").

For each setting it prints the verifier's accuracy on ground-truth renders and the fraction of the correct ones that
a one-pixel edge change of one object flips (`diffalign.world.edges`), first on 297 renders of train prompts (every
other train prompt, seed 7 i), then on the shipped tiny VAE's reconstructions (posterior mean) of 351 held-out renders
(every held-out prompt three times, seed 11 i) — the ceiling a latent model trained on that data can reach.

    python experiments/margin_study.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


def main() -> None:
    from diffusers import AutoencoderKL

    from diffalign.config.compose import asset_path
    from diffalign.world.edges import edge_flips
    from diffalign.world.prompts import load_prompts
    from diffalign.world.render import DEFAULT_MARGINS, WIDE_MARGINS, render_spec, to_tensor
    from diffalign.world.verifier import verify

    settings = {"default": DEFAULT_MARGINS, "wide": WIDE_MARGINS,
                "wide, antialias 4": dataclasses.replace(WIDE_MARGINS, antialias=4),
                "default, antialias 4": dataclasses.replace(DEFAULT_MARGINS, antialias=4)}

    def line(name: str, images, rows) -> str:
        acc = np.mean([verify(im, r).correct for im, r in zip(images, rows)])
        e = edge_flips(images, rows)
        return (f"{name}: verifier accuracy {acc:.3f} ({len(rows)}); one-pixel edge flips {e.n_flipped}/{e.n_correct}"
                f" = {e.fraction:.3f} ± {e.se:.3f}; by change {e.by_change}")

    train = load_prompts("train")[::2]
    print("ground-truth renders of train prompts")
    for name, margins in settings.items():
        print("  " + line(name, [render_spec(r, 7 * i, margins=margins) for i, r in enumerate(train)], train))
    vae = AutoencoderKL.from_pretrained(asset_path("tiny_sd3/vae"), torch_dtype=torch.float32).eval()
    held = load_prompts("heldout") * 3
    print("the shipped tiny VAE's reconstructions of held-out renders")
    for name in ("default", "wide"):
        x = to_tensor(np.stack([render_spec(r, 11 * i, margins=settings[name]) for i, r in enumerate(held)]))
        with torch.no_grad():
            rec = ((vae.decode(vae.encode(x * 2 - 1).latent_dist.mean).sample + 1) / 2).clamp(0, 1)
        print("  " + line(name, (rec.permute(0, 2, 3, 1).numpy() * 255 + 0.5).astype(np.uint8), held))


if __name__ == "__main__":
    main()
