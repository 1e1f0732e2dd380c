"""Stable Diffusion 1.x / 2.x (UNet, ε- or v-prediction) as a `DiffusionPolicy` with a peft LoRA adapter.

Latents are `(B, 4, H/8, W/8)` for SD (the VAE factor is `vae_scale_factor`), already multiplied by
`vae.config.scaling_factor`. Text embeddings are `(B, 77, 768)` (SD1.x) or `(B, 77, 1024)` (SD2.x).

What every family shares (the guided forward, the VAE, the LoRA adapter, the ε/v forward process) lives once in
`diffalign.models.pipeline_policy`; this file holds what is particular to SD1.x/2.x: the modules, the CLIP text
encoding and the UNet call. Other families have their own file (`sdxl.py`, `sd3.py`, `text_to_video.py`, `wan.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKL, DDIMScheduler, SchedulerMixin, StableDiffusionPipeline, UNet2DConditionModel
from omegaconf import MISSING
from transformers import CLIPTextModel, PreTrainedTokenizerBase

from diffalign.models.base import check_prompts, expand_negative_prompts
from diffalign.models.pipeline_policy import (  # noqa: F401 (LORA_WEIGHT_NAME, TORCH_DTYPES: kept importable here)
    LORA_WEIGHT_NAME,
    TORCH_DTYPES,
    NoisePredictionMixin,
    PipelinePolicy,
    cfg_batch,
    check_lora_arguments,
    check_pipeline_folder,
    load_pipeline,
)
from diffalign.runtime.text_context import TruncationWarner
from diffalign.types import PromptEmbeds

logger = logging.getLogger(__name__)

DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")

__all__ = ["DEFAULT_LORA_TARGET_MODULES", "StableDiffusionPolicy", "StableDiffusionPolicyConfig", "cfg_batch",
           "check_pipeline_folder"]


class StableDiffusionPolicy(NoisePredictionMixin, PipelinePolicy):
    """A Stable Diffusion 1.x/2.x model as a trainable policy: frozen base weights plus a LoRA adapter on the UNet.

    The VAE, text encoder and UNet base weights are frozen (`requires_grad=False`, VAE and text encoder in eval
    mode). With `lora_rank` set, a peft LoRA adapter named "default" is added to the UNet's attention projections and
    is the only trainable part; with `lora_rank=None` the whole UNet is trained. Trainable parameters are float32 even
    when the frozen parts are fp16/bf16 (docs/guides/field_cases.md#trainable-parameters-left-in-half-precision). The
    scheduler is converted to a `DDIMScheduler` with the same config, which the samplers in `diffalign.samplers` step
    with.

    The reference model of objectives that need one is this model with the adapter disabled (`reference()`).

    Args:
        vae (`AutoencoderKL`): the autoencoder; latents are scaled by `vae.config.scaling_factor`.
        text_encoder (`CLIPTextModel`): the text encoder; its last hidden state conditions the UNet.
        tokenizer (`PreTrainedTokenizerBase`): prompts are padded/truncated to `tokenizer.model_max_length`.
        unet (`UNet2DConditionModel`): the denoiser.
        scheduler (`SchedulerMixin`): any diffusers scheduler whose config is DDIM-compatible; its
            `prediction_type` ("epsilon" or "v_prediction") sets what `predict` returns.
        lora_rank (`int` or `None`, defaults to 4): LoRA rank r; `None` trains the full UNet instead.
        lora_alpha (`float`, *optional*): LoRA alpha; the adapter output is scaled by alpha / r. Defaults to r.
        lora_target_modules (`Sequence[str]`, defaults to ``("to_q", "to_k", "to_v", "to_out.0")``): module-name
            suffixes that get a LoRA adapter.
        lora_seed (`int`, defaults to 0): seed of the LoRA A-matrix initialisation (B starts at zero, so a fresh
            adapter leaves the model unchanged). The global RNG is not touched.

    Raises:
        ValueError: for an unsupported `prediction_type`, `lora_rank < 1`, or empty `lora_target_modules`.
    """

    pipeline_class = StableDiffusionPipeline
    denoiser_name = "unet"
    denoiser_label = "a UNet (SD1.x/2.x)"
    lora_keys = "diffusers"

    def __init__(
        self,
        *,
        vae: AutoencoderKL,
        text_encoder: CLIPTextModel,
        tokenizer: PreTrainedTokenizerBase,
        unet: UNet2DConditionModel,
        scheduler: SchedulerMixin,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGET_MODULES,
        lora_seed: int = 0,
    ):
        super().__init__()
        self.check_prediction_type(scheduler, type(self).__name__)
        check_lora_arguments(lora_rank, lora_target_modules, "UNet", ["to_q", "to_k", "to_v"])

        self.vae = vae.requires_grad_(False).eval()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.unet = unet.requires_grad_(False)
        self.tokenizer = tokenizer
        self._truncation = TruncationWarner("the text encoder", logger)  # reports each too-long prompt once
        self.scheduler = DDIMScheduler.from_config(scheduler.config)
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        torch_dtype: str = "float32",
        local_files_only: bool | None = None,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGET_MODULES,
        lora_seed: int = 0,
    ) -> StableDiffusionPolicy:
        """Loads an SD1.x/2.x diffusers folder or hub id with `StableDiffusionPipeline.from_pretrained`.

        Args:
            pretrained_model_name_or_path (`str`): a local diffusers folder (with `model_index.json`) or a hub id.
            revision (`str`, *optional*): hub revision.
            variant (`str`, *optional*): weight variant, e.g. "fp16".
            torch_dtype (`str`, defaults to "float32"): "float32", "float16" or "bfloat16" for the frozen weights;
                trainable parameters are float32 regardless.
            local_files_only (`bool`, *optional*): never contact the hub; `None` means True when `HF_HUB_OFFLINE` is
                set to a true value.
            lora_rank, lora_alpha, lora_target_modules, lora_seed: see the class docstring.

        Returns:
            `StableDiffusionPolicy` on CPU (move it with `.to(device)`).

        Raises:
            ValueError: for an unknown `torch_dtype`, or a local path that does not exist or has no `model_index.json`
                (raised before anything is loaded).
        """
        pipe = load_pipeline(
            StableDiffusionPipeline,
            pretrained_model_name_or_path,
            revision=revision,
            variant=variant,
            torch_dtype=torch_dtype,
            local_files_only=local_files_only,
            kind="Stable Diffusion",
            example_hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
            safety_checker=None,
            requires_safety_checker=False,
        )
        return cls.from_pipeline(
            pipe,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
            lora_seed=lora_seed,
        )

    @classmethod
    def from_pipeline(
        cls,
        pipe: StableDiffusionPipeline,
        *,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGET_MODULES,
        lora_seed: int = 0,
    ) -> StableDiffusionPolicy:
        """Wraps the components of an existing pipeline. The modules are shared, not copied: the adapter is added to
        `pipe.unet` itself."""
        return cls(
            vae=pipe.vae,
            text_encoder=pipe.text_encoder,
            tokenizer=pipe.tokenizer,
            unet=pipe.unet,
            scheduler=pipe.scheduler,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
            lora_seed=lora_seed,
        )

    def to_pipeline(self) -> StableDiffusionPipeline:
        """A `StableDiffusionPipeline` sharing this policy's modules and scheduler (`safety_checker=None`), so it
        generates with the current (adapted) weights."""
        pipe = StableDiffusionPipeline(
            vae=self.vae,
            text_encoder=self.text_encoder,
            tokenizer=self.tokenizer,
            unet=self.unet,
            scheduler=self.scheduler,
            safety_checker=None,
            feature_extractor=None,
            image_encoder=None,
            requires_safety_checker=False,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ------------------------------------------------------------------ properties

    @property
    def _input_weight(self) -> torch.Tensor:
        return self.unet.conv_in.weight

    # ------------------------------------------------------------------ model calls

    @torch.no_grad()
    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        do_classifier_free_guidance: bool = True,
        num_images_per_prompt: int = 1,
    ) -> PromptEmbeds:
        """Encodes prompts with the frozen text encoder (no gradients), as `StableDiffusionPipeline.encode_prompt`.

        Args:
            prompts (`list[str]`): `P` prompts.
            negative_prompts (`list[str]`, *optional*): `P` negative prompts, or one that is used for every prompt;
                defaults to the empty prompt "" (the unconditional embedding).
            do_classifier_free_guidance (`bool`, defaults to True): also encode the negatives.
            num_images_per_prompt (`int`, defaults to 1): `n`; every row is repeated `n` times in place.

        Returns:
            `PromptEmbeds` with `prompt_embeds` `(P·n, L, D)` in rows ``[p0]*n + [p1]*n + ...`` and, with CFG,
            `negative_prompt_embeds` `(P·n, L, D)` expanded the same way (diffusers once failed for n > 1 with
            precomputed embeddings: docs/guides/field_cases.md#several-images-per-prompt); `L` is
            `tokenizer.model_max_length`. Pooled embeddings are `None` (SD1.x/2.x do not use them).

        Raises:
            ValueError: if `prompts` is not a non-empty list of strings, `num_images_per_prompt < 1`, or
                `negative_prompts` has a length other than 1 or `P`.
        """
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        embeds = PromptEmbeds(self._encode_text(prompts))
        if do_classifier_free_guidance:
            embeds.negative_prompt_embeds = self._encode_text(expand_negative_prompts(prompts, negative_prompts))
        return embeds if num_images_per_prompt == 1 else embeds.repeat_interleave(num_images_per_prompt)

    def _encode_text(self, texts: list[str]) -> torch.Tensor:
        # prompts longer than the text encoder's context are truncated, as in diffusers; say so once per prompt
        self._truncation.check(self.tokenizer, texts, self.tokenizer.model_max_length)
        ids = self.tokenizer(
            texts,
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return self.text_encoder(ids.to(self.text_encoder.device))[0]

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool) -> torch.Tensor:
        """The UNet on `latents` (`(B, C, h, w)`, or ``2B`` rows when `guided`) with the text embeddings as
        cross-attention states; integer timesteps (a scalar or `(B,)`)."""
        if guided and isinstance(timesteps, torch.Tensor) and timesteps.ndim == 1:
            timesteps = torch.cat([timesteps, timesteps])
        states = cfg_batch(prompt_embeds) if guided else prompt_embeds.prompt_embeds
        return self.forward_module(latents, timesteps, encoder_hidden_states=states.to(self.dtype),
                                   return_dict=False)[0]


@dataclass
class StableDiffusionPolicyConfig:
    """Hydra config for `StableDiffusionPolicy.from_pretrained`; the fields mirror its arguments."""

    _target_: str = "diffalign.models.stable_diffusion.StableDiffusionPolicy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    variant: str | None = None
    torch_dtype: str = "float32"
    local_files_only: bool | None = None
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    lora_seed: int = 0
