"""A tiny, randomly initialised SDXL-architecture pipeline, built in-process from diffusers/transformers configs (no
hub files, nothing downloaded).

It has the component types and wiring of SDXL-base: a `UNet2DConditionModel` with ``addition_embed_type="text_time"``
(pooled text embeddings + 6 micro-conditioning time ids through ``add_embedding``), linear-projection transformer
blocks with more layers at the lower resolution, cross-attention over the concatenation of two text encoders
(`CLIPTextModel` and `CLIPTextModelWithProjection`, penultimate hidden states), an `AutoencoderKL` with SDXL's scaling
factor and ``force_upcast``, and SDXL's `EulerDiscreteScheduler` config; only very small, so every SDXL code path
runs on a CPU in milliseconds. Random weights: for unit tests and smoke runs (`model=tiny_sdxl_random`).

Sizes: 32×32 px images, VAE factor 4, latents `(4, 8, 8)`, text 12 tokens of 32 + 32 = 64 dims, pooled 32 dims;
about 0.3M UNet parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from diffalign.models.sdxl import DEFAULT_SDXL_LORA_TARGET_MODULES, NUM_TIME_IDS, StableDiffusionXLPolicy
from diffalign.models.tiny_random import build_tiny_vae, tiny_text_config
from diffalign.world.tokenizer import build_tokenizer

# SDXL-base's scheduler config (stabilityai/stable-diffusion-xl-base-1.0, scheduler/scheduler_config.json).
SDXL_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "prediction_type": "epsilon",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "clip_sample": False,
}
SDXL_VAE_SCALING_FACTOR = 0.13025  # SDXL-base's vae/config.json
ADDITION_TIME_EMBED_DIM = 8  # 256 in SDXL-base
TEXT_HIDDEN = 32  # each encoder's width (768 and 1280 in SDXL-base)
POOLED_DIM = 32  # text_encoder_2.config.projection_dim (1280 in SDXL-base)


def _text_encoder(cls, tokenizer):
    return cls(tiny_text_config(tokenizer, hidden_size=TEXT_HIDDEN, intermediate_size=2 * TEXT_HIDDEN,
                                projection_dim=POOLED_DIM))


def build_tiny_sdxl_pipeline(seed: int = 0, prediction_type: str = "epsilon") -> StableDiffusionXLPipeline:
    """Builds a tiny randomly initialised SDXL-architecture `StableDiffusionXLPipeline` (CPU, float32).

    The global torch RNG is left untouched (initialisation runs under `torch.random.fork_rng`), and the same `seed`
    always gives bitwise the same weights.

    Args:
        seed (`int`, defaults to 0): initialisation seed.
        prediction_type (`str`, defaults to "epsilon"): the scheduler's "epsilon" (SDXL-base) or "v_prediction".

    Returns:
        `StableDiffusionXLPipeline` with ``force_zeros_for_empty_prompt=True`` (as SDXL-base) and no watermarker; both
        tokenizers are `diffalign.world.tokenizer.build_tokenizer()` (`model_max_length` 12).
    """
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = build_tiny_vae(scaling_factor=SDXL_VAE_SCALING_FACTOR, force_upcast=True)
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(16, 32), layers_per_block=1, transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4), use_linear_projection=True, norm_num_groups=8,
            cross_attention_dim=2 * TEXT_HIDDEN,  # the two encoders' hidden states, concatenated
            addition_embed_type="text_time", addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
            projection_class_embeddings_input_dim=NUM_TIME_IDS * ADDITION_TIME_EMBED_DIM + POOLED_DIM,
        )
        torch.manual_seed(seed)
        text_encoder = _text_encoder(CLIPTextModel, tokenizer)
        torch.manual_seed(seed + 1)
        text_encoder_2 = _text_encoder(CLIPTextModelWithProjection, tokenizer)
    scheduler = EulerDiscreteScheduler.from_config({**SDXL_SCHEDULER_CONFIG, "prediction_type": prediction_type})
    pipe = StableDiffusionXLPipeline(
        vae=vae.eval(), text_encoder=text_encoder.eval(), text_encoder_2=text_encoder_2.eval(), tokenizer=tokenizer,
        tokenizer_2=tokenizer, unet=unet.eval(), scheduler=scheduler, force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_sdxl_policy(
    seed: int = 0,
    prediction_type: str = "epsilon",
    lora_rank: int | None = 4,
    lora_alpha: float | None = None,
    lora_target_modules: tuple[str, ...] | list[str] = DEFAULT_SDXL_LORA_TARGET_MODULES,
    lora_seed: int = 0,
) -> StableDiffusionXLPolicy:
    """A `StableDiffusionXLPolicy` around `build_tiny_sdxl_pipeline(seed, prediction_type)` (CPU, float32); the
    LoRA arguments as `StableDiffusionXLPolicy`."""
    return StableDiffusionXLPolicy(build_tiny_sdxl_pipeline(seed=seed, prediction_type=prediction_type),
                                   lora_rank=lora_rank, lora_alpha=lora_alpha,
                                   lora_target_modules=lora_target_modules, lora_seed=lora_seed)


@dataclass
class TinySDXLPolicyConfig:
    """Hydra config for `build_tiny_sdxl_policy`; the fields mirror its keyword arguments."""

    _target_: str = "diffalign.models.tiny_sdxl.build_tiny_sdxl_policy"
    seed: int = 0
    prediction_type: str = "epsilon"
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_SDXL_LORA_TARGET_MODULES))
    lora_seed: int = 0
