"""Stable Diffusion 3 / 3.5 format (MMDiT transformer, rectified flow, velocity prediction) as a `DiffusionPolicy`.

Latents are `(B, C, H/f, W/f)` (C = 16 for SD3, 4 for the tiny world's model; f = `vae_scale_factor`, 8 for SD3),
in the pipeline's normalised space ``(z − shift_factor) · scaling_factor``. The forward process is rectified flow
(docs/methods/algorithms.md#forward-processes): x_σ = (1 − σ) x_0 + σ ε with σ ∈ [0, 1] (σ = 1 is pure noise), the
model predicts the velocity v̂ ≈ ε − x_0, and the transformer is fed the timestep ``1000 σ`` — the values
`FlowMatchEulerDiscreteScheduler.timesteps` holds, so a timestep t in this file always means σ = t / 1000. The
schedule's shift s (σ' = sσ / (1 + (s − 1)σ), the scheduler's `shift`, 3.0 for SD3) is applied by the scheduler when it
builds inference timesteps.

Text conditioning is `StableDiffusion3Pipeline.encode_prompt` itself (two CLIP encoders, the optional T5 encoder, the
zero T5 block of length `max_sequence_length` when T5 is absent), so embeddings match the pipeline's exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from omegaconf import MISSING
from torch import nn

from diffalign.models.base import check_prompts, expand_negative_prompts
from diffalign.models.pipeline_policy import (
    PipelinePolicy,
    RectifiedFlowMixin,
    cfg_batch,
    check_lora_arguments,
    load_pipeline,
)
from diffalign.types import PromptEmbeds

# Flow-GRPO / DGPO adapt the joint-attention projections of both streams (docs/methods/algorithms.md#flow-grpo,
# docs/methods/algorithms.md#dgpo).
DEFAULT_SD3_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)


class StableDiffusion3Policy(RectifiedFlowMixin, PipelinePolicy):
    """An SD3-format rectified-flow model as a trainable policy: frozen base weights plus a LoRA adapter on the
    transformer (or the full transformer with `lora_rank=None`).

    Args:
        pipe (`StableDiffusion3Pipeline`): supplies the VAE, the text encoders/tokenizers (T5 optional) and the
            transformer; modules are shared, not copied.
        lora_rank (`int` or `None`, defaults to 4): LoRA rank; `None` fine-tunes the whole transformer.
        lora_alpha (`float`, *optional*): LoRA alpha (output scale alpha / r); defaults to the rank.
        lora_target_modules (`Sequence[str]`): module-name suffixes that get an adapter (default: the joint-attention
            projections of both streams).
        lora_seed (`int`, defaults to 0): seed of the adapter initialisation (global RNG untouched).
        max_sequence_length (`int`, defaults to 256): length of the T5 block (zeros when T5 is absent), as the
            pipeline's argument of the same name; the tiny world's model was trained with 8.

    Raises:
        TypeError: for a scheduler that is not a `FlowMatchEulerDiscreteScheduler`.
        ValueError: for `lora_rank < 1`, empty targets, or a VAE without `shift_factor`.
    """

    pipeline_class = StableDiffusion3Pipeline
    denoiser_name = "transformer"
    denoiser_label = "an SD3-format transformer"
    latent_shift = True

    def __init__(
        self,
        pipe: StableDiffusion3Pipeline,
        *,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_SD3_LORA_TARGET_MODULES,
        lora_seed: int = 0,
        max_sequence_length: int = 256,
    ):
        super().__init__()
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise TypeError(
                f"StableDiffusion3Policy needs a FlowMatchEulerDiscreteScheduler, the pipeline has a"
                f" {type(pipe.scheduler).__name__}; load an SD3-format (rectified flow) checkpoint."
            )
        check_lora_arguments(lora_rank, lora_target_modules, "transformer", ["attn.to_q", "attn.to_k"])
        if pipe.vae.config.shift_factor is None:
            raise ValueError("The VAE config has no `shift_factor`; SD3-format pipelines need one (0.0 for none).")
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.vae = pipe.vae.requires_grad_(False).eval()
        self.text_encoders = nn.ModuleList(
            [m.requires_grad_(False).eval() for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)
             if m is not None]
        )
        self.transformer = pipe.transformer.requires_grad_(False)
        self.scheduler = pipe.scheduler
        self.max_sequence_length = max_sequence_length
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        torch_dtype: str = "float32",
        local_files_only: bool | None = None,
        load_t5: bool = True,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_SD3_LORA_TARGET_MODULES,
        lora_seed: int = 0,
        max_sequence_length: int = 256,
    ) -> StableDiffusion3Policy:
        """Loads an SD3/SD3.5 diffusers folder or hub id with `StableDiffusion3Pipeline.from_pretrained`.

        Args:
            pretrained_model_name_or_path (`str`): local folder with `model_index.json` or a hub id
                (e.g. "stabilityai/stable-diffusion-3.5-medium").
            torch_dtype (`str`, defaults to "float32"): dtype of the frozen weights; trainable ones stay float32.
            local_files_only (`bool`, *optional*): `None` means True when `HF_HUB_OFFLINE` is set.
            load_t5 (`bool`, defaults to True): False skips the T5 encoder (`text_encoder_3=None`, the pipeline then
                feeds zeros), saving ~9 GB for SD3.5. A local folder saved without T5 loads without it either way
                (with diffusers directly: ``StableDiffusion3Pipeline.from_pretrained(path, text_encoder_3=None,
                tokenizer_3=None)``).
            other arguments: see the class docstring.

        Raises:
            ValueError: for an unknown `torch_dtype` or a local path that is not a pipeline folder (before loading).
        """
        no_t5 = not load_t5
        index = os.path.join(os.path.expanduser(os.fspath(pretrained_model_name_or_path)), "model_index.json")
        if os.path.isfile(index):  # a folder saved without T5 (the tiny world's) lists it as [null, null]
            with open(index) as f:
                no_t5 = no_t5 or json.load(f).get("text_encoder_3", [None])[0] is None
        extra = {"text_encoder_3": None, "tokenizer_3": None} if no_t5 else {}
        pipe = load_pipeline(
            StableDiffusion3Pipeline, pretrained_model_name_or_path, revision=revision, variant=variant,
            torch_dtype=torch_dtype, local_files_only=local_files_only, kind="SD3-format",
            example_hub_id="stabilityai/stable-diffusion-3.5-medium", **extra,
        )
        return cls(pipe, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules,
                   lora_seed=lora_seed, max_sequence_length=max_sequence_length)

    def to_pipeline(self) -> StableDiffusion3Pipeline:
        """The `StableDiffusion3Pipeline` this policy wraps (modules and scheduler shared), so it generates with the
        current (adapted) weights."""
        return self.pipe

    # ------------------------------------------------------------------ properties

    @property
    def _input_weight(self) -> torch.Tensor:
        return self.transformer.pos_embed.proj.weight

    # ------------------------------------------------------------------ model calls

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        do_classifier_free_guidance: bool = True,
        num_images_per_prompt: int = 1,
    ) -> PromptEmbeds:
        """Encodes prompts with `StableDiffusion3Pipeline.encode_prompt` (frozen encoders, no gradients).

        Returns:
            `PromptEmbeds` with `prompt_embeds` `(P·n, L_clip + max_sequence_length, joint_attention_dim)`,
            `pooled_prompt_embeds` `(P·n, pooled_projection_dim)` and, with CFG, the negatives (default "") in the
            same layout; rows ``[p0]*n + [p1]*n + ...``.

        Raises:
            ValueError: if `prompts` is not a non-empty list of strings, `num_images_per_prompt < 1`, or
                `negative_prompts` has a length other than 1 or `P`.
        """
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        negatives = expand_negative_prompts(prompts, negative_prompts) if do_classifier_free_guidance else None
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
            num_images_per_prompt=num_images_per_prompt, do_classifier_free_guidance=do_classifier_free_guidance,
            negative_prompt=negatives, max_sequence_length=self.max_sequence_length,
        )
        if not do_classifier_free_guidance:
            npe = npooled = None
        return PromptEmbeds(pe, npe, pooled, npooled)

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool) -> torch.Tensor:
        """The transformer on `latents` (`(B, C, h, w)`, or ``2B`` rows when `guided`) with the joint text tokens and
        the pooled embeddings; t = 1000 σ as floats."""
        t = self._flow_timesteps(timesteps, latents, len(prompt_embeds), guided)
        if guided:
            states, pooled = cfg_batch(prompt_embeds), cfg_batch(prompt_embeds, pooled=True)
        else:
            states, pooled = prompt_embeds.prompt_embeds, prompt_embeds.pooled_prompt_embeds
        return self.forward_module(hidden_states=latents, timestep=t, encoder_hidden_states=states.to(self.dtype),
                                   pooled_projections=pooled.to(self.dtype), return_dict=False)[0]


@dataclass
class StableDiffusion3PolicyConfig:
    """Hydra config for `StableDiffusion3Policy.from_pretrained`; the fields mirror its arguments."""

    _target_: str = "diffalign.models.sd3.StableDiffusion3Policy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    variant: str | None = None
    torch_dtype: str = "float32"
    local_files_only: bool | None = None
    load_t5: bool = True
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_SD3_LORA_TARGET_MODULES))
    lora_seed: int = 0
    max_sequence_length: int = 256
