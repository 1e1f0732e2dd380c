"""Tiny randomly initialised video pipelines, built in-process (no hub files), for tests and smoke runs.

- `build_tiny_t2v_pipeline`: a `TextToVideoSDPipeline` (UNet3D, ε, SD1.5 DDIM schedule) with the tiny world's image
  VAE layout (32×32 px ↔ 4×8×8 per frame), the world's tokenizer and a tiny CLIP text encoder;
- `build_tiny_wan_pipeline`: a `WanPipeline` (`WanTransformer3DModel`, `AutoencoderKLWan` with 8× spatial and 4×
  temporal compression, a tiny umT5 encoder over the world's tokenizer), 9 frames of 32×32 px ↔ latents 4×3×4×4;
- `build_tiny_wan22_pipeline`: the same with Wan 2.2's second expert (`transformer_2`, `boundary_ratio`).
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    DDIMScheduler,
    TextToVideoSDPipeline,
    UNet3DConditionModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import CLIPTextModel, UMT5Config, UMT5EncoderModel

from diffalign.models.text_to_video import TextToVideoPolicy
from diffalign.models.tiny_random import SD15_SCHEDULER_CONFIG, build_tiny_vae, tiny_text_config
from diffalign.models.wan import WanPolicy
from diffalign.world.tokenizer import build_tokenizer


def tiny_unet3d(block_out_channels=(32, 64), cross_attention_dim: int = 32, sample_size: int = 8,
                attention_head_dim: int = 8, layers_per_block: int = 1) -> UNet3DConditionModel:
    """A small `UNet3DConditionModel` (cross-attention and temporal attention at the lower resolution)."""
    return UNet3DConditionModel(
        sample_size=sample_size, in_channels=4, out_channels=4, block_out_channels=tuple(block_out_channels),
        down_block_types=("DownBlock3D", "CrossAttnDownBlock3D"), up_block_types=("CrossAttnUpBlock3D", "UpBlock3D"),
        layers_per_block=layers_per_block, cross_attention_dim=cross_attention_dim,
        attention_head_dim=attention_head_dim, norm_num_groups=8)


def build_tiny_t2v_pipeline(seed: int = 0, vae: AutoencoderKL | None = None, text_encoder=None,
                            unet: UNet3DConditionModel | None = None) -> TextToVideoSDPipeline:
    """A tiny `TextToVideoSDPipeline`; pass trained components to assemble the shipped model."""
    tokenizer = build_tokenizer(video=True)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(seed)
        if vae is None:
            vae = build_tiny_vae(norm_num_groups=8)
        if text_encoder is None:
            text_encoder = CLIPTextModel(tiny_text_config(tokenizer, num_hidden_layers=1, num_attention_heads=2))
        if unet is None:
            unet = tiny_unet3d(block_out_channels=(16, 32), cross_attention_dim=text_encoder.config.hidden_size)
    scheduler = DDIMScheduler.from_config(SD15_SCHEDULER_CONFIG)
    pipe = TextToVideoSDPipeline(vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, unet=unet,
                                 scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_t2v_policy(seed: int = 0, num_frames: int = 4, lora_rank: int | None = 4,
                          lora_alpha: float | None = None, lora_seed: int = 0) -> TextToVideoPolicy:
    """`TextToVideoPolicy` around `build_tiny_t2v_pipeline(seed)`."""
    return TextToVideoPolicy.from_video_pipeline(build_tiny_t2v_pipeline(seed), num_frames=num_frames,
                                                 lora_rank=lora_rank, lora_alpha=lora_alpha, lora_seed=lora_seed)


def build_tiny_wan_pipeline(seed: int = 0, flow_shift: float = 3.0) -> WanPipeline:
    """A tiny random `WanPipeline` (32×32 px; 8× spatial, 4× temporal VAE compression, z_dim 4)."""
    tokenizer = build_tokenizer(video=True)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=0))
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
                                            in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                            num_layers=2, rope_max_seq_len=32)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       transformer=transformer, scheduler=scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_wan22_pipeline(seed: int = 0, flow_shift: float = 3.0, boundary_ratio: float = 0.5) -> WanPipeline:
    """A tiny random Wan 2.2-style `WanPipeline`: `build_tiny_wan_pipeline(seed)` plus a second expert
    `transformer_2` (same architecture, seed + 1) for timesteps below ``boundary_ratio · 1000`` (Wan2.2-T2V-A14B:
    0.875; 0.5 here so that short rollouts use both)."""
    base = build_tiny_wan_pipeline(seed, flow_shift=flow_shift)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer_2 = WanTransformer3DModel.from_config(base.transformer.config)
    pipe = WanPipeline(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
                       transformer=base.transformer, scheduler=base.scheduler, transformer_2=transformer_2,
                       boundary_ratio=boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_wan22_policy(seed: int = 0, num_frames: int = 9, lora_rank: int | None = 4,
                            lora_alpha: float | None = None, lora_seed: int = 0, max_sequence_length: int = 16,
                            lora_experts: str = "both", guidance_scale_2: float | None = None,
                            boundary_ratio: float = 0.5) -> WanPolicy:
    """`WanPolicy` around `build_tiny_wan22_pipeline(seed, boundary_ratio=...)` (two experts, 32×32 px)."""
    return WanPolicy(build_tiny_wan22_pipeline(seed, boundary_ratio=boundary_ratio), num_frames=num_frames,
                     height=32, width=32, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_seed=lora_seed,
                     max_sequence_length=max_sequence_length, lora_experts=lora_experts,
                     guidance_scale_2=guidance_scale_2)


def build_tiny_wan_policy(seed: int = 0, num_frames: int = 9, lora_rank: int | None = 4,
                          lora_alpha: float | None = None, lora_seed: int = 0,
                          max_sequence_length: int = 16) -> WanPolicy:
    """`WanPolicy` around `build_tiny_wan_pipeline(seed)` (32×32 px, `num_frames` = 1 + 4k)."""
    return WanPolicy(build_tiny_wan_pipeline(seed), num_frames=num_frames, height=32, width=32, lora_rank=lora_rank,
                     lora_alpha=lora_alpha, lora_seed=lora_seed, max_sequence_length=max_sequence_length)
