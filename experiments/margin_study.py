"""How close the tiny world's images sit to the verifier's thresholds: the training renders (default and wide scene
margins), their VAE reconstructions, and, for any base model, its generated held-out images (docs/results/
tiny_world.md, "A first stronger base" and "Why the new base is still fragile").

Without a model override it compares the training data's margins: the verifier's accuracy on ground-truth renders
and the fraction of the correct ones that a one-pixel edge change of one object flips (`diffalign.world.edges`),
first on 297 renders of train prompts (every other train prompt, seed 7 i), then on the shipped tiny VAE's
reconstructions (posterior mean) of 351 held-out renders (every held-out prompt three times, seed 11 i):

    python experiments/margin_study.py

With a model (Hydra overrides of the train config, as scripts/fragility_gate.py takes them) it prints, per object as
the verifier segments it (`diffalign.world.thresholds.object_margins`), the distances to the verifier's thresholds —
half-size and pixel count, fill ratio, colour distance to the palette entry, gaps between objects of one colour,
relation margins — on the wide-margins training renders, on their VAE reconstructions, and on the base's generated
held-out images (the gate's setting: every held-out prompt, seed 0, ``sampler=ode``, 20 steps, CFG 4): all, the
correct ones, the correct ones a one-pixel edge change flips, and those a random LoRA direction at image drift 0.03
loses (the gate's directions 1000 + d, sigma calibrated by the gate's code on every image, or given with
``--sigmas``); then which threshold each flip and each loss crossed (`explain_change`):

    python experiments/margin_study.py model=tiny_sd3
    python experiments/margin_study.py --sigmas 0.0334,0.0334,0.0334,0.0334 model=tiny_sd3 \\
        model.pretrained_model_name_or_path=/work/pretrain/flow2/tiny_sd3_wide
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import numpy as np
import torch

FILL_NEAR = 0.05  # an object "near a fill threshold" has |fill_margin| below this


def vae_roundtrip(images: np.ndarray) -> np.ndarray:
    """The shipped tiny VAE's reconstructions (posterior mean) of uint8 `(N, H, W, 3)` images, uint8 as the verifier
    reads them."""
    from diffusers import AutoencoderKL

    from diffalign.config.compose import asset_path
    from diffalign.world.render import to_tensor

    vae = AutoencoderKL.from_pretrained(asset_path("tiny_sd3/vae"), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        rec = ((vae.decode(vae.encode(to_tensor(images) * 2 - 1).latent_dist.mean).sample + 1) / 2).clamp(0, 1)
    return (rec.permute(0, 2, 3, 1).numpy() * 255 + 0.5).astype(np.uint8)


def data_study() -> None:
    """The training data's margins (the first table of "A first stronger base")."""
    from diffalign.world.edges import edge_flips
    from diffalign.world.prompts import load_prompts
    from diffalign.world.render import DEFAULT_MARGINS, WIDE_MARGINS, render_spec
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
    held = load_prompts("heldout") * 3
    print("the shipped tiny VAE's reconstructions of held-out renders")
    for name in ("default", "wide"):
        rec = vae_roundtrip(np.stack([render_spec(r, 11 * i, margins=settings[name]) for i, r in enumerate(held)]))
        print("  " + line(name, rec, held))


def _q(values, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else float("nan")


def margins_row(name: str, images, specs) -> str:
    """One markdown row of the per-object table for a set of images (uint8 `(H, W, 3)` each) and their specs."""
    from diffalign.world.thresholds import object_margins, relation_margins, stray_pixels

    if not len(images):
        return f"| {name} | 0 |" + " – |" * 12
    objs = [o for im in images for o in object_margins(im)]
    rel = [m for im, sp in zip(images, specs) for m in relation_margins(im, sp)]
    stray = [stray_pixels(im) for im in images]
    by = {s: [o for o in objs if o.shape == s] for s in ("circle", "square", "triangle")}
    half = [o.half_size for o in objs]
    fill = {s: [o.fill for o in v] for s, v in by.items()}
    paired = [o for o in objs if np.isfinite(o.gap)]
    cells = [
        name, str(len(images)), str(len(objs)),
        f"{_q(half, .5):.1f} ({_q(half, .1):.1f})", f"{_q([o.area for o in objs], .1):.0f}",
        f"{_q(fill['circle'], .5):.2f} [{_q(fill['circle'], .1):.2f}, {_q(fill['circle'], .9):.2f}]",
        f"{_q(fill['triangle'], .5):.2f} ({_q(fill['triangle'], .9):.2f})",
        f"{_q(fill['square'], .5):.2f} ({_q(fill['square'], .1):.2f})",
        f"{np.mean([abs(o.fill_margin) < FILL_NEAR for o in objs]) if objs else float('nan'):.2f}",
        f"{_q([o.color_distance for o in objs], .5):.0f} ({_q([o.color_distance for o in objs], .9):.0f})",
        f"{_q([o.color_margin for o in objs], .1):.0f}",
        f"{np.mean([o.gap <= 1 for o in paired]) if paired else float('nan'):.2f} ({len(paired)})",
        f"{_q(rel, .5):.1f} ({_q(rel, .1):.1f}; {len(rel)})",
        f"{np.mean([s >= MIN_STRAY for s in stray]):.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


MIN_STRAY = 4  # a dropped fragment this large is two pixels from counting (MIN_AREA 6)
HEADER = ("| images | n | objects | half-size median (p10), px | area p10, px | circle fill median [p10, p90] | "
          "triangle fill median (p90) | square fill median (p10) | objects with fill within 0.05 of a threshold | "
          "colour distance to palette median (p90) | colour margin p10 | same-colour gap ≤ 1 px (objects with a "
          "same-colour neighbour) | relation margin median (p10; n), px | images with a dropped fragment ≥ 4 px |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def model_study(args) -> None:
    """The per-object table for the training renders, their reconstructions and one base's samples (module doc)."""
    from hydra import compose, initialize_config_dir

    from diffalign.config.compose import CONFIG_DIR, setup_hydra
    from diffalign.evaluation.fragility import _pixels, calibrate_sigma, lora_b_parameters, set_direction
    from diffalign.evaluation.generation import EvalConfig, sample_images
    from diffalign.lora.initial import build_policy
    from diffalign.world.prompts import load_prompts
    from diffalign.world.render import WIDE_MARGINS, render_spec
    from diffalign.world.thresholds import edge_flip_causes, explain_change
    from diffalign.world.verifier import verify

    train = load_prompts("train")[::2]
    renders = [render_spec(r, 7 * i, margins=WIDE_MARGINS) for i, r in enumerate(train)]
    rows = load_prompts("heldout")
    held = np.stack([render_spec(r, 11 * i, margins=WIDE_MARGINS) for i, r in enumerate(rows)])
    recon = vae_roundtrip(held)

    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["output_dir=/tmp/margin_study", *args.overrides])
    policy = build_policy(cfg)
    params = lora_b_parameters(policy)
    ecfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": args.steps, "guidance_scale": args.guidance_scale},
                      batch_size=64)
    jobs = [(p, 0) for p in range(len(rows))]  # the gate's seed 0

    def sample(reference: bool) -> torch.Tensor:
        return torch.cat([sample_images(policy, jobs[i:i + 64], rows, ecfg, reference) for i in range(0, len(jobs), 64)])

    set_direction(params, 0.0, 0)
    base = sample(True)
    base_px = _pixels(base)
    ok = np.array([verify(im, r).correct for im, r in zip(base_px, rows)])
    flips = {i: edge_flip_causes(base_px[i], rows[i]) for i in np.nonzero(ok)[0]}
    flipped = [i for i, c in flips.items() if c]
    lost: list[tuple[int, int, str]] = []  # (direction seed, image, cause)
    sigma = 0.03
    for d in range(args.directions):
        seed = 1000 + d
        made: dict[float, torch.Tensor] = {}  # the images of each scale tried

        def drift_at(s: float, seed: int = seed, made: dict = made) -> float:
            set_direction(params, s, seed)
            made[s] = sample(False)
            return float((made[s] - base).abs().mean())

        if args.sigmas:
            sigma = args.sigmas[d]
            drift_at(sigma)
        else:
            sigma = calibrate_sigma(drift_at, args.drift, sigma).sigma  # the gate's calibration, on every image
        px = _pixels(made[sigma])
        drift = float((made[sigma] - base).abs().mean())
        now = [verify(im, r).correct for im, r in zip(px, rows)]
        lost += [(seed, i, explain_change(base_px[i], px[i], rows[i])) for i in np.nonzero(ok)[0] if not now[i]]
        print(f"direction {seed}: sigma {sigma:.4g}, drift {drift:.4f}, lost "
              f"{sum(s == seed for s, _, _ in lost)}, gained {sum(now[i] and not ok[i] for i in range(len(rows)))}",
              flush=True)
    set_direction(params, 0.0, 0)

    name = " ".join(args.overrides)
    print(f"\n{name}: held-out accuracy {ok.mean():.3f} ({ok.sum()} of {len(rows)}); one-pixel edge flips "
          f"{len(flipped)} of {ok.sum()}; lost at drift {args.drift}: {len(lost)} (image, direction) pairs over "
          f"{args.directions} directions\n")
    print(HEADER)
    print(margins_row("training renders, wide margins", renders, train))
    print(margins_row("their VAE reconstructions (held-out prompts)", recon, rows))
    print(margins_row("base samples, all", base_px, rows))
    print(margins_row("base samples, correct", base_px[ok], [r for r, k in zip(rows, ok) if k]))
    print(margins_row("… flipped by a one-pixel edge change", base_px[flipped], [rows[i] for i in flipped]))
    lost_ids = sorted({i for _, i, _ in lost})
    print(margins_row(f"… lost at drift {args.drift} (base images)", base_px[lost_ids], [rows[i] for i in lost_ids]))
    edge_causes = Counter(c for i in flipped for c in {f"{ch}: {why}" for _, ch, why in flips[i]})
    print(f"\none-pixel edge flips ({len(flipped)} images), threshold crossed (change: cause; images): "
          + "; ".join(f"{k} {v}" for k, v in edge_causes.most_common()))
    print(f"lost at drift {args.drift} ({len(lost)} pairs), threshold crossed: "
          + "; ".join(f"{k} {v}" for k, v in Counter(c for _, _, c in lost).most_common()))
    tags = Counter(rows[i]["tag"] for _, i, _ in lost)
    print("lost pairs by tag: " + ", ".join(f"{k} {v}" for k, v in tags.most_common()) + "; correct by tag: "
          + ", ".join(f"{k} {v}" for k, v in Counter(r["tag"] for r, k in zip(rows, ok) if k).most_common()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--directions", type=int, default=4, help="random LoRA directions (seeds 1000 + d; 0: none)")
    p.add_argument("--drift", type=float, default=0.03, help="target image drift of the directions")
    p.add_argument("--sigmas", type=lambda text: [float(v) for v in text.split(",")],
                   help="the directions' scales, comma-separated (e.g. from a fragility gate's JSON), instead of "
                        "calibrating them")
    p.add_argument("--steps", type=int, default=20, help="sampler num_inference_steps")
    p.add_argument("--guidance-scale", type=float, default=4.0)
    p.add_argument("overrides", nargs="*", help="Hydra overrides selecting the base, e.g. model=tiny_sd3")
    args = p.parse_args()
    if args.sigmas and len(args.sigmas) != args.directions:
        p.error(f"--sigmas gives {len(args.sigmas)} scales for --directions {args.directions}; give one per direction")
    if args.overrides:
        model_study(args)
    else:
        data_study()


if __name__ == "__main__":
    main()
