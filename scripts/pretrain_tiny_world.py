"""Trains the tiny world's shipped models from scratch, with fixed seeds (maintenance tool; never imported).

Stages (run in this order; ``all`` runs them in sequence):

* ``vae``  — tiny `AutoencoderKL` (32×32×3 ↔ 8×8×4), L1 + MSE + 1e-6·KL; measures its `scaling_factor` and the
  verifier's accuracy on reconstructions.
* ``unet`` — tiny `UNet2DConditionModel` (ε-prediction, SD1.5 noise schedule) trained jointly with a tiny
  `CLIPTextModel` on pre-encoded latents, 10% caption dropout for classifier-free guidance, EMA 0.999; then assembles
  and saves a `StableDiffusionPipeline` folder.
* ``clip`` — tiny open_clip model (custom config, the world's word-level tokenizer), contrastive loss on renders and
  captions.
* ``flow`` — tiny SD3-format flow model (`SD3Transformer2DModel` + two tiny CLIP encoders), rectified flow.
* ``flux`` — tiny FLUX.1-format model (`FluxTransformer2DModel` on packed latents + tiny CLIP pooled and T5 encoders,
  no guidance embedding), rectified flow on tiny_sd3's VAE (run ``flow`` first, or have it in ``--out``). Resumable:
  a checkpoint every ``--checkpoint-minutes`` in ``<work>/flux_checkpoint.pt``; rerun the same command with
  ``--resume`` after an interruption and it continues bit for bit.
* ``flow2`` — the stronger SD3-format base (issue 34; not shipped yet, not part of ``all``): ``flow``'s recipe on
  training renders with wide margins (`diffalign.world.render.WIDE_MARGINS`), wider and deeper, longer, EMA;
  resumable as ``flux`` (``<work>/flow2_checkpoint.pt``, ``--resume``); the EMA model is saved every
  ``--flow2-eval-every`` steps as ``<work>/tiny_sd3_wide`` for the fragility gate (scripts/fragility_gate.py).
* ``flux2`` — the stronger FLUX.1-format base (issue 31; not shipped, not part of ``all``): ``flux``'s model family
  trained with ``flow2``'s recipe and loop (`train_strong_base`); ``<work>/flux2_checkpoint.pt``, ``--resume``; the
  EMA model is exported every ``--flux2-eval-every`` steps as ``<work>/tiny_flux_wide`` (``model=tiny_flux
  model.pretrained_model_name_or_path=<work>/tiny_flux_wide`` loads it).

Full reproduction of the shipped models (about 30 minutes on an idle 2-core CPU; measured: VAE 3000 steps,
UNet 2800 steps in 8.8 min, CLIP 1200 steps; see diffalign/assets/pretrain_metrics.json)::

    python scripts/pretrain_tiny_world.py all --out diffalign/assets

Smoke run (a few steps; used by the tests)::

    python scripts/pretrain_tiny_world.py all --out /tmp/tw --vae-steps 2 --unet-steps 2 --clip-steps 2 \
        --num-latents 64 --eval-images 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from diffalign.world.prompts import all_prompts, sample_train_specs
from diffalign.world.render import DEFAULT_MARGINS, WIDE_MARGINS, caption, corrupt_spec, render_spec, to_tensor
from diffalign.world.tokenizer import build_tokenizer
from diffalign.world.verifier import verify


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def render_batch(specs: list[dict], seed: int, margins=DEFAULT_MARGINS) -> torch.Tensor:
    return to_tensor(np.stack([render_spec(s, seed * 100003 + i, margins=margins) for i, s in enumerate(specs)]))


def lr_lambda(warmup: int, total: int, floor: float = 0.05):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


# ----------------------------------------------------------------------------------------------------------------------
# VAE
# ----------------------------------------------------------------------------------------------------------------------
def build_vae():
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, sample_size=32, norm_num_groups=8, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(16, 32, 64), mid_block_add_attention=False,
    )


def train_vae(args) -> None:
    torch.manual_seed(0)
    vae = build_vae()
    log(f"vae params {sum(p.numel() for p in vae.parameters()) / 1e6:.3f}M, {args.vae_steps} steps")
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(100, args.vae_steps))
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    for step in range(args.vae_steps):
        x = render_batch(sample_train_specs(32, seed=10_000 + step), seed=10_000 + step) * 2 - 1
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        # foreground pixels (the objects) weigh 4x more: their edges decide the verifier's shape reading
        weight = 1.0 + 3.0 * (x.amax(dim=1, keepdim=True) > -0.3).float()
        loss = (weight * ((rec - x).abs() + (rec - x) ** 2)).mean() + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            log(f"vae step {step} loss {loss.item():.4f} ({(step + 1) / (time.time() - t0):.2f} it/s)")
    vae.eval()
    with torch.no_grad():
        specs = sample_train_specs(512, seed=999)
        x = render_batch(specs, seed=999) * 2 - 1
        lat = torch.cat([vae.encode(x[i:i + 128]).latent_dist.mean for i in range(0, len(x), 128)])
        scaling = float(1.0 / lat.std())
    vae.register_to_config(scaling_factor=scaling)
    acc, psnr = eval_vae(vae, args.eval_images)
    log(f"vae scaling_factor {scaling:.4f}; reconstructions: verifier accuracy {acc:.4f}, PSNR {psnr:.2f} dB")
    out = Path(args.work) / "vae"
    vae.save_pretrained(out)
    (Path(args.work) / "vae_metrics.json").write_text(json.dumps(
        {"verifier_accuracy_on_reconstructions": acc, "psnr_db": psnr, "scaling_factor": scaling,
         "steps": args.vae_steps, "minutes": (time.time() - t0) / 60}, indent=2))


@torch.no_grad()
def eval_vae(vae, n: int) -> tuple[float, float]:
    rows = all_prompts()["heldout"] + all_prompts()["train"]
    rng = np.random.default_rng(123)
    specs = [rows[i] for i in rng.choice(len(rows), size=n)]
    x = render_batch(specs, seed=123)
    rec = torch.cat([vae.decode(vae.encode(x[i:i + 128] * 2 - 1).latent_dist.mean).sample for i in range(0, n, 128)])
    rec = ((rec + 1) / 2).clamp(0, 1)
    mse = F.mse_loss(rec, x).item()
    imgs = (rec.permute(0, 2, 3, 1).numpy() * 255 + 0.5).astype(np.uint8)
    acc = float(np.mean([verify(im, s).correct for im, s in zip(imgs, specs)]))
    return acc, 10 * math.log10(1.0 / mse)


# ----------------------------------------------------------------------------------------------------------------------
# UNet + text encoder
# ----------------------------------------------------------------------------------------------------------------------
def build_text_encoder(tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    ))


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(48, 96), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=8, norm_num_groups=16,
    )


def sd_scheduler_config() -> dict:
    return {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
                "prediction_type": "epsilon", "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1}


def train_unet(args) -> None:
    from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    vae = AutoencoderKL.from_pretrained(Path(args.work) / "vae").eval()
    tokenizer = build_tokenizer()
    text_encoder, unet = build_text_encoder(tokenizer), build_unet()
    log(f"unet params {sum(p.numel() for p in unet.parameters()) / 1e6:.3f}M, text encoder "
        f"{sum(p.numel() for p in text_encoder.parameters()) / 1e6:.3f}M")
    # 1. pre-encode latents (posterior mean and std) of renders of train prompts
    t0 = time.time()
    specs = sample_train_specs(args.num_latents, seed=1)
    means, stds = [], []
    with torch.no_grad():
        for i in range(0, len(specs), 256):
            x = render_batch(specs[i:i + 256], seed=1 + i) * 2 - 1
            d = vae.encode(x).latent_dist
            means.append(d.mean)
            stds.append(d.std)
    means, stds = torch.cat(means), torch.cat(stds)
    ids = tokenizer([s["prompt"] for s in specs], padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    empty = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    log(f"encoded {len(specs)} latents in {time.time() - t0:.0f}s")
    # 2. train
    noise_scheduler = DDPMScheduler(**{k: v for k, v in sd_scheduler_config().items() if k != "set_alpha_to_one"})
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(200, args.unet_steps, floor=0.1))
    ema_unet = EMAModel(unet.parameters(), decay=0.999)
    ema_text = EMAModel(text_encoder.parameters(), decay=0.999)
    gen = torch.Generator().manual_seed(0)
    t0, running = time.time(), None
    for step in range(args.unet_steps):
        idx = torch.randint(len(specs), (args.unet_batch,), generator=gen)
        lat = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) * vae.config.scaling_factor
        tok = ids[idx].clone()
        drop = torch.rand(len(idx), generator=gen) < 0.1
        tok[drop] = empty
        noise = torch.randn(lat.shape, generator=gen)
        t = torch.randint(0, 1000, (len(idx),), generator=gen)
        pred = unet(noise_scheduler.add_noise(lat, noise, t), t, text_encoder(tok)[0]).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema_unet.step(unet.parameters())
        ema_text.step(text_encoder.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.unet_steps - 1:
            log(f"unet step {step} loss {running:.4f} ({(step + 1) / (time.time() - t0):.2f} it/s)")
    minutes = (time.time() - t0) / 60
    ema_unet.copy_to(unet.parameters())
    ema_text.copy_to(text_encoder.parameters())
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet.eval(),
        scheduler=DDIMScheduler(**sd_scheduler_config()), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    out = Path(args.work) / "tiny_sd"
    pipe.save_pretrained(out, safe_serialization=True)
    (Path(args.work) / "unet_metrics.json").write_text(json.dumps(
        {"steps": args.unet_steps, "batch": args.unet_batch, "minutes": minutes, "final_loss": running}, indent=2))
    log(f"saved pipeline to {out}")


# ----------------------------------------------------------------------------------------------------------------------
# Flow-matching (SD3-format) model
# ----------------------------------------------------------------------------------------------------------------------
def encode_train_latents(vae, tokenizer, n: int, margins=DEFAULT_MARGINS):
    """Posterior means/stds of `n` renders of train prompts (scenes with `margins`), and their token ids (shared by
    the unet/flow stages). The renders go to the VAE's device; the latents come back on the CPU."""
    specs = sample_train_specs(n, seed=1)
    means, stds = [], []
    with torch.no_grad():
        for i in range(0, len(specs), 256):
            x = render_batch(specs[i:i + 256], seed=1 + i, margins=margins).to(vae.device)
            d = vae.encode(x * 2 - 1).latent_dist
            means.append(d.mean.cpu())
            stds.append(d.std.cpu())
    ids = tokenizer([s["prompt"] for s in specs], padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids
    return torch.cat(means), torch.cat(stds), ids


def edge_blocks(image: np.ndarray, factor: int = 4) -> np.ndarray:
    """Which `factor`×`factor` pixel blocks of a render (uint8 `(H, W, 3)` on black) hold an object edge pixel: bool
    `(H / factor, W / factor)`. An edge pixel is within one pixel of an object's boundary,
    ``dilation(mask) & ~erosion(mask)`` by the 3×3 cross, mask = any channel > 0."""
    from scipy import ndimage

    cross = ndimage.generate_binary_structure(2, 1)
    mask = image.max(-1) > 0
    edge = ndimage.binary_dilation(mask, cross) & ~ndimage.binary_erosion(mask, cross)
    h, w = edge.shape
    return edge.reshape(h // factor, factor, w // factor, factor).any(axis=(1, 3))


def latent_edge_blocks(n: int, margins=DEFAULT_MARGINS, factor: int = 4) -> torch.Tensor:
    """`edge_blocks` of `encode_train_latents`' `n` renders (the same specs and seeds): bool
    `(n, 1, H / factor, W / factor)`, True at the latent positions (the tiny VAE downsamples by 4) whose pixel block
    holds an object edge. The shape the verifier reads (fill ratio, corners) and the one-pixel changes that flip it
    (`diffalign.world.edges`) live there; ``--flow2-edge-weight`` weights the loss of those latents."""
    specs = sample_train_specs(n, seed=1)
    blocks = [edge_blocks(render_spec(spec, (1 + i) * 100003 + j, margins=margins), factor)  # render_batch's seeds
              for i in range(0, len(specs), 256) for j, spec in enumerate(specs[i:i + 256])]
    return torch.from_numpy(np.stack(blocks))[:, None]


def train_flow(args) -> None:
    """Rectified-flow training of the tiny SD3-format transformer and its two CLIP text encoders (SD3 recipe:
    logit-normal σ, velocity target ε − x0, 10% caption dropout, EMA 0.999), on the shipped tiny VAE."""
    from diffusers import AutoencoderKL
    from diffusers.training_utils import EMAModel, compute_density_for_timestep_sampling

    from diffalign.models.tiny_flow import TINY_MAX_SEQUENCE_LENGTH, build_tiny_flow_pipeline

    torch.manual_seed(0)
    vae_dir = Path(args.work) / "vae"
    vae = AutoencoderKL.from_pretrained(vae_dir if vae_dir.exists() else Path(args.out) / "tiny_sd" / "vae").eval()
    vae.register_to_config(shift_factor=0.0)
    pipe = build_tiny_flow_pipeline(seed=0, vae=vae, width=args.flow_width, num_layers=args.flow_layers)
    tokenizer, transformer = pipe.tokenizer, pipe.transformer.train()
    encoders = [pipe.text_encoder.train(), pipe.text_encoder_2.train()]
    log(f"flow transformer params {sum(p.numel() for p in transformer.parameters()) / 1e6:.3f}M")
    t0 = time.time()
    means, stds, ids = encode_train_latents(vae, tokenizer, args.num_latents)
    empty = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    log(f"encoded {len(means)} latents in {time.time() - t0:.0f}s")
    params = list(transformer.parameters()) + [p for e in encoders for p in e.parameters()]
    opt = torch.optim.AdamW(params, lr=args.flow_lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(200, args.flow_steps, floor=0.1))
    emas = [EMAModel(m.parameters(), decay=0.999) for m in [transformer, *encoders]]
    gen = torch.Generator().manual_seed(0)
    t0, running = time.time(), None
    for step in range(args.flow_steps):
        idx = torch.randint(len(means), (args.unet_batch,), generator=gen)
        lat = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) * vae.config.scaling_factor
        tok = ids[idx].clone()
        tok[torch.rand(len(idx), generator=gen) < 0.1] = empty
        noise = torch.randn(lat.shape, generator=gen)
        sigma = compute_density_for_timestep_sampling("logit_normal", len(idx), logit_mean=0.0, logit_std=1.0,
                                                      generator=gen).clamp(1e-3, 1.0)
        s = sigma.view(-1, 1, 1, 1)
        out = [e(tok, output_hidden_states=True) for e in encoders]
        clip = torch.cat([o.hidden_states[-2] for o in out], dim=-1)
        ctx = torch.cat([F.pad(clip, (0, 128 - clip.shape[-1])), torch.zeros(len(idx), TINY_MAX_SEQUENCE_LENGTH, 128)],
                        dim=1)
        pooled = torch.cat([o.text_embeds for o in out], dim=-1)
        pred = transformer((1 - s) * lat + s * noise, encoder_hidden_states=ctx, pooled_projections=pooled,
                           timestep=sigma * 1000).sample
        loss = F.mse_loss(pred, noise - lat)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for ema, m in zip(emas, [transformer, *encoders]):
            ema.step(m.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.flow_steps - 1:
            log(f"flow step {step} loss {running:.4f} ({(step + 1) / (time.time() - t0):.2f} it/s)")
    minutes = (time.time() - t0) / 60
    for ema, m in zip(emas, [transformer, *encoders]):
        ema.copy_to(m.parameters())
        m.eval()
    acc = eval_flow(pipe, args.flow_eval_prompts)
    log(f"flow held-out verifier accuracy {acc:.3f} (20 Euler steps, CFG 4.5, 1 seed per prompt)")
    out = Path(args.work) / "tiny_sd3"
    pipe.save_pretrained(out, safe_serialization=True)
    # the VAE is tiny_sd's; stored in float16 here (it loads as float32 with torch_dtype=float32) so that all shipped
    # models, the video model included, fit the 30 MB budget
    pipe.vae.to(torch.float16).save_pretrained(out / "vae", safe_serialization=True)
    pipe.vae.to(torch.float32)
    (Path(args.work) / "flow_metrics.json").write_text(json.dumps(
        {"steps": args.flow_steps, "batch": args.unet_batch, "minutes": minutes, "final_loss": running,
         "heldout_accuracy_20_steps_cfg4.5": acc}, indent=2))
    log(f"saved pipeline to {out}")


@torch.no_grad()
def eval_flow(pipe, n_prompts: int) -> float:
    """Held-out verifier accuracy of `StableDiffusion3Pipeline` samples (one image per prompt, seed = prompt index)."""
    from diffalign.models.tiny_flow import TINY_MAX_SEQUENCE_LENGTH

    rows = all_prompts()["heldout"][:n_prompts]
    correct = []
    for i in range(0, len(rows), 32):
        chunk = rows[i:i + 32]
        gens = [torch.Generator().manual_seed(i + j) for j in range(len(chunk))]
        images = pipe([r["prompt"] for r in chunk], num_inference_steps=20, guidance_scale=4.5, generator=gens,
                      max_sequence_length=TINY_MAX_SEQUENCE_LENGTH, output_type="np").images
        imgs = (images * 255 + 0.5).astype(np.uint8)
        correct += [verify(im, r).correct for im, r in zip(imgs, chunk)]
    return float(np.mean(correct))


# ----------------------------------------------------------------------------------------------------------------------
# FLUX-format model (resumable)
# ----------------------------------------------------------------------------------------------------------------------
FLUX_MODULES = ("transformer", "text_encoder", "text_encoder_2")


def shipped_flow_vae(args):
    """The tiny world's VAE as tiny_sd3 ships it (float16 file, loaded as float32, ``shift_factor`` 0): the FLUX stage
    trains and evaluates on exactly the VAE its shipped config loads (``model.vae``, no copy in tiny_flux)."""
    from diffusers import AutoencoderKL

    for folder in (Path(args.work) / "tiny_sd3" / "vae", Path(args.out) / "tiny_sd3" / "vae"):
        if folder.exists():
            return AutoencoderKL.from_pretrained(folder, torch_dtype=torch.float32).eval()
    raise FileNotFoundError(f"no tiny_sd3/vae in --work {args.work} or --out {args.out}: run the flow stage first")


def resolve_device(spec: str) -> torch.device:
    """The `torch.device` of a ``--device`` value ("cpu", "cuda", "cuda:N"), checked before any work.

    Raises:
        SystemExit: one line naming ``--device`` if the value is no device, not CPU or CUDA, or names a CUDA
            device this machine does not have.
    """
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise SystemExit(f"--device {spec!r} is no torch device; pass cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"--device {spec!r}: these scripts train on cpu or cuda[:N]; pass one of those")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {spec!r}: torch sees no CUDA device here; pass --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"--device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here; pass "
                             f"cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return device


def save_atomic(obj, path: Path) -> None:
    """`torch.save` to a temporary file in the same folder, then `os.replace`: a reader (or a resume after a kill)
    sees the old checkpoint or the new one, never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_stage_checkpoint(ckpt_path: Path, sizes: dict, options: str, *, modules, emas, optimizer, scheduler,
                          generator) -> tuple[int, object, float, list]:
    """Restores a resumable stage (flux, flow2) from `ckpt_path` in place: weights, EMAs, optimizer, LR schedule, the
    data generator and torch's global (CPU) RNG. Returns (step, running loss, elapsed seconds, evaluations so far).

    The file is read onto the CPU (``map_location="cpu"``) and each state goes to its module's device, so a checkpoint written on a GPU resumes on the CPU and the other way round. Such a
    cross-device resume continues the same batches but is not bit for bit (other kernels round differently; on CUDA
    dropout draws from the CUDA generator, which the checkpoint does not hold); a resume on the device that wrote
    the checkpoint is bit for bit on the CPU.

    Raises:
        SystemExit: if the checkpoint was written with other `sizes` (naming the stage's `options` to repeat)."""
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    if ckpt["sizes"] != sizes:
        raise SystemExit(f"--resume: {ckpt_path} was written with {ckpt['sizes']}, this run has {sizes}; pass "
                         f"the same {options} / --unet-batch / --num-latents options, or drop --resume")
    for m, state in zip(modules, ckpt["modules"]):
        m.load_state_dict(state)
    for ema, state, m in zip(emas, ckpt["emas"], modules):  # one EMA per module, in the modules' order
        ema.load_state_dict(state)
        ema.to(device=next(m.parameters()).device)
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    generator.set_state(ckpt["generator"])
    torch.set_rng_state(ckpt["torch_rng"])
    log(f"resumed from {ckpt_path} at step {ckpt['step']}")
    return ckpt["step"], ckpt["running"], ckpt["elapsed"], ckpt["evals"]


def save_stage_checkpoint(ckpt_path: Path, step: int, sizes: dict, *, running, elapsed: float, evals: list, modules,
                          emas, optimizer, scheduler, generator) -> None:
    """Writes what `load_stage_checkpoint` restores, atomically (`save_atomic`)."""
    save_atomic({"step": step, "sizes": sizes, "modules": [m.state_dict() for m in modules],
                 "emas": [e.state_dict() for e in emas], "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "generator": generator.get_state(),
                 "torch_rng": torch.get_rng_state(), "running": running, "elapsed": elapsed, "evals": evals}, ckpt_path)
    log(f"checkpoint at step {step} -> {ckpt_path}")


def train_flux(args) -> None:
    """Rectified-flow training of a tiny FLUX.1-format pipeline from scratch: `FluxTransformer2DModel` on packed 2×2
    latents, with its CLIP (pooled) and T5 (token states) encoders from `diffalign.models.tiny_flux`, trained jointly;
    the SD3 recipe of `train_flow` (logit-normal σ, velocity target ε − x0, 10 % caption dropout, EMA 0.999) on the
    shipped tiny VAE.

    No guidance embedding (``guidance_embeds=False``): FLUX.1-dev's embedded guidance is distilled from a CFG teacher;
    a model trained from scratch has no teacher, and feeding it random guidance values would teach it nothing about
    them, so it is trained as a plain conditional/unconditional model and sampled with true CFG
    (``FluxPipeline(true_cfg_scale=w, negative_prompt="")``), the FLUX.1-schnell / de-distilled layout.

    Resumable bit for bit: every ``--checkpoint-minutes`` (and at ``--flux-stop-at``) the model, EMA, optimizer, LR
    schedule, both RNG states (the batch generator and torch's global one, used by T5's dropout) and the step are
    written atomically to ``<work>/flux_checkpoint.pt``; ``--resume`` continues from it with the same batches.
    """
    from diffusers import FluxPipeline
    from diffusers.training_utils import EMAModel, compute_density_for_timestep_sampling

    from diffalign.models.tiny_flux import (
        TINY_FLUX_MAX_SEQUENCE_LENGTH,
        build_tiny_flux_pipeline,
        build_tiny_flux_transformer,
    )

    torch.manual_seed(0)
    work = Path(args.work)
    vae = shipped_flow_vae(args)
    transformer = build_tiny_flux_transformer(guidance_embeds=False, num_layers=args.flux_layers,
                                              num_single_layers=args.flux_single_layers,
                                              num_attention_heads=args.flux_heads,
                                              latent_channels=vae.config.latent_channels)
    pipe = build_tiny_flux_pipeline(seed=0, guidance_embeds=False, vae=vae, transformer=transformer)
    modules = [getattr(pipe, n).train() for n in FLUX_MODULES]
    log("flux params " + ", ".join(f"{n} {sum(p.numel() for p in m.parameters()) / 1e6:.3f}M"
                                   for n, m in zip(FLUX_MODULES, modules)))
    # 1. latents (cached: a resume must not depend on re-encoding, and skips it)
    cache = work / "flux_latents.pt"
    if cache.exists() and torch.load(cache)["n"] == args.num_latents:
        data = torch.load(cache)
    else:
        t0 = time.time()
        means, stds, _ = encode_train_latents(vae, pipe.tokenizer, args.num_latents)
        prompts = [s["prompt"] for s in sample_train_specs(args.num_latents, seed=1)]
        data = {"n": args.num_latents, "means": means, "stds": stds, "prompts": prompts}
        save_atomic(data, cache)
        log(f"encoded {len(means)} latents in {time.time() - t0:.0f}s")
    means, stds, prompts = data["means"], data["stds"], data["prompts"]
    shift, scale = vae.config.shift_factor or 0.0, vae.config.scaling_factor
    # 2. optimisation state, fresh or resumed
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.flux_lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(200, args.flux_steps, floor=0.1))
    emas = [EMAModel(m.parameters(), decay=0.999) for m in modules]
    gen = torch.Generator().manual_seed(0)
    sizes = {"steps": args.flux_steps, "batch": args.unet_batch, "lr": args.flux_lr, "layers": args.flux_layers,
             "single_layers": args.flux_single_layers, "heads": args.flux_heads, "num_latents": args.num_latents}
    ckpt_path = work / "flux_checkpoint.pt"
    resumable = {"modules": modules, "emas": emas, "optimizer": opt, "scheduler": sched, "generator": gen}
    start, running, elapsed, evals = 0, None, 0.0, []
    if args.resume and ckpt_path.exists():
        start, running, elapsed, evals = load_stage_checkpoint(ckpt_path, sizes, "--flux-*", **resumable)

    def checkpoint(step: int) -> None:
        save_stage_checkpoint(ckpt_path, step, sizes, running=running, elapsed=elapsed + time.time() - t0,
                              evals=evals, **resumable)

    def evaluate_ema(step: int) -> None:
        for ema, m in zip(emas, modules):
            ema.store(m.parameters())
            ema.copy_to(m.parameters())
            m.eval()
        with torch.random.fork_rng(devices=[]):
            acc = eval_flux(pipe, args.flux_eval_prompts)
        for ema, m in zip(emas, modules):
            ema.restore(m.parameters())
            m.train()
        evals.append({"step": step, "heldout_accuracy": acc})
        log(f"flux step {step} EMA held-out verifier accuracy {acc:.3f}")

    # 3. train
    img_ids = None
    t0, last_ckpt = time.time(), time.time()
    for step in range(start, args.flux_steps):
        idx = torch.randint(len(means), (args.unet_batch,), generator=gen)
        lat = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen) - shift) * scale
        drop = (torch.rand(len(idx), generator=gen) < 0.1).tolist()
        noise = torch.randn(lat.shape, generator=gen)
        sigma = compute_density_for_timestep_sampling("logit_normal", len(idx), logit_mean=0.0, logit_std=1.0,
                                                      generator=gen).clamp(1e-3, 1.0)
        s = sigma.view(-1, 1, 1, 1)
        text = ["" if d else prompts[i] for i, d in zip(idx.tolist(), drop)]
        states, pooled, text_ids = pipe.encode_prompt(prompt=text, prompt_2=None,
                                                      max_sequence_length=TINY_FLUX_MAX_SEQUENCE_LENGTH)
        b, c, h, w = lat.shape
        if img_ids is None:
            img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, lat.device, lat.dtype)
        pred = transformer(hidden_states=FluxPipeline._pack_latents((1 - s) * lat + s * noise, b, c, h, w),
                           timestep=sigma, pooled_projections=pooled, encoder_hidden_states=states,
                           txt_ids=text_ids, img_ids=img_ids, return_dict=False)[0]
        loss = F.mse_loss(pred, FluxPipeline._pack_latents(noise - lat, b, c, h, w))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for ema, m in zip(emas, modules):
            ema.step(m.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        done = step + 1
        if step % 100 == 0 or done == args.flux_steps:
            log(f"flux step {step} loss {running:.4f} ({(done - start) / (time.time() - t0):.2f} it/s)")
        if args.flux_eval_every and done % args.flux_eval_every == 0 and done < args.flux_steps:
            evaluate_ema(done)
        if done == args.flux_stop_at:
            checkpoint(done)
            log(f"stopped at step {done} (--flux-stop-at); continue with --resume")
            return False
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes and done < args.flux_steps:
            checkpoint(done)
            last_ckpt = time.time()
    minutes = (elapsed + time.time() - t0) / 60
    # 4. EMA weights, rounded to float16 as shipped, evaluated, saved (without the VAE: it is tiny_sd3's)
    for ema, m in zip(emas, modules):
        ema.copy_to(m.parameters())
        m.to(torch.float16).to(torch.float32).eval()
    acc = eval_flux(pipe, args.flux_eval_prompts)
    evals.append({"step": args.flux_steps, "heldout_accuracy": acc})
    log(f"flux held-out verifier accuracy {acc:.3f} (20 Euler steps, true CFG 4.5, 1 seed per prompt)")
    out = work / "tiny_flux"
    shutil.rmtree(out, ignore_errors=True)
    pipe.save_pretrained(out, safe_serialization=True)
    shutil.rmtree(out / "vae")
    for name in FLUX_MODULES:  # float16 files (they load as float32 with torch_dtype=float32): the 30 MB budget
        getattr(pipe, name).to(torch.float16).save_pretrained(out / name, safe_serialization=True)
        getattr(pipe, name).to(torch.float32)
    (work / "flux_metrics.json").write_text(json.dumps(
        {"steps": args.flux_steps, "batch": args.unet_batch, "minutes": minutes, "final_loss": running,
         "heldout_accuracy_20_steps_true_cfg4.5": acc, "heldout_accuracy_by_step": evals}, indent=2))
    log(f"saved pipeline to {out} (load it with vae=AutoencoderKL.from_pretrained(<tiny_sd3>/vae))")
    return True


@torch.no_grad()
def eval_flux(pipe, n_prompts: int) -> float:
    """Held-out verifier accuracy of `FluxPipeline` samples with true CFG 4.5 (negative prompt ""), 20 steps, one
    image per prompt, seed = prompt index (as `eval_flow`)."""
    from diffalign.models.tiny_flux import TINY_FLUX_MAX_SEQUENCE_LENGTH

    rows = all_prompts()["heldout"][:n_prompts]
    correct = []
    for i in range(0, len(rows), 32):
        chunk = rows[i:i + 32]
        gens = [torch.Generator().manual_seed(i + j) for j in range(len(chunk))]
        images = pipe([r["prompt"] for r in chunk], negative_prompt=[""] * len(chunk), true_cfg_scale=4.5,
                      num_inference_steps=20, height=32, width=32, generator=gens,
                      max_sequence_length=TINY_FLUX_MAX_SEQUENCE_LENGTH, output_type="np").images
        imgs = (images * 255 + 0.5).astype(np.uint8)
        correct += [verify(im, r).correct for im, r in zip(imgs, chunk)]
    return float(np.mean(correct))


# ----------------------------------------------------------------------------------------------------------------------
# The stronger bases (issue 34 item 2: SD3 format; issue 31: FLUX.1 format), one resumable training loop
# ----------------------------------------------------------------------------------------------------------------------
FLOW2_MODULES = ("transformer", "text_encoder", "text_encoder_2")


class StrongBase(NamedTuple):
    """The model-specific parts of a stronger-base stage (flow2, flux2) that `train_strong_base` trains.

    Attributes:
        name: the stage ("flow2", "flux2"): log prefix, the ``--<name>-*`` options read (steps, lr, ema, eval_every,
            eval_prompts, stop_at, edge_weight) and the files ``<work>/<name>_latents.pt``,
            ``<name>_checkpoint.pt``, ``<name>_metrics.json``.
        pipe: the pipeline being trained (its `module_names` components are trained jointly).
        module_names: the trained components, in checkpoint order.
        sizes: what a checkpoint must match to be resumed (the stage's ``--<name>-*`` sizes, batch, latents).
        encode: `(n)` → the latents cache: ``{"means", "stds"}`` (posterior of `n` wide-margin renders, `(n, 4, 8,
            8)`) and what `condition` reads.
        condition: `(data, idx, drop)` → the conditioning of batch rows `idx` (`(B,)` long) with the captions of rows
            `drop` (`(B,)` bool) replaced by "".
        forward: `(noisy, sigma, cond)` → the predicted velocity ε − x0 in the latents' layout `(B, 4, 8, 8)`, from
            noisy latents `(B, 4, 8, 8)` and σ ∈ (0, 1] `(B,)`.
        evaluate: `(pipe, n_prompts)` → held-out verifier accuracy in [0, 1].
        export: `(folder)` → writes the pipeline (float16 files, as shipped) to `folder`.
        export_name: the folder's name under ``<work>``.
        metric: the metrics file's key for the final accuracy.
    """

    name: str
    pipe: object
    module_names: tuple
    sizes: dict
    encode: Callable[[int], dict]
    condition: Callable[[dict, torch.Tensor, torch.Tensor], tuple]
    forward: Callable[[torch.Tensor, torch.Tensor, tuple], torch.Tensor]
    evaluate: Callable[[object, int], float]
    export: Callable[[Path], None]
    export_name: str
    metric: str


def flow2_text_context(encoders, tok: torch.Tensor):
    """SD3's conditioning from the two tiny CLIP encoders, as `StableDiffusion3Pipeline.encode_prompt` builds it with
    no T5: the penultimate hidden states concatenated and zero-padded to the joint dim 128, then
    ``TINY_MAX_SEQUENCE_LENGTH`` zero tokens in T5's place; pooled = both projections concatenated."""
    from diffalign.models.tiny_flow import TINY_MAX_SEQUENCE_LENGTH

    out = [e(tok.to(e.device), output_hidden_states=True) for e in encoders]
    clip = torch.cat([o.hidden_states[-2] for o in out], dim=-1)
    pad = torch.zeros(len(tok), TINY_MAX_SEQUENCE_LENGTH, 128, device=clip.device)
    ctx = torch.cat([F.pad(clip, (0, 128 - clip.shape[-1])), pad], dim=1)
    return ctx, torch.cat([o.text_embeds for o in out], dim=-1)


def train_flow2(args) -> bool:
    """The stronger tiny SD3-format base: `train_flow`'s recipe (rectified flow, logit-normal σ, velocity target
    ε − x0, 10 % caption dropout, AdamW, warmup + cosine LR) on training renders with wide margins
    (`diffalign.world.render.WIDE_MARGINS`: no object at half-size 3, gaps ≥ 3 px, relations at ≥ 8 px; hard edges —
    antialiased renders were measured worse: verifier accuracy 0.96–0.97 on ground truth, 14 % of those flipped by a
    one-pixel edge change, against 1.00 and 0 % with hard edges), a wider and
    deeper transformer (``--flow2-width``, ``--flow2-layers``), longer, with an EMA (``--flow2-ema``) whose weights are
    evaluated and saved, on the shipped tiny VAE (tiny_sd3's, float16 → float32, as `shipped_flow_vae`).

    Trained by `train_strong_base` (resumable bit for bit; ``<work>/flow2_checkpoint.pt``). Every
    ``--flow2-eval-every`` steps the EMA weights are evaluated (held-out accuracy, `eval_flow`) and saved as a
    pipeline folder ``<work>/tiny_sd3_wide`` (the fragility gate runs on it:
    ``python scripts/fragility_gate.py model=tiny_sd3 model.pretrained_model_name_or_path=<work>/tiny_sd3_wide``).
    The finished model stays in ``<work>``: it replaces the shipped tiny_sd3 only after it passes the gate and the
    recipes are re-measured.
    """
    from diffalign.models.tiny_flow import build_tiny_flow_pipeline

    torch.manual_seed(0)
    vae = shipped_flow_vae(args)
    pipe = build_tiny_flow_pipeline(seed=0, vae=vae, width=args.flow2_width, num_layers=args.flow2_layers)
    transformer, encoders = pipe.transformer, [pipe.text_encoder, pipe.text_encoder_2]
    empty = pipe.tokenizer([""], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                           return_tensors="pt").input_ids

    def encode(n: int) -> dict:
        means, stds, ids = encode_train_latents(vae, pipe.tokenizer, n, margins=WIDE_MARGINS)
        return {"n": n, "means": means, "stds": stds, "ids": ids}

    def condition(data: dict, idx: torch.Tensor, drop: torch.Tensor):
        tok = data["ids"][idx].clone()
        tok[drop] = empty
        return flow2_text_context(encoders, tok)

    def forward(noisy: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        ctx, pooled = cond
        return transformer(noisy, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=sigma * 1000).sample

    def export(out: Path) -> None:
        pipe.save_pretrained(out, safe_serialization=True)
        for name in ("vae", *FLOW2_MODULES):  # float16 files, as tiny_sd3 ships
            getattr(pipe, name).to(torch.float16).save_pretrained(out / name, safe_serialization=True)
            getattr(pipe, name).to(torch.float32)

    sizes = {"steps": args.flow2_steps, "batch": args.unet_batch, "lr": args.flow2_lr, "width": args.flow2_width,
             "layers": args.flow2_layers, "ema": args.flow2_ema, "num_latents": args.num_latents}
    return train_strong_base(args, StrongBase(
        name="flow2", pipe=pipe, module_names=FLOW2_MODULES, sizes=sizes, encode=encode, condition=condition,
        forward=forward, evaluate=eval_flow, export=export, export_name="tiny_sd3_wide",
        metric="heldout_accuracy_20_steps_cfg4.5"))


def train_flux2(args) -> bool:
    """The stronger tiny FLUX.1-format base (issue 31): `train_flux`'s model family — `FluxTransformer2DModel` on packed
    2×2 latents, no guidance embedding (true CFG), tiny CLIP pooled + T5 encoders from `diffalign.models.tiny_flux`,
    trained jointly on tiny_sd3's shipped VAE — with `train_flow2`'s recipe: wide-margin renders, wider and deeper
    (``--flux2-heads`` heads of 16, ``--flux2-layers`` double- and ``--flux2-single-layers`` single-stream blocks),
    longer, EMA (``--flux2-ema``), ``--flux2-edge-weight``; trained by `train_strong_base` (resumable bit for bit,
    ``<work>/flux2_checkpoint.pt``; T5's dropout draws from torch's global RNG, which the checkpoint holds).

    Every ``--flux2-eval-every`` steps the EMA weights are evaluated (held-out accuracy, `eval_flux`: true CFG 4.5)
    and saved as ``<work>/tiny_flux_wide`` in the shipped tiny_flux layout (float16 files, no ``vae/``: it is
    tiny_sd3's), so ``model=tiny_flux model.pretrained_model_name_or_path=<work>/tiny_flux_wide`` loads it with the
    config's ``model.vae``. Nothing is shipped.
    """
    from diffusers import FluxPipeline

    from diffalign.models.tiny_flux import (
        TINY_FLUX_MAX_SEQUENCE_LENGTH,
        build_tiny_flux_pipeline,
        build_tiny_flux_transformer,
    )

    torch.manual_seed(0)
    vae = shipped_flow_vae(args)
    transformer = build_tiny_flux_transformer(guidance_embeds=False, num_layers=args.flux2_layers,
                                              num_single_layers=args.flux2_single_layers,
                                              num_attention_heads=args.flux2_heads,
                                              latent_channels=vae.config.latent_channels)
    pipe = build_tiny_flux_pipeline(seed=0, guidance_embeds=False, vae=vae, transformer=transformer)
    img_ids = {}

    def encode(n: int) -> dict:
        means, stds, _ = encode_train_latents(vae, pipe.tokenizer, n, margins=WIDE_MARGINS)
        return {"n": n, "means": means, "stds": stds, "prompts": [s["prompt"] for s in sample_train_specs(n, seed=1)]}

    def condition(data: dict, idx: torch.Tensor, drop: torch.Tensor):
        text = ["" if d else data["prompts"][i] for i, d in zip(idx.tolist(), drop.tolist())]
        return pipe.encode_prompt(prompt=text, prompt_2=None, max_sequence_length=TINY_FLUX_MAX_SEQUENCE_LENGTH)

    def forward(noisy: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        states, pooled, text_ids = cond
        b, c, h, w = noisy.shape
        if (h, w) not in img_ids:
            img_ids[h, w] = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
        packed = transformer(hidden_states=FluxPipeline._pack_latents(noisy, b, c, h, w), timestep=sigma,
                             pooled_projections=pooled, encoder_hidden_states=states, txt_ids=text_ids,
                             img_ids=img_ids[h, w], return_dict=False)[0]
        f = pipe.vae_scale_factor
        return FluxPipeline._unpack_latents(packed, h * f, w * f, f)

    def export(out: Path) -> None:
        pipe.save_pretrained(out, safe_serialization=True)
        shutil.rmtree(out / "vae")  # tiny_flux has no VAE of its own: model.vae is tiny_sd3's
        for name in FLUX_MODULES:  # float16 files, as tiny_flux ships
            getattr(pipe, name).to(torch.float16).save_pretrained(out / name, safe_serialization=True)
            getattr(pipe, name).to(torch.float32)

    sizes = {"steps": args.flux2_steps, "batch": args.unet_batch, "lr": args.flux2_lr, "heads": args.flux2_heads,
             "layers": args.flux2_layers, "single_layers": args.flux2_single_layers, "ema": args.flux2_ema,
             "num_latents": args.num_latents}
    return train_strong_base(args, StrongBase(
        name="flux2", pipe=pipe, module_names=FLUX_MODULES, sizes=sizes, encode=encode, condition=condition,
        forward=forward, evaluate=eval_flux, export=export, export_name="tiny_flux_wide",
        metric="heldout_accuracy_20_steps_true_cfg4.5"))


def train_strong_base(args, stage: StrongBase) -> bool:
    """The training loop of the stronger bases (flow2, flux2): rectified flow on cached latents of wide-margin renders
    (logit-normal σ clamped to [1e-3, 1], x_σ = (1 − σ)·x0 + σ·ε, velocity target ε − x0, 10 % caption dropout),
    AdamW (weight decay 1e-2), 200 warmup steps + cosine LR to 0.1×, gradient norm clipped at 1, one EMA per module;
    ``--<name>-edge-weight`` W ≠ 1 weights the squared error of the latents whose 4×4 pixel block holds an object edge
    by W (`latent_edge_blocks`), normalised by the batch's mean weight. Returns False if stopped at
    ``--<name>-stop-at``, True when finished (metrics in ``<work>/<name>_metrics.json``).

    Resumable bit for bit: every ``--checkpoint-minutes`` (and at ``--<name>-stop-at``) the modules, EMAs, optimizer,
    LR schedule, the batch generator's and torch's RNG states, the step and the evaluations go atomically to
    ``<work>/<name>_checkpoint.pt``; ``--resume`` continues from it with the same batches. Every
    ``--<name>-eval-every`` steps the EMA weights, rounded to float16 as shipped, are evaluated and exported to
    ``<work>/<export_name>``.

    ``--device`` (default cpu) holds the pipeline, the training and the evaluation; the latents cache and every
    random draw of the batches stay on the CPU (drawn there by the seeded generator, then moved), so ``--device cpu``
    is today's run bit for bit and a GPU run draws the same batches. Checkpoints resume across devices
    (`load_stage_checkpoint`), not bit for bit.

    Raises:
        SystemExit: on ``--resume`` with other sizes than the checkpoint's (`load_stage_checkpoint`).
    """
    from diffusers.training_utils import EMAModel, compute_density_for_timestep_sampling

    def opt_(key: str):
        return getattr(args, f"{stage.name}_{key}")

    work, name = Path(args.work), stage.name
    device = torch.device(getattr(args, "device", "cpu"))
    stage.pipe.to(device)
    modules = [getattr(stage.pipe, n).train() for n in stage.module_names]
    log(f"{name} params " + ", ".join(f"{n} {sum(p.numel() for p in m.parameters()) / 1e6:.3f}M"
                                      for n, m in zip(stage.module_names, modules)))
    # 1. latents of wide-margin renders (cached: a resume must not depend on re-encoding, and skips it)
    cache = work / f"{name}_latents.pt"
    if cache.exists() and torch.load(cache)["n"] == args.num_latents:
        data = torch.load(cache)
    else:
        t0 = time.time()
        data = stage.encode(args.num_latents)
        save_atomic(data, cache)
        log(f"encoded {len(data['means'])} wide-margin latents in {time.time() - t0:.0f}s")
    means, stds = data["means"], data["stds"]
    shift, scale = stage.pipe.vae.config.shift_factor or 0.0, stage.pipe.vae.config.scaling_factor
    # 2. optimisation state, fresh or resumed
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=opt_("lr"), weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(200, opt_("steps"), floor=0.1))
    emas = [EMAModel(m.parameters(), decay=opt_("ema")) for m in modules]
    gen = torch.Generator().manual_seed(0)
    sizes, edge_weights = dict(stage.sizes), None
    if opt_("edge_weight") != 1.0:  # only then a size of the run: checkpoints of unweighted runs still resume
        sizes["edge_weight"] = opt_("edge_weight")
        edges = latent_edge_blocks(args.num_latents, WIDE_MARGINS)
        edge_weights = 1.0 + (opt_("edge_weight") - 1.0) * edges.float()
        log(f"edge weight {opt_('edge_weight')}: {edges.float().mean():.3f} of the latent positions cover an "
            f"object edge")
    ckpt_path = work / f"{name}_checkpoint.pt"
    resumable = {"modules": modules, "emas": emas, "optimizer": opt, "scheduler": sched, "generator": gen}
    start, running, elapsed, evals = 0, None, 0.0, []
    if args.resume and ckpt_path.exists():
        start, running, elapsed, evals = load_stage_checkpoint(ckpt_path, sizes, f"--{name}-*", **resumable)

    def checkpoint(step: int) -> None:
        save_stage_checkpoint(ckpt_path, step, sizes, running=running, elapsed=elapsed + time.time() - t0,
                              evals=evals, **resumable)

    def save_ema(step: int, final: bool = False) -> None:
        """EMA weights, rounded to float16 as shipped, evaluated and exported to <work>/<export_name>."""
        for ema, m in zip(emas, modules):
            ema.store(m.parameters())
            ema.copy_to(m.parameters())
            m.to(torch.float16).to(torch.float32).eval()
        with torch.random.fork_rng(devices=[]):
            acc = stage.evaluate(stage.pipe, opt_("eval_prompts"))
        out = work / stage.export_name
        shutil.rmtree(out, ignore_errors=True)
        stage.export(out)
        if not final:
            for ema, m in zip(emas, modules):
                ema.restore(m.parameters())
                m.train()
        evals.append({"step": step, "heldout_accuracy": acc})
        log(f"{name} step {step} EMA held-out verifier accuracy {acc:.3f}; saved {out}")

    # 3. train
    steps = opt_("steps")
    t0, last_ckpt = time.time(), time.time()
    for step in range(start, steps):
        idx = torch.randint(len(means), (args.unet_batch,), generator=gen)
        lat = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen) - shift) * scale
        drop = torch.rand(len(idx), generator=gen) < 0.1
        noise = torch.randn(lat.shape, generator=gen)
        sigma = compute_density_for_timestep_sampling("logit_normal", len(idx), logit_mean=0.0, logit_std=1.0,
                                                      generator=gen).clamp(1e-3, 1.0)
        lat, noise, sigma = lat.to(device), noise.to(device), sigma.to(device)  # drawn on the CPU, as on any device
        s = sigma.view(-1, 1, 1, 1)
        pred = stage.forward((1 - s) * lat + s * noise, sigma, stage.condition(data, idx, drop))
        if edge_weights is None:
            loss = F.mse_loss(pred, noise - lat)
        else:  # weighted mean over the batch's latents, normalised by the mean weight (the loss keeps its scale)
            w = edge_weights[idx].to(device)
            loss = ((pred - (noise - lat)) ** 2 * w).mean() / w.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for ema, m in zip(emas, modules):
            ema.step(m.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        done = step + 1
        if step % 100 == 0 or done == steps:
            log(f"{name} step {step} loss {running:.4f} ({(done - start) / (time.time() - t0):.2f} it/s)")
        if opt_("eval_every") and done % opt_("eval_every") == 0 and done < steps:
            save_ema(done)
        if done == opt_("stop_at"):
            checkpoint(done)
            log(f"stopped at step {done} (--{name}-stop-at); continue with --resume")
            return False
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes and done < steps:
            checkpoint(done)
            last_ckpt = time.time()
    checkpoint(steps)
    save_ema(steps, final=True)
    (work / f"{name}_metrics.json").write_text(json.dumps(
        {"steps": steps, "batch": args.unet_batch, "sizes": sizes, "device": str(device),
         "minutes": (elapsed + time.time() - t0) / 60, "final_loss": running,
         stage.metric: evals[-1]["heldout_accuracy"], "heldout_accuracy_by_step": evals},
        indent=2))
    return True


# ----------------------------------------------------------------------------------------------------------------------
# CLIP
# ----------------------------------------------------------------------------------------------------------------------
def train_clip(args) -> None:
    """Contrastive training with hard negatives.

    Loss: the symmetric InfoNCE of CLIP over the batch's true captions plus, per image, ``--clip-hard`` corrupted
    captions (swapped relation, count off by one, other shape/colour) as extra negatives on the image→text side; plus
    ``--clip-pair-weight`` × a pairwise term −log σ(s·(cos(x, c) − cos(x, c̃))) per hard negative, which is the signal
    a bag-of-words solution cannot satisfy (the corrupted caption shares all but one word with the true one).
    """
    from diffalign.rewards.tiny_clip import build_tiny_clip, tokenize

    torch.manual_seed(0)
    model = build_tiny_clip()
    log(f"clip params {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M, {args.clip_steps} steps, "
        f"{args.clip_hard} hard negatives per image, pair weight {args.clip_pair_weight}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.clip_lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(100, args.clip_steps))
    tokenizer = build_tokenizer()
    t0 = time.time()
    k = max(1, args.clip_hard)
    for step in range(args.clip_steps):
        specs = sample_train_specs(128, seed=50_000 + step)
        x = render_batch(specs, seed=50_000 + step)
        n = len(specs)
        prompts = [s["prompt"] for s in specs]
        # hard negatives: each image's caption corrupted k times, hard[j * n + i] belongs to image i
        hard = [caption(corrupt_spec(s, 50_000 * step + 1_000 * j + i)[0]) for j in range(k) for i, s in enumerate(specs)]
        text = tokenize(tokenizer, prompts + hard)
        img_f, txt_f, scale = model(model_normalize(x), text)
        logits = scale * img_f @ txt_f.T  # (B, B + kB): true captions, then hard negatives
        # the same caption may appear twice in a batch: every matching caption is a positive
        same = torch.tensor([[a["prompt"] == b for b in prompts + hard] for a in specs], dtype=torch.float32)
        target = same / same.sum(1, keepdim=True)
        loss = 0.5 * (torch.sum(-target * logits.log_softmax(1), 1).mean()
                      + torch.sum(-target[:, :n].T * logits[:, :n].T.log_softmax(1), 1).mean())
        if args.clip_pair_weight > 0:
            pos = logits[torch.arange(n), torch.arange(n)]  # (B,)
            neg = torch.stack([logits[torch.arange(n), n + j * n + torch.arange(n)] for j in range(k)], 1)  # (B, k)
            loss = loss + args.clip_pair_weight * F.softplus(neg - pos[:, None]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.clip_steps - 1:
            log(f"clip step {step} loss {loss.item():.4f} ({(step + 1) / (time.time() - t0):.2f} it/s)")
        if args.clip_eval_every and step and step % args.clip_eval_every == 0:
            model.eval()
            log(f"clip step {step} held-out {json.dumps(eval_clip(model, tokenizer, 500, by_kind=True))}")
            model.train()
    model.eval()
    out = Path(args.work) / "tiny_clip"
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "open_clip_model.safetensors")
    by_kind = eval_clip(model, tokenizer, args.eval_images, by_kind=True)
    random_acc = eval_clip(model, tokenizer, args.eval_images, random_negative=True)
    (Path(args.work) / "clip_metrics.json").write_text(json.dumps(
        {"heldout_pair_accuracy": by_kind["all"], "heldout_pair_accuracy_by_corruption": by_kind,
         "heldout_random_caption_accuracy": random_acc, "steps": args.clip_steps, "hard_negatives": k,
         "pair_weight": args.clip_pair_weight, "lr": args.clip_lr, "minutes": (time.time() - t0) / 60}, indent=2))
    log(f"clip held-out matched-vs-corrupted caption accuracy {json.dumps(by_kind)}; vs a random other caption "
        f"{random_acc:.4f}")


def model_normalize(x: torch.Tensor) -> torch.Tensor:
    from diffalign.rewards.tiny_clip import normalize

    return normalize(x)


@torch.no_grad()
def eval_clip(model, tokenizer, n: int, by_kind: bool = False, random_negative: bool = False):
    """Held-out accuracy: how often the image's true caption scores above a corrupted one (one random corruption per
    image, `corrupt_spec`), or with `random_negative` above the caption of another held-out image that differs from
    it. With `by_kind` a dict ``{"all": acc, kind: acc, ...}`` per corruption kind."""
    from diffalign.rewards.tiny_clip import tokenize
    held = all_prompts()["heldout"]
    rng = np.random.default_rng(7)
    specs = [held[i] for i in rng.choice(len(held), size=n)]
    x = render_batch(specs, seed=7)
    if random_negative:
        others = []
        for i, s in enumerate(specs):
            j = int(rng.integers(len(held)))
            while held[j]["prompt"] == s["prompt"]:
                j = int(rng.integers(len(held)))
            others.append(held[j]["prompt"])
        wrong_text, kinds = others, ["random"] * n
    else:
        wrong = [corrupt_spec(s, i) for i, s in enumerate(specs)]
        wrong_text, kinds = [caption(w) for w, _ in wrong], [kd for _, kd in wrong]
    img_f = model.encode_image(model_normalize(x), normalize=True)
    right_f = model.encode_text(tokenize(tokenizer, [s["prompt"] for s in specs]), normalize=True)
    wrong_f = model.encode_text(tokenize(tokenizer, wrong_text), normalize=True)
    ok = ((img_f * right_f).sum(-1) > (img_f * wrong_f).sum(-1)).float().numpy()
    if not by_kind:
        return float(ok.mean())
    out = {"all": round(float(ok.mean()), 4)}
    for kd in sorted(set(kinds)):
        out[kd] = round(float(np.mean([o for o, k2 in zip(ok, kinds) if k2 == kd])), 4)
    return out


# ----------------------------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["vae", "unet", "clip", "flow", "flux", "flow2", "flux2", "all"],
                   help="flow2 and flux2 (the stronger SD3- and FLUX-format bases, not yet shipped) are not part "
                        "of all")
    p.add_argument("--out", default="diffalign/assets", help="where the finished models are copied")
    p.add_argument("--work", default="runs/pretrain", help="scratch folder for stage outputs")
    p.add_argument("--vae-steps", type=int, default=3000)
    p.add_argument("--unet-steps", type=int, default=2800)
    p.add_argument("--unet-batch", type=int, default=64)
    p.add_argument("--num-latents", type=int, default=60_000)
    p.add_argument("--clip-steps", type=int, default=1200)
    p.add_argument("--clip-lr", type=float, default=1e-3)
    p.add_argument("--clip-hard", type=int, default=1, help="corrupted captions per image")
    p.add_argument("--clip-pair-weight", type=float, default=0.0, help="weight of the pairwise hard-negative term")
    p.add_argument("--clip-eval-every", type=int, default=0)
    p.add_argument("--flow-steps", type=int, default=3000)
    p.add_argument("--flow-lr", type=float, default=1e-3)
    p.add_argument("--flow-width", type=int, default=96)
    p.add_argument("--flow-layers", type=int, default=4)
    p.add_argument("--flow-eval-prompts", type=int, default=117)
    p.add_argument("--flux-steps", type=int, default=3000)
    p.add_argument("--flux-lr", type=float, default=1e-3)
    p.add_argument("--flux-heads", type=int, default=4, help="attention heads of 16 (width 16 x heads)")
    p.add_argument("--flux-layers", type=int, default=1, help="double-stream blocks")
    p.add_argument("--flux-single-layers", type=int, default=2, help="single-stream blocks")
    p.add_argument("--flux-eval-prompts", type=int, default=117)
    p.add_argument("--flux-eval-every", type=int, default=500, help="steps between EMA held-out evaluations")
    p.add_argument("--flux-stop-at", type=int, default=0, help="checkpoint and stop after this step (0: never)")
    p.add_argument("--flow2-steps", type=int, default=20_000)
    p.add_argument("--flow2-lr", type=float, default=5e-4)
    p.add_argument("--flow2-width", type=int, default=128, help="transformer width (heads of 32)")
    p.add_argument("--flow2-layers", type=int, default=6)
    p.add_argument("--flow2-ema", type=float, default=0.999, help="EMA decay")
    p.add_argument("--flow2-eval-prompts", type=int, default=117)
    p.add_argument("--flow2-eval-every", type=int, default=1000, help="steps between EMA evaluations and saves")
    p.add_argument("--flow2-stop-at", type=int, default=0, help="checkpoint and stop after this step (0: never)")
    p.add_argument("--flow2-edge-weight", type=float, default=1.0,
                   help="loss weight of the latents whose 4x4 pixel block holds an object edge (1: unweighted; "
                        "docs/results/tiny_world.md, 'Why the new base is still fragile')")
    p.add_argument("--flux2-steps", type=int, default=20_000)
    p.add_argument("--flux2-lr", type=float, default=5e-4)
    p.add_argument("--flux2-heads", type=int, default=8, help="attention heads of 16 (width 16 x heads)")
    p.add_argument("--flux2-layers", type=int, default=4, help="double-stream blocks")
    p.add_argument("--flux2-single-layers", type=int, default=8, help="single-stream blocks")
    p.add_argument("--flux2-ema", type=float, default=0.999, help="EMA decay")
    p.add_argument("--flux2-eval-prompts", type=int, default=117)
    p.add_argument("--flux2-eval-every", type=int, default=1000, help="steps between EMA evaluations and saves")
    p.add_argument("--flux2-stop-at", type=int, default=0, help="checkpoint and stop after this step (0: never)")
    p.add_argument("--flux2-edge-weight", type=float, default=1.0,
                   help="as --flow2-edge-weight, for flux2")
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    p.add_argument("--resume", action="store_true", help="continue from <work>/<stage>_checkpoint.pt (flux, "
                   "flow2, flux2)")
    p.add_argument("--eval-images", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="flow2, flux2: where the models train and are evaluated (cpu, "
                   "cuda, cuda:N); batches are still drawn on the CPU")
    p.add_argument("--tf32", action="store_true", help="with a CUDA --device: allow TF32 matmuls and convolutions")
    args = p.parse_args()
    if args.device != "cpu" and args.stage not in ("flow2", "flux2"):
        p.error(f"--device {args.device}: only the flow2 and flux2 stages take --device; drop it for {args.stage}")
    if resolve_device(args.device).type == "cuda" and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    for stage in ("flow2", "flux2"):
        if not getattr(args, f"{stage}_edge_weight") > 0:
            p.error(f"--{stage}-edge-weight must be > 0 (1: unweighted), got {getattr(args, f'{stage}_edge_weight')}")
    torch.set_num_threads(args.threads)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    stages = ["vae", "unet", "clip", "flow", "flux"] if args.stage == "all" else [args.stage]
    for stage in stages:
        finished = {"vae": train_vae, "unet": train_unet, "clip": train_clip, "flow": train_flow,
                    "flux": train_flux, "flow2": train_flow2, "flux2": train_flux2}[stage](args)
        if finished is False or stage in ("flow2", "flux2"):
            return  # stopped early (--*-stop-at), or flow2/flux2 (kept in --work): nothing to copy
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, stage in (("tiny_sd", "unet"), ("tiny_clip", "clip"), ("tiny_sd3", "flow"), ("tiny_flux", "flux")):
        if (Path(args.work) / name).exists() and stage in stages:
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.copytree(Path(args.work) / name, out / name)
            log(f"copied {name} to {out / name}")
    # stages run in another --work folder keep their figures: this run's stages update the file, others stay
    previous = out / "pretrain_metrics.json"
    metrics = json.loads(previous.read_text()) if previous.exists() else {}
    metrics.update({f.stem: json.loads(f.read_text()) for f in Path(args.work).glob("*_metrics.json")})
    (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
