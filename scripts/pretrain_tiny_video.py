"""Pretrains a tiny text-to-video model of the tiny world: a UNet3D (`TextToVideoSDPipeline` format), or with
``--arch wan`` the shipped Wan-format base (`model=tiny_wan_t2v`).

Data: videos of the video world (`diffalign.world.video`, 8 frames of 32×32, objects moving left/right/up/down or
staying still) for random train captions (`video_train`) and seeds, encoded frame by frame with the shipped tiny
image VAE (`diffalign/assets/tiny_sd/vae`, frozen; posterior mean and std stored, a latent drawn each step). Model: a
`UNet3DConditionModel` (block channels (24, 48), cross-attention and temporal attention at 4×4, ε-prediction, SD1.5
schedule) and a tiny CLIP text encoder over the video tokenizer (`build_tokenizer(video=True)`), trained jointly with
10 % caption dropout (classifier-free guidance), AdamW lr 1e-3 with warm-up and cosine decay, grad clip 1, EMA 0.999;
fixed seed 0. The EMA weights are saved as a `TextToVideoSDPipeline` in float16 (loads as float32 with
``torch_dtype=torch.float32``) and evaluated with the motion verifier (`reward=[video_motion]`) on the held-out
video prompts (28 prompts × 4 seeds, DDIM 20 steps, CFG 4).

The UNet3D base that shipped as ``model=tiny_t2v`` until the Wan-format base superseded it (retired; its measured
rows are in docs/results/video.md) is the image model inflated (``--inflate``); the folder (default ``runs/tiny_t2v``)
is a complete pipeline, its VAE included, that `TextToVideoPolicy.from_pretrained` loads
(docs/results/tiny_world.md#the-retired-unet3d-video-base)::

    OMP_NUM_THREADS=2 python scripts/pretrain_tiny_video.py --inflate --threads 2 --steps 3000 --num-videos 16000 \
        --lr 1e-3 --spatial-lr 1e-4 --out runs/tiny_t2v

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

``--arch wan`` (issue 34; docs/results/video.md, "A Wan-format base") trains a Wan-format base from scratch instead,
in two stages run in ``--work`` (``--wan-stage vae``, ``transformer``, or ``all``), each resumable bit for bit
(a checkpoint every ``--checkpoint-minutes``, ``--resume``, ``--stop-at``; pretrain_tiny_world.py's checkpoints):
`train_wan_vae` (a tiny `AutoencoderKLWan`, 9 frames of 32×32 ↔ latents (4, 9, 8, 8)) and `train_wan_transformer`
(`WanTransformer3DModel` + a tiny umT5, rectified flow with Wan's shifted schedule, the probe and held-out evaluation
above), saved as a `WanPipeline` in ``--out`` (default ``<work>/tiny_wan_t2v``) that ``model=tiny_wan_t2v`` loads::

    OMP_NUM_THREADS=1 python scripts/pretrain_tiny_video.py --arch wan --threads 1 --wan-vae-steps 3000 \
        --steps 20000 --batch 16 --num-videos 16000 --probe-every 500 --eval-every 2000 --work runs/pretrain_wan
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


# ----------------------------------------------------------------------------------------------------------------------
# --arch wan: a Wan-format base (tiny AutoencoderKLWan + WanTransformer3DModel + tiny umT5), docs/results/video.md
# ----------------------------------------------------------------------------------------------------------------------
WAN_MAX_SEQUENCE_LENGTH = 16  # the video tokenizer's model_max_length: "[BOS] a red circle moving up and ... [EOS]"


def _world_script():
    """scripts/pretrain_tiny_world.py as a module: its resumable-stage helpers (`save_stage_checkpoint`,
    `load_stage_checkpoint`, `lr_lambda`), shared so both scripts checkpoint the same way."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_tiny_world", Path(__file__).with_name("pretrain_tiny_world.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_wan_vae(base_dim: int = 16, z_dim: int = 4):
    """A tiny `AutoencoderKLWan` for the world's videos: two spatial downsamples (``dim_mult`` (1, 2, 2)) and no
    temporal one, so `(B, 3, F, 32, 32)` pixels ↔ `(B, z_dim, F, 8, 8)` latents, one latent frame per video frame
    (``scale_factor_temporal`` 1, ``scale_factor_spatial`` 4). Its causal encoder reads the first frame alone and the
    rest in chunks of 4 (`AutoencoderKLWan._encode`), so F must be 1 + 4k for every frame to be encoded.

    The posterior's log-variance starts at −10 (std 0.007; the bias of the log-variance half of ``quant_conv``):
    Wan's encoder starts with posterior means of about 0.3 and std 1, and trained so (1e-6·KL, the image VAE's
    weight) it collapsed in a 250-step pilot to ignoring its latent (mean |μ| 0.27 → 0.03, std still 1.0, held-out
    PSNR 14.9 dB: the background only; docs/results/video.md)."""
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, False], latents_mean=[0.0] * z_dim,
                           latents_std=[1.0] * z_dim, scale_factor_temporal=1, scale_factor_spatial=4)
    with torch.no_grad():
        vae.quant_conv.bias[z_dim:] = -10.0  # DiagonalGaussianDistribution: channels [mean | log-variance]
    return vae


def build_wan_text_encoder(tokenizer, width: int = 64, layers: int = 2):
    """A tiny `UMT5EncoderModel` over the video tokenizer (`build_tokenizer(video=True)`; ids 0 pad, 2 EOS), the
    encoder `WanPipeline.encode_prompt` runs; no dropout."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=width // 4, d_ff=4 * width, num_layers=layers, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id))


def build_wan_transformer(z_dim: int, text_dim: int, width: int = 128, layers: int = 4, heads: int = 4):
    """A tiny `WanTransformer3DModel`: 1×2×2 patches (F×4×4 tokens for F×8×8 latents), `heads` heads of
    ``width / heads`` with Wan's 3-D rotary positions (frames, rows, columns), and in every block self-attention over
    all frames' tokens and cross-attention to the text states."""
    from diffusers import WanTransformer3DModel

    if width % heads:
        raise ValueError(f"--wan-width {width} must be divisible by --wan-heads {heads}")
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=width // heads,
                                 in_channels=z_dim, out_channels=z_dim, text_dim=text_dim, freq_dim=64,
                                 ffn_dim=4 * width, num_layers=layers, rope_max_seq_len=32)


def build_wan_pipeline(vae, text_encoder, transformer, tokenizer, flow_shift: float):
    """The `WanPipeline` the Wan stage saves: its scheduler is Wan's released one (UniPC on flow sigmas with
    `flow_shift`); `diffalign.models.wan.WanPolicy` samples it with an Euler/SDE flow scheduler of the same shift."""
    from diffusers import UniPCMultistepScheduler, WanPipeline

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render_wan_videos(rows, seeds, frames: int) -> torch.Tensor:
    """Videos of `rows` (seed i for row i) as `(B, 3, F, 32, 32)` in [-1, 1], Wan's channels-first pixel layout."""
    vids = videos_to_tensor(np.stack([render_video(r, seed=int(s), num_frames=frames) for r, s in zip(rows, seeds)]))
    return vids.permute(0, 2, 1, 3, 4) * 2 - 1


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's / SD3's time shift σ' = s·σ / (1 + (s − 1)·σ) (Esser et al. 2024, arXiv:2403.03206, eq. 23;
    `FlowMatchEulerDiscreteScheduler(shift=s)`), so the training noise levels follow the sampling schedule's."""
    return shift * sigma / (1 + (shift - 1) * sigma)


@torch.no_grad()
def eval_wan_vae(vae, frames: int, n_seeds: int = 4) -> dict:
    """The motion verifier on reconstructions (posterior mean) of the held-out video prompts' ground-truth renders,
    `n_seeds` seeds each: strict accuracy, `direction_sign`, and PSNR (dB, pixels in [0, 1]); the renders themselves
    score 1.0 (tests/unit/world/test_video_world.py)."""
    from diffalign.world.video import verify_video

    rows = load_prompts("video_heldout")
    rows, seeds = [r for r in rows for _ in range(n_seeds)], [50_000 + s for _ in rows for s in range(n_seeds)]
    correct, sign, mse = [], [], []
    for s in range(0, len(rows), 16):
        x = render_wan_videos(rows[s:s + 16], seeds[s:s + 16], frames).to(vae.device)
        rec = vae.decode(vae.encode(x).latent_dist.mean).sample
        rec01, x01 = ((rec + 1) / 2).clamp(0, 1), (x + 1) / 2
        mse.append(F.mse_loss(rec01, x01, reduction="none").flatten(1).mean(1))
        vids = (rec01.permute(0, 2, 3, 4, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)  # (B, F, H, W, 3)
        for v, r in zip(vids, rows[s:s + 16]):
            verdict = verify_video(v, r)
            correct.append(verdict.correct)
            sign += direction_sign(verdict.tracks, r)
    return {"accuracy": float(np.mean(correct)), "direction_sign": float(np.mean(sign)) if sign else float("nan"),
            "psnr_db": float(10 * math.log10(1.0 / torch.cat(mse).mean().item())), "n": len(correct)}


def train_wan_vae(args, work: Path, world) -> Path:
    """Stage 1 of ``--arch wan``: the tiny `AutoencoderKLWan` (`build_wan_vae`) on fresh renders of the train video
    prompts every step, the image VAE's loss (foreground-weighted L1 + MSE + 1e-6·KL, pretrain_tiny_world.py's
    ``vae`` stage), AdamW 2e-3 with warm-up and cosine decay; resumable as the transformer stage. Then the latents'
    per-channel mean and std (posterior means of 256 train videos) become ``latents_mean`` / ``latents_std`` (Wan's
    normalisation, ``(z − mean) / std``), and the verifier scores reconstructions (`eval_wan_vae`). Saves
    ``<work>/wan_vae`` and ``<work>/wan_vae_metrics.json``; returns the folder. ``--device`` holds the VAE and its
    training; renders and random draws stay on the CPU (then moved), so ``--device cpu`` is bit for bit today's run.
    """
    out = work / "wan_vae"
    metrics = work / "wan_vae_metrics.json"
    if args.resume and (out / "config.json").exists() and metrics.exists() \
            and json.loads(metrics.read_text()).get("steps") == args.wan_vae_steps:
        # finished earlier: training it again from its last checkpoint would re-save it, and a new file invalidates
        # the transformer stage's latents cache (keyed by the VAE file's time): minutes of re-encoding
        log(f"wan vae: finished earlier ({args.wan_vae_steps} steps, {metrics}); not trained again")
        return out
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    vae = build_wan_vae(args.wan_vae_dim, args.wan_z_dim).to(device).train()
    log(f"wan vae {sum(p.numel() for p in vae.parameters()) / 1e6:.3f}M params, {args.wan_vae_steps} steps")
    rows = load_prompts("video_train")
    opt = torch.optim.AdamW(vae.parameters(), lr=args.wan_vae_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, world.lr_lambda(min(100, args.wan_vae_steps // 10 + 1),
                                                                   args.wan_vae_steps))
    gen = torch.Generator().manual_seed(args.seed)
    sizes = {"steps": args.wan_vae_steps, "batch": args.wan_vae_batch, "dim": args.wan_vae_dim, "z": args.wan_z_dim,
             "frames": args.frames, "lr": args.wan_vae_lr}
    ckpt_path = work / "wan_vae_checkpoint.pt"
    resumable = {"modules": [vae], "emas": [], "optimizer": opt, "scheduler": sched, "generator": gen}
    start, running, elapsed, evals = 0, None, 0.0, []
    if args.resume and ckpt_path.exists():
        start, running, elapsed, evals = world.load_stage_checkpoint(ckpt_path, sizes, "--wan-vae-* / --frames",
                                                                     **resumable)
    t0, last_ckpt = time.time(), time.time()
    for step in range(start, args.wan_vae_steps):
        pick = torch.randint(len(rows), (args.wan_vae_batch,), generator=gen).tolist()
        x = render_wan_videos([rows[i] for i in pick], [10_000_000 + step * args.wan_vae_batch + k
                                                        for k in range(len(pick))], args.frames).to(device)
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen).to(device)
        rec = vae.decode(z).sample
        weight = 1.0 + 3.0 * (x.amax(dim=1, keepdim=True) > -0.3).float()  # the objects' pixels weigh 4x more
        loss = (weight * ((rec - x).abs() + (rec - x) ** 2)).mean() + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        done = step + 1
        if step % 50 == 0 or done == args.wan_vae_steps:
            log(f"wan vae step {step} loss {loss.item():.4f} (running {running:.4f}, "
                f"{(done - start) / (time.time() - t0):.2f} it/s)")
            evals.append({"step": done, "loss": loss.item(), "running": running})
        if done == args.stop_at:
            world.save_stage_checkpoint(ckpt_path, done, sizes, running=running, elapsed=elapsed + time.time() - t0,
                                        evals=evals, **resumable)
            log(f"stopped at step {done} (--stop-at); continue with --resume")
            return None
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes and done < args.wan_vae_steps:
            world.save_stage_checkpoint(ckpt_path, done, sizes, running=running, elapsed=elapsed + time.time() - t0,
                                        evals=evals, **resumable)
            last_ckpt = time.time()
    minutes = (elapsed + time.time() - t0) / 60
    vae.eval()
    with torch.no_grad():
        specs = [rows[i] for i in np.random.default_rng(999).integers(len(rows), size=256)]
        lat = torch.cat([vae.encode(render_wan_videos(specs[s:s + 32], range(900_000 + s, 900_032 + s),
                                                      args.frames).to(device)).latent_dist.mean.cpu()
                         for s in range(0, 256, 32)])
        posterior_std = vae.encode(render_wan_videos(specs[:32], range(900_000, 900_032), args.frames)
                                   .to(device)).latent_dist.std
    mean, std = lat.mean(dim=(0, 2, 3, 4)), lat.std(dim=(0, 2, 3, 4))
    posterior_std = float(posterior_std.mean())
    vae.register_to_config(latents_mean=[round(float(v), 5) for v in mean],
                           latents_std=[round(float(v), 5) for v in std])
    rec = eval_wan_vae(vae, args.frames)
    log(f"wan vae latents_mean {vae.config.latents_mean} latents_std {vae.config.latents_std} (mean posterior std "
        f"{posterior_std:.4f}); reconstructions of "
        f"the held-out videos: verifier accuracy {rec['accuracy']:.3f}, direction {rec['direction_sign']:.3f}, "
        f"PSNR {rec['psnr_db']:.2f} dB (n {rec['n']})")
    shutil.rmtree(out, ignore_errors=True)
    vae.save_pretrained(out)
    (work / "wan_vae_metrics.json").write_text(json.dumps(
        {"steps": args.wan_vae_steps, "device": str(device), "minutes": minutes, "final_running_loss": running, "loss_curve": evals,
         "latents_mean": vae.config.latents_mean, "latents_std": vae.config.latents_std, "posterior_std": posterior_std,
         "heldout_reconstructions": rec, "args": {k: v for k, v in vars(args).items()}}, indent=2))
    return out


def wan_direction_probe(transformer, encode, lat, prompts, swapped, sigmas=(0.3, 0.6, 0.9)) -> dict:
    """`direction_probe` for a flow model: the velocity MSE (target ε − x0, x_σ = (1 − σ) x0 + σ ε, t = 1000 σ) of
    moving-object latents `(B, C, F, h, w)` with the true caption, the direction-swapped caption, and the frames
    reversed (input and target), at each σ (fixed noise); keys are t = 1000 σ. A model that uses the direction word
    has swapped > true. (The reversed latents are not the latents of the reversed video under a causal VAE; the gap
    still says whether the model reads the order of its latent frames.) The noise is drawn on the CPU and moved to
    `lat`'s device."""
    g = torch.Generator().manual_seed(123)
    res = {}
    with torch.no_grad():
        cond, swap_cond = encode(prompts), encode(swapped)
        for s in sigmas:
            noise = torch.randn(lat.shape, generator=g).to(lat.device)  # drawn on the CPU on any device
            x, target = (1 - s) * lat + s * noise, noise - lat
            t = torch.full((len(lat),), 1000.0 * s, device=lat.device)

            def mse(inp, text, tgt, t=t):
                return F.mse_loss(transformer(hidden_states=inp, timestep=t, encoder_hidden_states=text,
                                              return_dict=False)[0], tgt).item()

            true = mse(x, cond, target)
            res[round(1000 * s)] = {"true": true, "swapped_caption_gap": mse(x, swap_cond, target) / true - 1,
                                         "reversed_frames_gap": mse(x.flip(2), cond, target.flip(2)) / true - 1}
    return res


def train_wan_transformer(args, work: Path, world) -> bool:
    """Stage 2 of ``--arch wan``: `WanTransformer3DModel` (`build_wan_transformer`) and the tiny umT5
    (`build_wan_text_encoder`) trained jointly from scratch by rectified flow on the stage-1 VAE's normalised latents
    of `--num-videos` train videos (posterior mean and std cached in ``<work>/wan_latents.pt``, a latent drawn each
    step): σ logit-normal then shifted by `--flow-shift` (`shift_sigmas`, the schedule the pipeline samples), x_σ =
    (1 − σ) x0 + σ ε, target ε − x0, t = 1000 σ (`WanPipeline`'s convention), text states from
    `WanPipeline.encode_prompt` (what sampling feeds the transformer), 10 % caption dropout (""), AdamW `--lr` with
    warm-up and cosine decay, grad clip 1, EMA 0.999. Every `--probe-every` steps `wan_direction_probe` and the text
    gap on the live weights; every `--eval-every` steps the EMA weights sampled on the held-out prompts (`evaluate`).
    Resumable bit for bit (pretrain_tiny_world.py's checkpoint: weights, EMAs, optimizer, LR schedule, RNG states)
    every `--checkpoint-minutes` in ``<work>/wan_checkpoint.pt``; `--stop-at` checkpoints and stops. At the end the
    EMA weights are evaluated and saved (float32) with the VAE as a `WanPipeline` in `--out`. Returns
    False when stopped early. ``--device`` holds the pipeline, training and evaluation; the latents cache and the
    random draws stay on the CPU (then moved), so ``--device cpu`` is bit for bit today's run; a checkpoint resumes
    on another device, not bit for bit (`load_stage_checkpoint`). With `--wan-init` the transformer and text encoder
    start from a folder this stage saved and its VAE is used (the latents re-encoded in this ``--work``); the EMAs start
    at those weights and the optimizer and schedule are fresh: a second stage of training."""
    from diffusers import AutoencoderKLWan
    from diffusers.training_utils import EMAModel, compute_density_for_timestep_sampling

    from diffalign.models.wan import WanPolicy

    init = Path(args.wan_init) if args.wan_init else None
    vae_dir = init / "vae" if init else work / "wan_vae"
    if not (vae_dir / "config.json").exists():
        raise SystemExit(f"--wan-init {init}: no VAE in {vae_dir}; pass a WanPipeline folder this script saved (--out)"
                         if init else
                         f"--wan-stage transformer: no trained VAE in {vae_dir}; run --wan-stage vae first (same --work)")
    device = torch.device(args.device)
    vae = AutoencoderKLWan.from_pretrained(vae_dir).eval().requires_grad_(False).to(device)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(video=True)
    text_encoder = build_wan_text_encoder(tokenizer, args.wan_text_width)
    transformer = build_wan_transformer(vae.config.z_dim, args.wan_text_width, args.wan_width, args.wan_layers,
                                        args.wan_heads)
    if init:  # a continuation: the saved weights (float32), strict, so other --wan-* sizes fail here, named
        from diffusers import WanTransformer3DModel
        from transformers import UMT5EncoderModel

        for module, cls, sub in ((transformer, WanTransformer3DModel, "transformer"),
                                 (text_encoder, UMT5EncoderModel, "text_encoder")):
            try:  # from_pretrained restores the text encoder's tied embeddings, which its file stores once
                module.load_state_dict(cls.from_pretrained(init / sub).state_dict(), strict=True)
            except (RuntimeError, OSError) as e:
                raise SystemExit(f"--wan-init {init}: its {sub} does not load into a model of --wan-width "
                                 f"{args.wan_width} / --wan-layers {args.wan_layers} / --wan-heads {args.wan_heads} / "
                                 f"--wan-text-width {args.wan_text_width}; pass the sizes it was trained with "
                                 f"({str(e).splitlines()[0][:200]})") from None
    pipe = build_wan_pipeline(vae, text_encoder, transformer, tokenizer, args.flow_shift).to(device)
    modules = [transformer, text_encoder]
    log(f"wan transformer {sum(p.numel() for p in transformer.parameters()) / 1e6:.3f}M params, text encoder "
        f"{sum(p.numel() for p in text_encoder.parameters()) / 1e6:.3f}M, vae {vae_dir}")
    # 1. latents (cached: a resume must not depend on re-encoding, and skips it)
    cache = work / "wan_latents.pt"
    key = {"n": args.num_videos, "frames": args.frames, "vae": (vae_dir / "diffusion_pytorch_model.safetensors").stat().st_mtime_ns}
    if cache.exists() and torch.load(cache)["key"] == key:
        data = torch.load(cache)
    else:
        t_enc, rows = time.time(), load_prompts("video_train")
        pick = np.random.default_rng(1).integers(len(rows), size=args.num_videos)
        means, stds = [], []
        with torch.no_grad():
            for s in range(0, args.num_videos, 32):
                d = vae.encode(render_wan_videos([rows[i] for i in pick[s:s + 32]],
                                                 range(1_000_003 + s, 1_000_003 + s + 32), args.frames)
                               .to(device)).latent_dist
                means.append(d.mean.cpu())
                stds.append(d.std.cpu())
        data = {"key": key, "means": torch.cat(means), "stds": torch.cat(stds), "prompts": [rows[i]["prompt"] for i in pick]}
        world.save_atomic(data, cache)
        log(f"encoded {args.num_videos} videos {tuple(data['means'].shape[1:])} in {time.time() - t_enc:.0f}s")
    means, stds, prompts = data["means"], data["stds"], data["prompts"]
    z = vae.config.z_dim
    lat_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    lat_std = torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)

    def encode(texts):
        return pipe.encode_prompt(prompt=texts, do_classifier_free_guidance=False,
                                  max_sequence_length=WAN_MAX_SEQUENCE_LENGTH, device=device)[0]

    # 2. instruments: the direction probe's moving-object latents and captions, the held-out sampler
    probe_rows = [r for r in load_prompts("video_train") if any(e["motion"] != "still" for e in r["include"])]
    probe_rows = [probe_rows[i] for i in np.random.default_rng(2).integers(len(probe_rows), size=32)]
    with torch.no_grad():
        probe_lat = (vae.encode(render_wan_videos(probe_rows, range(2_000_000, 2_000_032), args.frames).to(device))
                     .latent_dist.mean - lat_mean.to(device)) / lat_std.to(device)
    probe_prompts = [r["prompt"] for r in probe_rows]
    probe_swapped = [" ".join(SWAP_DIRECTION.get(w, w) for w in q.split()) for q in probe_prompts]
    policy = WanPolicy(pipe, num_frames=args.frames, height=32, width=32, lora_rank=None,
                       max_sequence_length=WAN_MAX_SEQUENCE_LENGTH)
    for m in modules:  # the policy froze them (and put the text encoder in eval mode): train them here
        m.requires_grad_(True).train()
    # 3. optimisation state, fresh or resumed
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, world.lr_lambda(min(200, args.steps // 10 + 1), args.steps,
                                                                   floor=0.1))
    emas = [EMAModel(m.parameters(), decay=0.999) for m in modules]
    gen = torch.Generator().manual_seed(args.seed)
    sizes = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "num_videos": args.num_videos,
             "frames": args.frames, "width": args.wan_width, "layers": args.wan_layers, "heads": args.wan_heads,
             "text_width": args.wan_text_width, "flow_shift": args.flow_shift}
    if init:  # only then, so checkpoints of from-scratch runs still resume
        sizes["init"] = str(init.resolve())
    ckpt_path = work / "wan_checkpoint.pt"
    resumable = {"modules": modules, "emas": emas, "optimizer": opt, "scheduler": sched, "generator": gen}
    start, running, elapsed, evals = 0, None, 0.0, []
    if args.resume and ckpt_path.exists():
        start, running, elapsed, evals = world.load_stage_checkpoint(
            ckpt_path, sizes, "--steps / --batch / --lr / --num-videos / --wan-* / --flow-shift", **resumable)

    def instruments(step: int, heldout: bool, weights: str = "live") -> dict:
        """The probe and text gap (live weights), and with `heldout` the EMA weights sampled on the held-out prompts
        (`--checkpoint-eval-seeds`); global RNG untouched, so a resumed run draws the same batches."""
        with torch.random.fork_rng(devices=[]):
            for m in modules:
                m.eval()
            res = {"step": step, "probe": wan_direction_probe(transformer, encode, probe_lat, probe_prompts,
                                                              probe_swapped),
                   "text_gap": (encode(probe_prompts) - encode(probe_swapped)).norm(dim=-1).mean().item()}
            if heldout:
                for ema, m in zip(emas, modules):
                    ema.store(m.parameters())
                    ema.copy_to(m.parameters())
                res["heldout"] = evaluate(policy, load_prompts("video_heldout")[:args.eval_prompts],
                                          args.checkpoint_eval_seeds, steps=args.eval_steps)
                for ema, m in zip(emas, modules):
                    ema.restore(m.parameters())
            for m in modules:
                m.train()
        line = " ".join(f"t{t}: swap {v['swapped_caption_gap']:+.4f} rev {v['reversed_frames_gap']:+.4f}"
                        for t, v in res["probe"].items())
        if heldout:
            h = res["heldout"]
            line = (f"held-out EMA accuracy {h['accuracy']:.3f} dense {h['dense']:.3f} direction {h['direction_sign']:.3f}; "
                    + line)
        log(f"wan step {step} ({weights} weights): {line} text gap {res['text_gap']:.3f}")
        return res

    def checkpoint(step: int) -> None:
        world.save_stage_checkpoint(ckpt_path, step, sizes, running=running, elapsed=elapsed + time.time() - t0,
                                    evals=evals, **resumable)

    # 4. train
    t0, last_ckpt = time.time(), time.time()
    for step in range(start, args.steps):
        idx = torch.randint(len(means), (args.batch,), generator=gen)
        lat = ((means[idx] + stds[idx] * torch.randn(means[idx].shape, generator=gen)) - lat_mean) / lat_std
        drop = (torch.rand(len(idx), generator=gen) < 0.1).tolist()
        noise = torch.randn(lat.shape, generator=gen)
        sigma = shift_sigmas(compute_density_for_timestep_sampling("logit_normal", len(idx), logit_mean=0.0,
                                                                   logit_std=1.0, generator=gen), args.flow_shift)
        sigma = sigma.clamp(1e-3, 1.0)
        lat, noise, sigma = lat.to(device), noise.to(device), sigma.to(device)  # drawn on the CPU, as on any device
        s = sigma.view(-1, 1, 1, 1, 1)
        states = encode(["" if d else prompts[i] for i, d in zip(idx.tolist(), drop)])
        pred = transformer(hidden_states=(1 - s) * lat + s * noise, timestep=1000 * sigma,
                           encoder_hidden_states=states, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - lat)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        for ema, m in zip(emas, modules):
            ema.step(m.parameters())
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        done = step + 1
        if step % 50 == 0 or done == args.steps:
            log(f"wan step {step} loss {loss.item():.4f} (running {running:.4f}, "
                f"{(done - start) / (time.time() - t0):.2f} it/s)")
            evals.append({"step": done, "loss": loss.item(), "running": running})
        eval_now = bool(args.eval_every) and done % args.eval_every == 0 and done < args.steps
        if eval_now or (args.probe_every and done % args.probe_every == 0):
            t_eval = time.time()
            evals.append(instruments(done, heldout=eval_now))
            t0 += time.time() - t_eval  # training minutes exclude the instruments
        if done == args.stop_at:
            checkpoint(done)
            log(f"stopped at step {done} (--stop-at); continue with --resume")
            return False
        if time.time() - last_ckpt > 60 * args.checkpoint_minutes and done < args.steps:
            checkpoint(done)
            last_ckpt = time.time()
    train_minutes = (elapsed + time.time() - t0) / 60
    # 5. the EMA weights evaluated and saved as a WanPipeline with its VAE, in float32 (WanTransformer3DModel keeps
    # its rotary, time-embedding and norm modules in float32; the whole folder is a few MB)
    for ema, m in zip(emas, modules):
        ema.copy_to(m.parameters())
        m.eval()
    final = instruments(args.steps, heldout=False, weights="final EMA")
    held = evaluate(policy, load_prompts("video_heldout")[:args.eval_prompts], args.eval_seeds, steps=args.eval_steps)
    log(f"wan held-out motion accuracy {held['accuracy']:.3f} ± {held['se']:.3f} dense {held['dense']:.3f} "
        f"direction {held['direction_sign']:.3f} {held['per_tag']}")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    pipe.save_pretrained(out, safe_serialization=True)
    vae_metrics = json.loads((work / "wan_vae_metrics.json").read_text()) if (work / "wan_vae_metrics.json").exists() \
        else None
    first = None
    if init and (init / "pretrain_metrics.json").exists():  # the continued run's VAE and its first stage's record
        earlier = json.loads((init / "pretrain_metrics.json").read_text())
        vae_metrics = earlier.get("vae")
        first = {"folder": str(init), "steps": earlier.get("steps"), "lr": earlier.get("args", {}).get("lr"),
                 "heldout": earlier.get("heldout"), "init": earlier.get("init")}
    (out / "pretrain_metrics.json").write_text(json.dumps(
        {"arch": "wan", "device": str(device), "steps": args.steps, "batch": args.batch, "num_videos": args.num_videos, "frames": args.frames,
         "train_minutes": train_minutes, "final_running_loss": running, "heldout": held, "probe": final["probe"],
         "text_gap": final["text_gap"], "evals": evals, "vae": vae_metrics, "init": first,
         "transformer_params": sum(p.numel() for p in transformer.parameters()), "args": vars(args)}, indent=2))
    log(f"saved {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MB)")
    return True


def main_wan(args) -> None:
    """``--arch wan``: `--wan-stage` vae, transformer, or all (vae then transformer) in `--work`."""
    if (args.frames - 1) % 4:
        raise SystemExit(f"--frames {args.frames}: the Wan VAE's causal encoder reads 1 + 4k frames; pass --frames 9")
    if args.flow_shift <= 0:
        raise SystemExit(f"--flow-shift {args.flow_shift}: the time shift must be > 0 (1 = none; Wan 2.1 480p: 3)")
    world = _world_script()
    if world.resolve_device(args.device).type == "cuda" and args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.wan_stage in ("vae", "all") and train_wan_vae(args, work, world) is None:
        return
    if args.wan_stage in ("transformer", "all"):
        train_wan_transformer(args, work, world)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--num-videos", type=int, default=8000)
    p.add_argument("--frames", type=int, default=None, help="video frames (default 8; --arch wan: 9, Wan's 1 + 4k)")
    p.add_argument("--channels", type=int, nargs=2, default=[24, 48])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=None, help="where the pipeline is saved (default runs/tiny_t2v; "
                                                "--arch wan: <--work>/tiny_wan_t2v)")
    p.add_argument("--eval-seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--eval-prompts", type=int, default=None, help="first N held-out prompts (default: all 28)")
    p.add_argument("--eval-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--init", default=None, help="continue from a folder this script wrote (its UNet and text encoder)")
    p.add_argument("--inflate", action="store_true",
                   help="start from the shipped image model (diffalign/assets/tiny_sd): its UNet inflated to a UNet3D "
                        "with the temporal layers' outputs zeroed (each frame = the image model at step 0) and its "
                        "text encoder extended to the video vocabulary")
    p.add_argument("--arch", choices=["unet3d", "motion", "wan"], default="unet3d",
                   help="with --inflate: unet3d = diffusers' UNet3DConditionModel (temporal convolutions + temporal "
                        "attentions without frame positions; the retired tiny_t2v); motion = an AnimateDiff-style "
                        "UNetMotionModel (temporal attentions with sinusoidal frame positions, no temporal "
                        "convolutions), see inflate_motion_model; wan = a Wan-format base trained from scratch (no "
                        "--inflate): a tiny AutoencoderKLWan, then WanTransformer3DModel + umT5 (see --wan-stage)")
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
                   help="eps = the plain ε-MSE (the retired tiny_t2v); v = each sample's ε-MSE times (1 + SNR_t) / SNR_t, "
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
    wan = p.add_argument_group("--arch wan (a Wan-format base: docs/results/video.md)")
    wan.add_argument("--wan-stage", choices=["vae", "transformer", "all"], default="all",
                     help="vae: the tiny AutoencoderKLWan; transformer: WanTransformer3DModel + umT5 on its latents "
                          "(needs <--work>/wan_vae); all: both in turn")
    wan.add_argument("--work", default="runs/pretrain_wan", help="scratch folder: the VAE, latents, checkpoints")
    wan.add_argument("--wan-vae-steps", type=int, default=3000)
    wan.add_argument("--wan-vae-batch", type=int, default=8)
    wan.add_argument("--wan-vae-lr", type=float, default=2e-3)
    wan.add_argument("--wan-vae-dim", type=int, default=16, help="AutoencoderKLWan base_dim (widths x1, x2, x2)")
    wan.add_argument("--wan-z-dim", type=int, default=4, help="latent channels")
    wan.add_argument("--wan-width", type=int, default=128, help="transformer width (heads x head width)")
    wan.add_argument("--wan-layers", type=int, default=4)
    wan.add_argument("--wan-heads", type=int, default=4)
    wan.add_argument("--wan-text-width", type=int, default=64, help="umT5 width (the transformer's text_dim)")
    wan.add_argument("--flow-shift", type=float, default=3.0,
                     help="time shift of the training sigmas and of the saved scheduler (Wan 2.1 480p: 3)")
    wan.add_argument("--checkpoint-minutes", type=float, default=5.0)
    wan.add_argument("--resume", action="store_true",
                     help="continue the stage from <--work>/wan_vae_checkpoint.pt or wan_checkpoint.pt, bit for bit")
    wan.add_argument("--device", default="cpu", help="where the models train and are evaluated (cpu, cuda, cuda:N); "
                     "batches are still drawn on the CPU")
    wan.add_argument("--tf32", action="store_true", help="with a CUDA --device: allow TF32 matmuls and convolutions")
    wan.add_argument("--wan-init", default=None,
                     help="--wan-stage transformer: continue training from a WanPipeline folder this script saved "
                          "(its transformer, text encoder and VAE; the latents are re-encoded in --work, a new folder) "
                          "with a fresh optimizer and a new warm-up + cosine schedule over --steps at --lr: a second "
                          "stage after a run's cosine has decayed (a warm restart, Loshchilov & Hutter 2017, "
                          "arXiv:1608.03983)")
    wan.add_argument("--stop-at", type=int, default=0,
                     help="checkpoint and stop the stage being run after this step (0: never)")
    args = p.parse_args()
    if args.arch == "wan":
        args.frames = args.frames or 9
        args.out = args.out or str(Path(args.work) / "tiny_wan_t2v")
        if args.inflate or args.init:
            raise SystemExit("--arch wan trains from scratch or continues with --wan-init: drop --inflate / --init")
        if args.wan_init and args.wan_stage != "transformer":
            raise SystemExit(f"--wan-init continues the transformer stage: pass --wan-stage transformer "
                             f"(not {args.wan_stage})")
        if args.wan_init and Path(args.out).resolve() == Path(args.wan_init).resolve():
            raise SystemExit(f"--out {args.out} is the --wan-init folder: pass another --out (it is replaced at the end)")
        main_wan(args)
        return
    if args.device != "cpu":
        raise SystemExit(f"--device {args.device}: only --arch wan takes --device; drop it for --arch {args.arch}")
    args.frames = args.frames or 8
    args.out = args.out or "runs/tiny_t2v"
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
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True)  # a complete pipeline, its VAE included
    metrics = {"init": args.init, "steps": args.steps, "batch": args.batch, "num_videos": args.num_videos, "frames": args.frames,
               "channels": args.channels, "train_minutes": train_minutes, "loss_curve": curve,
               "unet_params": sum(p.numel() for p in unet.parameters()), "heldout": held, "probe": probe, "text_gap": text_gap,
               "checkpoints": checkpoints, "probes": probes, "args": vars(args),
               "total_minutes": (time.time() - t_start) / 60, "threads": args.threads}
    (out / "pretrain_metrics.json").write_text(json.dumps(metrics, indent=2))
    log(f"saved {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MB)")


if __name__ == "__main__":
    main()
