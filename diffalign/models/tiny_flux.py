"""A tiny FLUX.1-format pipeline, built in-process (no hub files): for unit tests and smoke runs
(`model=tiny_flux_random`).

It has the component types of FLUX.1 (`FluxTransformer2DModel` with double- and single-stream blocks, rotary position
ids and, by default, the guidance embedding of the guidance-distilled FLUX.1-dev; `FlowMatchEulerDiscreteScheduler`
with FLUX.1-dev's resolution-dependent shift; `AutoencoderKL` with a `shift_factor`; a `CLIPTextModel` for the pooled
embedding and a `T5EncoderModel` for the token states), only very small, over the shapes world's tokenizer.

Sizes: 32×32 px images, VAE factor 4, unpacked latents `(4, 8, 8)` ↔ 16 packed tokens of width 16, CLIP pooled width
32, `max_sequence_length` = 12 T5 tokens (the world tokenizer's length) of width 32. The builders take trained
components (`vae`, `text_encoder`, `text_encoder_2`, `transformer`), so `scripts/pretrain_tiny_world.py` can assemble
a trained tiny FLUX the way it assembles the tiny SD3 model.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel, T5Config, T5EncoderModel

from diffalign.models.flux import DEFAULT_FLUX_LORA_TARGET_MODULES, FluxPolicy
from diffalign.models.tiny_random import build_tiny_vae, tiny_text_config
from diffalign.world.tokenizer import build_tokenizer

TINY_FLUX_MAX_SEQUENCE_LENGTH = 12
FLUX_DEV_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                             "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                             "max_image_seq_len": 4096}
"""FLUX.1-dev's `scheduler/scheduler_config.json` (the shift 3.0 is unused with dynamic shifting)."""


def build_tiny_flux_transformer(guidance_embeds: bool = True, num_layers: int = 1, num_single_layers: int = 2,
                                latent_channels: int = 4, num_attention_heads: int = 2) -> FluxTransformer2DModel:
    """A tiny `FluxTransformer2DModel`: packed inputs of 4 × `latent_channels`, `num_attention_heads` heads of 16
    (rotary axes 4+4+8; width 16 × heads), text width 32, pooled width 32."""
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, out_channels=None, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=16, num_attention_heads=num_attention_heads,
        joint_attention_dim=32,
        pooled_projection_dim=32, guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8),
    )


def build_tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True, vae: AutoencoderKL | None = None,
                             text_encoder: CLIPTextModel | None = None, text_encoder_2: T5EncoderModel | None = None,
                             transformer: FluxTransformer2DModel | None = None) -> FluxPipeline:
    """Builds a tiny `FluxPipeline` with random weights (global RNG untouched; same seed, same weights).

    Args:
        seed (`int`): initialisation seed.
        guidance_embeds (`bool`, defaults to True): a guidance-distilled transformer (FLUX.1-dev) or one without the
            guidance input (true CFG, as FLUX.1-schnell's architecture).
        vae, text_encoder, text_encoder_2, transformer: components to use instead of random ones (a VAE without
            `shift_factor` gets 0.0).
    """
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vae is None:
            vae = build_tiny_vae(shift_factor=0.1159, scaling_factor=0.3611)  # FLUX.1's VAE normalisation
        if vae.config.shift_factor is None:
            vae.register_to_config(shift_factor=0.0)
        torch.manual_seed(seed)
        if text_encoder is None:
            text_encoder = CLIPTextModel(tiny_text_config(tokenizer, num_attention_heads=2))
        torch.manual_seed(seed + 1)
        if text_encoder_2 is None:
            text_encoder_2 = T5EncoderModel(T5Config(
                vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0))
        torch.manual_seed(seed)
        if transformer is None:
            transformer = build_tiny_flux_transformer(guidance_embeds=guidance_embeds,
                                                      latent_channels=vae.config.latent_channels)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer, text_encoder_2=text_encoder_2.eval(),
        tokenizer_2=tokenizer, transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_flux_policy(seed: int = 0, guidance_embeds: bool = True, guidance: float | None = None,
                           flow_shift: float | None = None, lora_rank: int | None = 4,
                           lora_alpha: float | None = None, lora_target_modules=DEFAULT_FLUX_LORA_TARGET_MODULES,
                           lora_seed: int = 0) -> FluxPolicy:
    """A `FluxPolicy` around `build_tiny_flux_pipeline(seed, guidance_embeds)`: CPU, float32, 32×32 px,
    `max_sequence_length` 8."""
    return FluxPolicy(build_tiny_flux_pipeline(seed, guidance_embeds=guidance_embeds), height=32, width=32,
                      flow_shift=flow_shift, guidance=guidance, lora_rank=lora_rank, lora_alpha=lora_alpha,
                      lora_target_modules=lora_target_modules, lora_seed=lora_seed,
                      max_sequence_length=TINY_FLUX_MAX_SEQUENCE_LENGTH)
