"""A tiny, randomly initialised Stable-Diffusion-architecture pipeline, built in-process (no hub files).

It has the exact component types of SD1.5 (`AutoencoderKL`, `UNet2DConditionModel`, `CLIPTextModel`, a tokenizer and
`DDIMScheduler` with the SD1.5 schedule), only very small, so every code path that runs on SD1.5 runs here on a CPU in
milliseconds. The weights are random: images are noise-like, which is what unit tests and smoke runs need. For a
model that has actually learned the shapes world, point `model.pretrained` at the shipped tiny-world folder instead.

Sizes (defaults): 32×32 px images, VAE factor 4, latents `(4, 8, 8)`, text `(12, 32)`; about 0.1M UNet parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from diffalign.models.stable_diffusion import DEFAULT_LORA_TARGET_MODULES, StableDiffusionPolicy
from diffalign.world.tokenizer import build_tokenizer

# The SD1.5 scheduler config (`runwayml/stable-diffusion-v1-5/scheduler/scheduler_config.json`), DDIM variant.
SD15_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "clip_sample": False,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
}

VAE_FACTOR = 4  # three encoder blocks -> two downsamplings


def tiny_text_config(tokenizer, hidden_size: int = 32, intermediate_size: int = 64, num_hidden_layers: int = 2,
                     num_attention_heads: int = 4, projection_dim: int = 32) -> CLIPTextConfig:
    """The `CLIPTextConfig` of a tiny text encoder over `tokenizer` (its vocabulary, length and special tokens), with
    the given sizes."""
    return CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        max_position_embeddings=tokenizer.model_max_length, projection_dim=projection_dim,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def build_tiny_vae(sample_size: int = 32, norm_num_groups: int = 4, **config) -> AutoencoderKL:
    """The tiny models' `AutoencoderKL`, initialised from the current torch RNG: RGB ↔ 4 latent channels at factor
    `VAE_FACTOR` (three encoder blocks of widths 8, 16, 16, one layer each, no mid-block attention).

    Args:
        sample_size (`int`): image side in pixels.
        norm_num_groups (`int`): GroupNorm groups.
        config: the family's latent normalisation (``scaling_factor``, ``shift_factor``, ``force_upcast``), passed on.
    """
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=norm_num_groups, sample_size=sample_size, mid_block_add_attention=False,
        **config,
    )


def build_tiny_random_pipeline(seed: int = 0, sample_size_px: int = 32) -> StableDiffusionPipeline:
    """Builds a tiny randomly initialised SD-architecture `StableDiffusionPipeline`.

    The global torch RNG is left untouched (initialisation runs under `torch.random.fork_rng`), and the same `seed`
    always gives bitwise the same weights.

    Args:
        seed (`int`, defaults to 0):
            Initialisation seed; each component is initialised after `torch.manual_seed(seed)`.
        sample_size_px (`int`, defaults to 32):
            Image side in pixels; must be a positive multiple of 16 (VAE factor 4 × one UNet downsampling × 2 for
            an even 4×4 attention level). Latents are `(4, sample_size_px // 4, sample_size_px // 4)`.

    Returns:
        `StableDiffusionPipeline` on CPU in float32, with `safety_checker=None`, whose tokenizer is
        `diffalign.world.tokenizer.build_tokenizer()` (23 tokens, `model_max_length` 12).

    Raises:
        ValueError: if `sample_size_px` is not a positive multiple of 16.
    """
    if sample_size_px <= 0 or sample_size_px % 16 != 0:
        raise ValueError(f"`sample_size_px` must be a positive multiple of 16, got {sample_size_px}.")
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = build_tiny_vae(sample_size=sample_size_px)
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=sample_size_px // VAE_FACTOR,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(16, 32),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=8,
        )
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(tiny_text_config(tokenizer))
    scheduler = DDIMScheduler.from_config(SD15_SCHEDULER_CONFIG)
    pipe = StableDiffusionPipeline(
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        unet=unet.eval(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_random_policy(
    seed: int = 0,
    sample_size_px: int = 32,
    lora_rank: int | None = 4,
    lora_alpha: float | None = None,
    lora_target_modules: tuple[str, ...] | list[str] = DEFAULT_LORA_TARGET_MODULES,
    lora_seed: int = 0,
) -> StableDiffusionPolicy:
    """Builds a `StableDiffusionPolicy` around `build_tiny_random_pipeline(seed, sample_size_px)`.

    Args:
        seed (`int`): weight-initialisation seed of the base model.
        sample_size_px (`int`): image side in pixels (multiple of 16).
        lora_rank, lora_alpha, lora_target_modules, lora_seed: see `StableDiffusionPolicy`.

    Returns:
        `StableDiffusionPolicy` (CPU, float32) whose only trainable parameters are the LoRA matrices (or the whole
        UNet when `lora_rank` is `None`).
    """
    return StableDiffusionPolicy.from_pipeline(
        build_tiny_random_pipeline(seed=seed, sample_size_px=sample_size_px),
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_target_modules=lora_target_modules,
        lora_seed=lora_seed,
    )


@dataclass
class TinyRandomPolicyConfig:
    """Hydra config for `build_tiny_random_policy`; the fields mirror its keyword arguments."""

    _target_: str = "diffalign.models.tiny_random.build_tiny_random_policy"
    seed: int = 0
    sample_size_px: int = 32
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    lora_seed: int = 0
