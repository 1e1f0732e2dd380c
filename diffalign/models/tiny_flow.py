"""A tiny SD3-format (rectified flow) pipeline, built in-process: the architecture of the tiny world's flow model.

It has the component types of SD3 (`SD3Transformer2DModel`, `FlowMatchEulerDiscreteScheduler` with SD3's shift 3.0,
`AutoencoderKL` with a `shift_factor`, two `CLIPTextModelWithProjection` encoders, no T5), only very small. Random
weights serve unit tests and smoke runs (`model=tiny_flow_random`); `scripts/pretrain_tiny_world.py flow` trains the
same architecture on the shapes world and ships it as `diffalign/assets/tiny_sd3` (`model=tiny_sd3`).

Sizes: 32×32 px images, VAE factor 4, latents `(4, 8, 8)`, patch 1 (64 image tokens), text 2 × 12 CLIP tokens plus
`max_sequence_length` = 8 zero "T5" tokens of width 128.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection

from diffalign.models.sd3 import DEFAULT_SD3_LORA_TARGET_MODULES, StableDiffusion3Policy
from diffalign.models.tiny_random import build_tiny_vae, tiny_text_config
from diffalign.world.tokenizer import build_tokenizer

TINY_MAX_SEQUENCE_LENGTH = 8
SD3_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}


def build_tiny_text_encoder(tokenizer, hidden_size: int = 64, projection_dim: int = 32) -> CLIPTextModelWithProjection:
    """A tiny `CLIPTextModelWithProjection` over the world's tokenizer (random weights)."""
    return CLIPTextModelWithProjection(tiny_text_config(tokenizer, hidden_size=hidden_size,
                                                        intermediate_size=4 * hidden_size,
                                                        projection_dim=projection_dim))


def build_tiny_transformer(width: int = 96, num_layers: int = 4, head_dim: int = 32) -> SD3Transformer2DModel:
    """A tiny `SD3Transformer2DModel`: 8×8×4 latents, patch 1, `width` = heads × head_dim, joint dim 128."""
    return SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=width // head_dim, joint_attention_dim=128,
        caption_projection_dim=width, pooled_projection_dim=64, pos_embed_max_size=8,
    )


def build_tiny_flow_pipeline(seed: int = 0, vae: AutoencoderKL | None = None, width: int = 32,
                             num_layers: int = 2) -> StableDiffusion3Pipeline:
    """Builds a tiny SD3-format pipeline with random weights (global RNG untouched; same seed, same weights).

    Args:
        seed (`int`): initialisation seed.
        vae (`AutoencoderKL`, *optional*): a VAE to reuse (its config gets ``shift_factor=0.0`` when it has none);
            a random tiny one by default.
        width, num_layers (`int`): transformer width (a multiple of 32) and depth.
    """
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vae is None:
            vae = build_tiny_vae(shift_factor=0.0)
        if vae.config.shift_factor is None:
            vae.register_to_config(shift_factor=0.0)
        torch.manual_seed(seed)
        text_encoder = build_tiny_text_encoder(tokenizer)
        torch.manual_seed(seed + 1)
        text_encoder_2 = build_tiny_text_encoder(tokenizer)
        torch.manual_seed(seed)
        transformer = build_tiny_transformer(width=width, num_layers=num_layers)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=tokenizer, text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer, text_encoder_3=None, tokenizer_3=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_flow_policy(seed: int = 0, lora_rank: int | None = 4, lora_alpha: float | None = None,
                           lora_target_modules=DEFAULT_SD3_LORA_TARGET_MODULES, lora_seed: int = 0) -> StableDiffusion3Policy:
    """A `StableDiffusion3Policy` around `build_tiny_flow_pipeline(seed)` (CPU, float32, `max_sequence_length` 8)."""
    return StableDiffusion3Policy(build_tiny_flow_pipeline(seed), lora_rank=lora_rank, lora_alpha=lora_alpha,
                              lora_target_modules=lora_target_modules, lora_seed=lora_seed,
                              max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)
