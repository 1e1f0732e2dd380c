"""Pretrains the tiny world's text-to-video model (UNet3D, `TextToVideoSDPipeline` format) and ships it.

Data: videos of the video world (`diffalign.world.video`, 8 frames of 32×32, objects moving left/right/up/down or
staying still) for random train captions (`video_train`) and seeds, encoded frame by frame with the shipped tiny
image VAE (`diffalign/assets/tiny_sd/vae`, frozen; posterior mean and std stored, a latent drawn each step). Model: a
`UNet3DConditionModel` (block channels (24, 48), cross-attention and temporal attention at 4×4, ε-prediction, SD1.5
schedule) and a tiny CLIP text encoder over the video tokenizer (`build_tokenizer(video=True)`), trained jointly with
10 % caption dropout (classifier-free guidance), AdamW lr 1e-3 with warm-up and cosine decay, grad clip 1, EMA 0.999;
fixed seed 0. The EMA weights are saved as a `TextToVideoSDPipeline` in float16 (loads as float32 with
``torch_dtype=torch.float32``) and evaluated with the motion verifier (`reward=[video_motion]`) on the held-out
video prompts (28 prompts × 4 seeds, DDIM 20 steps, CFG 4).

The shipped model (`model=tiny_t2v`) is the image model inflated (``--inflate``)::

    OMP_NUM_THREADS=2 python scripts/pretrain_tiny_video.py --inflate --threads 2 --steps 3000 --num-videos 16000 \
        --lr 1e-3 --spatial-lr 1e-4 --out diffalign/assets/tiny_t2v

Diagnostics (docs/results/video.md, "why the tiny video model has not learned the direction of motion"): ``--eval-every
N`` evaluates the EMA weights every N steps on the held-out prompts (strict accuracy, dense score, and the fraction of
moving objects whose net displacement points the named way) and runs `direction_probe` (how much the denoising loss
depends on the caption's direction word and on the frame order); ``--text-lr``, ``--reinit-words`` and
``--high-t-fraction`` are the knobs the pilots recorded there varied, with ``--loss-weighting v``
(`loss_weights`: the high-noise steps weighted as the v-prediction loss weights them), ``--freeze-except``,
``--reinit-scale``, ``--t-min`` and ``--probe-every`` (the direction probe every N steps); `text_direction_gap` measures how far apart the
text encoder puts a caption and its direction-swapped copy; ``--arch motion`` swaps the UNet3D for an
AnimateDiff-style `UNetMotionModel` (temporal attentions with sinusoidal frame positions) built from the image UNet. Everything is written to
``pretrain_metrics.json`` next to the model.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from diffalign.world.prompts import load_prompts
from diffalign.world.tokenizer import build_tokenizer
from diffalign.world.video import direction_sign, render_video, videos_to_tensor

ASSETS = Path(__file__).resolve().parent.parent / "diffalign" / "assets"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def encode_videos(vae, rows, n: int, seed: int, frames: int):
    rng = np.random.default_rng(seed)
    pick = rng.integers(len(rows), size=n)
    means, stds, prompts = [], [], []
    with torch.no_grad():
        for s in range(0, n, 64):
            idx = pick[s:s + 64]
            vids = videos_to_tensor(np.stack([render_video(rows[i], seed=int(seed * 1_000_003 + s + k), num_frames=frames)
                                              for k, i in enumerate(idx)]))  # (b, F, 3, 32, 32)
            b = len(vids)
            d = vae.encode(vids.reshape(b * frames, 3, 32, 32) * 2 - 1).latent_dist
            means.append(d.mean.reshape(b, frames, 4, 8, 8).permute(0, 2, 1, 3, 4))
            stds.append(d.std.reshape(b, frames, 4, 8, 8).permute(0, 2, 1, 3, 4))
            prompts += [rows[i]["prompt"] for i in idx]
    return torch.cat(means), torch.cat(stds), prompts


def evaluate(policy, rows, seeds, steps: int = 20, cfg: float = 4.0) -> dict:
    from diffalign.rewards.video import VideoMotion
    from diffalign.samplers.ode import PipelineODESampler
    from diffalign.samplers.rollout import rollout

    reward, correct, tags, dense, sign = VideoMotion(), [], [], [], []
    for seed in seeds:
        for s in range(0, len(rows), 32):
            chunk = rows[s:s + 32]
            gens = [torch.Generator().manual_seed(10_000 * seed + s + k) for k in range(len(chunk))]
            with torch.no_grad():
                sampler = PipelineODESampler(num_inference_steps=steps, guidance_scale=cfg)
                traj = rollout(policy, [r["prompt"] for r in chunk], sampler, generator=gens)
            out = reward(traj.images, [r["prompt"] for r in chunk], chunk)
            correct += out.info["correct"].tolist()
            dense += out.scores.tolist()
            tags += [r["tag"] for r in chunk]
            sign += [direction_sign(tracks, r) for tracks, r in zip(out.info["tracks"], chunk)]
    acc = float(np.mean(correct))
    per_tag = {t: float(np.mean([c for c, g in zip(correct, tags) if g == t])) for t in sorted(set(tags))}
    sign = [x for v in sign for x in v]
    return {"accuracy": acc, "se": float(np.std(correct) / math.sqrt(len(correct))), "n": len(correct),
            "per_tag": per_tag, "dense": float(np.mean(dense)),
            "direction_sign": float(np.mean(sign)) if sign else float("nan")}


SWAP_DIRECTION = {"left": "right", "right": "left", "up": "down", "down": "up"}


def direction_probe(unet, text_encoder, lat, ids, ids_swapped, noise_scheduler, timesteps=(300, 600, 900)) -> dict:
    """How much the denoising loss of moving-object videos depends on the direction word and on frame order: the mean
    ε-MSE with the true caption, with left↔right and up↓down swapped in the caption, and with the frames reversed
    (input and target), at each timestep (fixed noise). A model that uses the direction word has swapped > true."""
    g = torch.Generator().manual_seed(123)
    res = {}
    with torch.no_grad():
        cond, swapped = text_encoder(ids)[0], text_encoder(ids_swapped)[0]
        for t in timesteps:
            noise = torch.randn(lat.shape, generator=g)
            tt = torch.full((len(lat),), t)
            x = noise_scheduler.add_noise(lat, noise, tt)
            true = F.mse_loss(unet(x, tt, cond).sample, noise).item()
            swap = F.mse_loss(unet(x, tt, swapped).sample, noise).item()
            rev = F.mse_loss(unet(x.flip(2), tt, cond).sample, noise.flip(2)).item()
            res[t] = {"true": true, "swapped_caption_gap": swap / true - 1, "reversed_frames_gap": rev / true - 1}
    return res


def loss_weights(alphas_cumprod: torch.Tensor, kind: str = "eps", max_weight: float = 0.0) -> torch.Tensor:
    """Per-timestep weights `(T,)` of the ε-MSE. ``"eps"``: all 1. ``"v"``: (1 + SNR_t) / SNR_t = 1 / ᾱ_t, the factor
    that turns an ε-model's ε-MSE into its v-prediction MSE (v = √ᾱ ε − √(1 − ᾱ) x0, Salimans & Ho 2022,
    arXiv:2202.00512), clamped at `max_weight` (0 = no clamp) and divided by its mean over t."""
    if kind == "eps":
        return torch.ones(len(alphas_cumprod))
    snr = alphas_cumprod / (1 - alphas_cumprod)
    weight = (1 + snr) / snr
    if max_weight:
        weight = weight.clamp(max=max_weight)
    return weight / weight.mean()


def text_direction_gap(text_encoder, ids, ids_swapped) -> float:
    """How far apart the text encoder puts a caption and its direction-swapped copy (left↔right, up↔down): the mean
    over captions and token positions of the L2 distance between the two output token states (the UNet sees the
    direction word only through this difference; docs/results/video.md records it next to the swap gap)."""
    with torch.no_grad():
        return (text_encoder(ids)[0] - text_encoder(ids_swapped)[0]).norm(dim=-1).mean().item()


def inflate_image_model(image_dir: Path, tokenizer):
    """(UNet3D, text encoder, names of the UNet3D tensors taken from the image UNet) built from the image pipeline in
    `image_dir`: same spatial layout (block channels, attention, norm groups), every image weight copied (the 1×1
    convolution projections of the spatial transformers become the UNet3D's linear ones), and the output projections
    of every temporal attention (``transformer_in``, ``temp_attentions``) zeroed — the temporal convolutions' last
    layer is zero-initialised by diffusers — so the video model starts as the image model applied to each frame. The
    text encoder is `extend_text_encoder`'s."""
    from diffusers import UNet2DConditionModel, UNet3DConditionModel

    u2 = UNet2DConditionModel.from_pretrained(image_dir / "unet")
    c = u2.config
    attention_channels = {c.block_out_channels[-1]}  # (cross-attention only in the last down block, mid, first up)
    if len(attention_channels) != 1 or c.block_out_channels[-1] % c.attention_head_dim:
        raise ValueError("--inflate expects attention at one width divisible by the head count")
    # diffusers reads UNet2DConditionModel's `attention_head_dim` as the number of heads, while the UNet3D's blocks
    # pass it to Transformer2DModel as the head *width*: give the UNet3D width // heads to keep the image heads
    unet = UNet3DConditionModel(
        sample_size=c.sample_size, in_channels=c.in_channels, out_channels=c.out_channels,
        block_out_channels=tuple(c.block_out_channels), down_block_types=("DownBlock3D", "CrossAttnDownBlock3D"),
        up_block_types=("CrossAttnUpBlock3D", "UpBlock3D"), layers_per_block=c.layers_per_block,
        cross_attention_dim=c.cross_attention_dim,
        attention_head_dim=c.block_out_channels[-1] // c.attention_head_dim, norm_num_groups=c.norm_num_groups)
    if tuple(c.down_block_types) != ("DownBlock2D", "CrossAttnDownBlock2D"):
        raise ValueError(f"--inflate expects the tiny image UNet's layout, got {c.down_block_types}")
    target = unet.state_dict()
    source = {k: v.reshape(target[k].shape) if k in target and v.numel() == target[k].numel() else v
              for k, v in u2.state_dict().items()}
    bad = [k for k in source if k not in target or source[k].shape != target[k].shape]
    if bad:
        raise ValueError(f"image UNet tensors without a place in the UNet3D: {bad[:5]}")
    unet.load_state_dict(source, strict=False)
    with torch.no_grad():
        for name, module in unet.named_modules():
            if (name.startswith("transformer_in.") or ".temp_attentions." in name) and name.endswith("proj_out"):
                module.weight.zero_()
                module.bias.zero_()
    return unet, extend_text_encoder(image_dir, tokenizer), set(source)


def extend_text_encoder(image_dir: Path, tokenizer):
    """The image pipeline's CLIP text encoder with the video vocabulary of `tokenizer` (image token ids unchanged, new
    words initialised from [UNK]) and its 16 positions (positions 12–15 copied from position 11)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    te2 = CLIPTextModel.from_pretrained(image_dir / "text_encoder")
    tc = te2.config
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=tc.projection_dim,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    sd = te2.state_dict()
    new = text_encoder.state_dict()
    for k, v in sd.items():
        if k.endswith("token_embedding.weight"):
            rows = new[k].clone()
            rows[:len(v)] = v
            rows[len(v):] = v[3]  # [UNK]
            sd[k] = rows
        elif k.endswith("position_embedding.weight"):
            rows = new[k].clone()
            rows[:len(v)] = v
            rows[len(v):] = v[-1]
            sd[k] = rows
    sd = {k: v for k, v in sd.items() if k in new}
    text_encoder.load_state_dict(sd, strict=False)
    return text_encoder


def inflate_motion_model(image_dir: Path, tokenizer, num_frames: int = 8, motion_heads: int = 4, seed: int = 0):
    """(UNetMotionModel, text encoder, names of the tensors taken from the image UNet): the AnimateDiff layout
    (Guo et al., arXiv:2307.04725, §4.2; docs/methods/vipo.md "Video") built from the image pipeline in `image_dir`
    with diffusers' `UNetMotionModel.from_unet2d` and a fresh `MotionAdapter` (seeded with `seed`): after every ResNet
    + spatial-attention pair, and in the mid block, a temporal transformer whose self-attention runs over the frames of
    each latent position with sinusoidal frame positions (`motion_max_seq_length = num_frames`, `motion_heads` heads,
    the image UNet's norm groups). Every image weight is copied unchanged and the output projection of every motion
    module is zeroed (AnimateDiff's zero-initialised motion modules), so at step 0 the model is the image model applied
    to each frame. The text encoder is `extend_text_encoder`'s.

    Raises:
        ValueError: if a block width of the image UNet is not divisible by `motion_heads`.
    """
    from diffusers import MotionAdapter, UNet2DConditionModel, UNetMotionModel

    u2 = UNet2DConditionModel.from_pretrained(image_dir / "unet")
    widths = tuple(u2.config.block_out_channels)
    if any(w % motion_heads for w in widths):
        raise ValueError(f"--motion-heads {motion_heads} must divide every block width {widths}")
    torch.manual_seed(seed)
    adapter = MotionAdapter(block_out_channels=widths, motion_layers_per_block=u2.config.layers_per_block,
                            motion_num_attention_heads=motion_heads, motion_norm_num_groups=u2.config.norm_num_groups,
                            motion_max_seq_length=num_frames, use_motion_mid_block=True)
    unet = UNetMotionModel.from_unet2d(u2, adapter)
    with torch.no_grad():
        for name, module in unet.named_modules():
            if ".motion_modules." in name and name.endswith("proj_out"):
                module.weight.zero_()
                module.bias.zero_()
    image_names = {n for n in unet.state_dict() if ".motion_modules." not in n}
    return unet, extend_text_encoder(image_dir, tokenizer), image_names


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--num-videos", type=int, default=8000)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--channels", type=int, nargs=2, default=[24, 48])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=str(ASSETS / "tiny_t2v"))
    p.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--eval-prompts", type=int, default=None, help="first N held-out prompts (default: all 28)")
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--init", default=None, help="continue from a folder this script wrote (its UNet and text encoder)")
    p.add_argument("--inflate", action="store_true",
                   help="start from the shipped image model (diffalign/assets/tiny_sd): its UNet inflated to a UNet3D "
                        "with the temporal layers' outputs zeroed (each frame = the image model at step 0) and its "
                        "text encoder extended to the video vocabulary")
    p.add_argument("--arch", choices=["unet3d", "motion"], default="unet3d",
                   help="with --inflate: unet3d = diffusers' UNet3DConditionModel (temporal convolutions + temporal "
                        "attentions without frame positions; the shipped model); motion = an AnimateDiff-style "
                        "UNetMotionModel (temporal attentions with sinusoidal frame positions, no temporal "
                        "convolutions), see inflate_motion_model")
    p.add_argument("--motion-heads", type=int, default=4, help="heads of the motion modules' attentions (--arch motion)")
    p.add_argument("--spatial-lr", type=float, default=None,
                   help="learning rate of the inflated image weights (default: --lr); the temporal layers use --lr")
    p.add_argument("--text-lr", type=float, default=None,
                   help="learning rate of the text encoder (default: the inflated weights' rate, --spatial-lr; 0 freezes it)")
    p.add_argument("--reinit-words", nargs="*", default=[],
                   help="words whose token embeddings are re-drawn at random (N(0, s²), s the rms of the trained "
                        "colour-word embeddings) before training, e.g. the video words that --inflate copies from [UNK]")
    p.add_argument("--eval-every", type=int, default=0,
                   help="every N steps: evaluate the EMA weights on the held-out prompts (--checkpoint-eval-seeds) "
                        "and run the direction probe; 0 = only at the end")
    p.add_argument("--checkpoint-eval-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--high-t-fraction", type=float, default=0.0,
                   help="fraction of each batch whose timestep is drawn from [--high-t-min, 1000) instead of [0, 1000): "
                        "the noise levels at which an object's path is still undecided, where the caption's direction "
                        "word is the only clue (the ε-loss there is small, so uniform sampling gives it little weight)")
    p.add_argument("--high-t-min", type=int, default=600)
    p.add_argument("--loss-weighting", choices=["eps", "v"], default="eps",
                   help="eps = the plain ε-MSE (the shipped model); v = each sample's ε-MSE times (1 + SNR_t) / SNR_t, "
                        "i.e. the v-prediction loss of the same ε-model (Salimans & Ho 2022, arXiv:2202.00512, "
                        "v = α ε − σ x0), which weights the high-noise steps where an object's path is decided by "
                        "up to 215× instead of ~1×; divided by its mean over t so the loss keeps its scale")
    p.add_argument("--max-loss-weight", type=float, default=0.0,
                   help="with --loss-weighting v: clamp (1 + SNR_t) / SNR_t at this value before normalising (0 = none)")
    p.add_argument("--freeze-except", nargs="*", default=[],
                   help="train only the UNet tensors whose names contain one of these substrings (e.g. attn2: the "
                        "cross-attentions, where the caption enters); the rest of the UNet is frozen")
    p.add_argument("--reinit-scale", type=float, default=1.0,
                   help="with --reinit-words: the re-drawn embeddings' rms, in units of the colour words' rms")
    p.add_argument("--t-min", type=int, default=0, help="draw every training timestep from [--t-min, 1000)")
    p.add_argument("--probe-every", type=int, default=0,
                   help="every N steps: log the direction probe and the text gap only (cheap; no held-out sampling)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 0 <= args.t_min < 1000:
        raise ValueError(f"--t-min {args.t_min}: the training timesteps are 0..999; pass a value in [0, 999]")
    if args.max_loss_weight < 0 or (args.max_loss_weight and args.loss_weighting != "v"):
        raise ValueError(f"--max-loss-weight {args.max_loss_weight}: a clamp > 0 of --loss-weighting v (0 = none)")
    if args.reinit_scale <= 0:
        raise ValueError(f"--reinit-scale {args.reinit_scale}: the re-drawn embeddings' rms factor must be > 0")
    if args.arch == "motion" and not (args.inflate or args.init):
        raise ValueError("--arch motion builds the motion UNet from the image model: pass --inflate (or --init a "
                         "folder this script wrote with --arch motion)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler
    from diffusers.training_utils import EMAModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffalign.models.text_to_video import TextToVideoPolicy
    from diffalign.models.tiny_random import SD15_SCHEDULER_CONFIG
    from diffalign.models.tiny_video import build_tiny_t2v_pipeline, tiny_unet3d

    t_start = time.time()
    vae = AutoencoderKL.from_pretrained(ASSETS / "tiny_sd" / "vae").eval().requires_grad_(False)
    tokenizer = build_tokenizer(video=True)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=64, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
    unet = tiny_unet3d(block_out_channels=tuple(args.channels), cross_attention_dim=64, attention_head_dim=8)
    inflated: set[str] = set()
    if args.inflate and args.arch == "motion":
        unet, text_encoder, inflated = inflate_motion_model(ASSETS / "tiny_sd", tokenizer, num_frames=args.frames,
                                                            motion_heads=args.motion_heads, seed=args.seed)
    elif args.inflate:
        unet, text_encoder, inflated = inflate_image_model(ASSETS / "tiny_sd", tokenizer)
    if args.inflate:
        log(f"inflated {ASSETS / 'tiny_sd'}: {len(inflated)} image tensors reused")
    if args.init:  # a second stage: same architecture, weights from an earlier run (saved in float16)
        from diffusers import UNet3DConditionModel, UNetMotionModel

        unet_class = UNetMotionModel if args.arch == "motion" else UNet3DConditionModel
        unet = unet_class.from_pretrained(Path(args.init) / "unet", torch_dtype=torch.float32)
        text_encoder = CLIPTextModel.from_pretrained(Path(args.init) / "text_encoder", torch_dtype=torch.float32)
        log(f"initialised from {args.init}")
    if args.reinit_words:
        emb = text_encoder.get_input_embeddings().weight
        vocab = tokenizer.get_vocab()
        unknown = [w for w in args.reinit_words if w not in vocab]
        if unknown:
            raise ValueError(f"--reinit-words: {unknown} are not in the video vocabulary {sorted(vocab)}")
        with torch.no_grad():
            scale = emb[[vocab[c] for c in ("red", "green", "blue", "yellow")]].pow(2).mean().sqrt() * args.reinit_scale
            g = torch.Generator().manual_seed(args.seed)
            for w in args.reinit_words:
                emb[vocab[w]] = torch.randn(emb.shape[1], generator=g) * scale
        log(f"re-drew the embeddings of {args.reinit_words} (rms {scale:.3f})")
    log(f"unet ({type(unet).__name__}) {sum(p.numel() for p in unet.parameters()) / 1e6:.3f}M params, text encoder "
        f"{sum(p.numel() for p in text_encoder.parameters()) / 1e6:.3f}M")
    rows = load_prompts("video_train")
    means, stds, prompts = encode_videos(vae, rows, args.num_videos, seed=1, frames=args.frames)
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids
    empty = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    log(f"encoded {len(prompts)} videos {tuple(means.shape[1:])} in {time.time() - t_start:.0f}s")
    noise_scheduler = DDPMScheduler(**{k: v for k, v in SD15_SCHEDULER_CONFIG.items()
                                       if k not in ("set_alpha_to_one", "timestep_spacing")})
    loss_weight = loss_weights(noise_scheduler.alphas_cumprod, args.loss_weighting, args.max_loss_weight)
    if args.freeze_except:
        kept = [n for n, p in unet.named_parameters() if any(k in n for k in args.freeze_except)]
        if not kept:
            raise ValueError(f"--freeze-except {args.freeze_except}: no UNet tensor name contains any of these")
        log(f"training {len(kept)} UNet tensors ({sum(p.numel() for n, p in unet.named_parameters() if n in kept) / 1e6:.3f}M"
            f" params) matching {args.freeze_except}; the rest frozen")
    params = list(unet.parameters()) + list(text_encoder.parameters())
    spatial = [p for n, p in unet.named_parameters() if n in inflated]
    text = list(text_encoder.parameters())
    spatial_ids = {id(p) for p in spatial + text}
    temporal = [p for p in params if id(p) not in spatial_ids]
    groups = [{"params": temporal, "lr": args.lr}]
    if spatial:
        groups.append({"params": spatial, "lr": args.spatial_lr or args.lr})
    text_lr = args.text_lr if args.text_lr is not None else ((args.spatial_lr or args.lr) if inflated else args.lr)
    groups.append({"params": text, "lr": text_lr})
    opt = torch.optim.AdamW(groups, weight_decay=1e-2)
    warm = min(100, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warm)) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, args.steps))))))
    probe_rows = [r for r in load_prompts("video_train") if any(e["motion"] != "still" for e in r["include"])]
    p_means, _, p_prompts = encode_videos(vae, probe_rows, 32, seed=2, frames=args.frames)
    probe_lat = p_means * vae.config.scaling_factor

    def _ids(texts):
        return tokenizer(texts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                         return_tensors="pt").input_ids

    probe_ids = _ids(p_prompts)
    probe_ids_swapped = _ids([" ".join(SWAP_DIRECTION.get(w, w) for w in q.split()) for q in p_prompts])
    eval_pipe = build_tiny_t2v_pipeline(vae=vae, text_encoder=text_encoder, unet=unet)
    eval_pipe.tokenizer = tokenizer
    eval_pipe.scheduler = DDIMScheduler.from_config(SD15_SCHEDULER_CONFIG)
    eval_policy = TextToVideoPolicy.from_video_pipeline(eval_pipe, num_frames=args.frames, lora_rank=None)
    unet.requires_grad_(True)  # the policy freezes the text encoder (and the UNet's base weights): train them again
    text_encoder.requires_grad_(True)
    if args.freeze_except:
        for n, p in unet.named_parameters():
            p.requires_grad_(any(k in n for k in args.freeze_except))
    checkpoints = {}

    def checkpoint(step: int, seeds) -> dict:
        ema_unet.store(unet.parameters())
        ema_text.store(text_encoder.parameters())
        ema_unet.copy_to(unet.parameters())
        ema_text.copy_to(text_encoder.parameters())
        unet.eval()
        text_encoder.eval()
        res = {"probe": direction_probe(unet, text_encoder, probe_lat, probe_ids, probe_ids_swapped, noise_scheduler),
               "text_gap": text_direction_gap(text_encoder, probe_ids, probe_ids_swapped),
               "heldout": evaluate(eval_policy, load_prompts("video_heldout")[:args.eval_prompts], seeds,
                                   steps=args.eval_steps),
               "minutes": (time.time() - t0) / 60}
        ema_unet.restore(unet.parameters())
        ema_text.restore(text_encoder.parameters())
        unet.train()
        text_encoder.train()
        h = res["heldout"]
        log(f"checkpoint {step}: accuracy {h['accuracy']:.3f} dense {h['dense']:.3f} direction {h['direction_sign']:.3f}"
            f" text gap {res['text_gap']:.3f} probe " + " ".join(f"t{t}: swap {v['swapped_caption_gap']:+.4f} rev {v['reversed_frames_gap']:+.4f}"
                                   for t, v in res["probe"].items()))
        return res

    ema_unet, ema_text = EMAModel(unet.parameters(), decay=0.999), EMAModel(text_encoder.parameters(), decay=0.999)
    gen = torch.Generator().manual_seed(args.seed)
    t0, running, curve, probes = time.time(), None, {}, {}
    unet.train()
    text_encoder.train()
    for step in range(args.steps):
        idx = torch.randint(len(prompts), (args.batch,), generator=gen)
        lat = (means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) * vae.config.scaling_factor
        tok = ids[idx].clone()
        tok[torch.rand(len(idx), generator=gen) < 0.1] = empty
        noise = torch.randn(lat.shape, generator=gen)
        t = torch.randint(args.t_min, 1000, (len(idx),), generator=gen)
        if args.high_t_fraction:
            high = torch.rand(len(idx), generator=gen) < args.high_t_fraction
            t = torch.where(high, torch.randint(args.high_t_min, 1000, (len(idx),), generator=gen), t)
        pred = unet(noise_scheduler.add_noise(lat, noise, t), t, text_encoder(tok)[0]).sample
        per_sample = F.mse_loss(pred, noise, reduction="none").flatten(1).mean(1)
        loss = (loss_weight[t] * per_sample).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        ema_unet.step(unet.parameters())
        ema_text.step(text_encoder.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == args.steps - 1:
            curve[step] = running
            log(f"step {step} loss {running:.4f} ({(step + 1) / (time.time() - t0):.2f} it/s)")
        if args.probe_every and (step + 1) % args.probe_every == 0:
            t_probe = time.time()
            unet.eval()
            text_encoder.eval()
            probe = direction_probe(unet, text_encoder, probe_lat, probe_ids, probe_ids_swapped, noise_scheduler)
            unet.train()
            text_encoder.train()
            probes[step + 1] = probe
            log(f"probe {step + 1} (live weights): " + " ".join(
                f"t{t}: swap {v['swapped_caption_gap']:+.4f} rev {v['reversed_frames_gap']:+.4f}" for t, v in probe.items()))
            t0 += time.time() - t_probe
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            t_eval = time.time()
            checkpoints[step + 1] = checkpoint(step + 1, args.checkpoint_eval_seeds)
            t0 += time.time() - t_eval  # training minutes exclude the checkpoint evaluations
    train_minutes = (time.time() - t0) / 60
    ema_unet.copy_to(unet.parameters())
    ema_text.copy_to(text_encoder.parameters())
    unet.eval()
    text_encoder.eval()
    pipe = eval_pipe
    probe = direction_probe(unet, text_encoder, probe_lat, probe_ids, probe_ids_swapped, noise_scheduler)
    text_gap = text_direction_gap(text_encoder, probe_ids, probe_ids_swapped)
    held = evaluate(eval_policy, load_prompts("video_heldout")[:args.eval_prompts], args.eval_seeds,
                    steps=args.eval_steps)
    log(f"held-out motion accuracy {held['accuracy']:.3f} ± {held['se']:.3f} dense {held['dense']:.3f} direction "
        f"{held['direction_sign']:.3f} {held['per_tag']}; text gap {text_gap:.3f}; probe {probe}")
    out = Path(args.out)
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True)
    if out.resolve() == (ASSETS / "tiny_t2v").resolve():  # the shipped model stores no VAE of its own:
        shutil.rmtree(out / "vae")  # model=tiny_t2v loads tiny_sd3's, the same weights (model.vae); any other --out
        # folder stays a complete pipeline that TextToVideoSDPipeline.from_pretrained loads alone
    metrics = {"init": args.init, "steps": args.steps, "batch": args.batch, "num_videos": args.num_videos, "frames": args.frames,
               "channels": args.channels, "train_minutes": train_minutes, "loss_curve": curve,
               "unet_params": sum(p.numel() for p in unet.parameters()), "heldout": held, "probe": probe, "text_gap": text_gap,
               "checkpoints": checkpoints, "probes": probes, "args": vars(args),
               "total_minutes": (time.time() - t_start) / 60, "threads": args.threads}
    (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"saved {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()
