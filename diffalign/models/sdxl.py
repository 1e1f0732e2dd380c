"""Stable Diffusion XL (`StableDiffusionXLPipeline`: UNet with two CLIP text encoders, pooled embeddings and
micro-conditioning, ε- or v-prediction) as a `DiffusionPolicy` with a peft LoRA adapter on the UNet.

Latents are `(B, 4, H/8, W/8)` (1024×1024 px ↔ `(4, 128, 128)` for SDXL-base), times `vae.config.scaling_factor`
(0.13025). The conditioning is the pipeline's (docs/guides/sdxl.md):

- token embeddings `(B, 77, 2048)`: the penultimate hidden states of both text encoders, concatenated (768 + 1280);
- pooled embeddings `(B, 1280)`: the projected pooled output of the second encoder, the UNet's ``text_embeds``;
- ``time_ids`` `(B, 6)` = ``original_size + crops_coords_top_left + target_size`` (height, width order), the
  UNet's micro-conditioning. They are not carried by `PromptEmbeds`: the policy computes them from the latents' pixel
  size inside `predict` (original = target = that size, crop (0, 0): what `StableDiffusionXLPipeline.__call__` uses
  by default), so the samplers, objectives and loops run unchanged.

Token and pooled embeddings come from `StableDiffusionXLPipeline.encode_prompt` itself, so they match the pipeline's
exactly, including its negatives: without explicit negative prompts the unconditional embeddings are zeros when the
pipeline's ``force_zeros_for_empty_prompt`` is set (SDXL-base), the encoded "" otherwise. Classifier-free guidance
batches ``[negative, positive]`` for the token embeddings, the pooled embeddings and the ``time_ids`` alike.

The LoRA is saved with `StableDiffusionXLPipeline.save_lora_weights` (``unet.*`` keys in the diffusers format, the
adapter config as metadata), so ``StableDiffusionXLPipeline.load_lora_weights(folder)`` reproduces the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionXLPipeline
from omegaconf import MISSING

from diffalign.models.base import check_prompts, expand_negative_prompts
from diffalign.models.pipeline_policy import (
    NoisePredictionMixin,
    PipelinePolicy,
    cfg_batch,
    check_lora_arguments,
    load_pipeline,
    resolve_dtype,
    truthy_env,
)
from diffalign.types import PromptEmbeds

# The attention projections, as diffusers' SDXL LoRA scripts adapt them (train_text_to_image_lora_sdxl.py,
# train_dreambooth_lora_sdxl.py and research_projects/diffusion_dpo/train_diffusion_dpo_sdxl.py:
# target_modules=["to_k", "to_q", "to_v", "to_out.0"]).
DEFAULT_SDXL_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
NUM_TIME_IDS = 6  # original (h, w) + crop (top, left) + target (h, w): SDXL-base (the refiner takes 5)


class StableDiffusionXLPolicy(NoisePredictionMixin, PipelinePolicy):
    """An SDXL model as a trainable policy: frozen VAE and text encoders, a LoRA adapter on the UNet (or the whole
    UNet with `lora_rank=None`); the scheduler is converted to a `DDIMScheduler` with the same config (the samplers
    step it), so ε- and v-prediction checkpoints both work.

    Args:
        pipe (`StableDiffusionXLPipeline`): supplies the VAE, both text encoders and tokenizers and the UNet (shared,
            not copied: the adapter is added to `pipe.unet`).
        lora_rank (`int` or `None`, defaults to 4): LoRA rank r; `None` trains the full UNet.
        lora_alpha (`float`, *optional*): LoRA alpha (output scale alpha / r); defaults to r.
        lora_target_modules (`Sequence[str]`, defaults to `DEFAULT_SDXL_LORA_TARGET_MODULES`): module-name suffixes.
        lora_seed (`int`, defaults to 0): seed of the adapter initialisation (global RNG untouched).
        original_size (`tuple[int, int]`, *optional*): the ``original_size`` micro-condition (height, width) in
            pixels; `None` (default) uses the latents' pixel size, as the pipeline does.
        crops_coords_top_left (`tuple[int, int]`, defaults to ``(0, 0)``): the crop micro-condition (top, left).
        target_size (`tuple[int, int]`, *optional*): the ``target_size`` micro-condition; `None` uses the latents'
            pixel size.
        gradient_checkpointing (`bool`, defaults to False): recompute the UNet's activations in the backward pass
            (`UNet2DConditionModel.enable_gradient_checkpointing`): less memory, more compute, the same values.
            Both released SDXL preference trainers (Diffusion-DPO, DDSPO) turn it on for SDXL.

    Raises:
        ValueError: for a `prediction_type` other than "epsilon"/"v_prediction", bad LoRA arguments, a UNet whose
            added-embedding width does not fit 6 time ids plus the pooled embeddings (e.g. the SDXL refiner), or a
            VAE with ``latents_mean``/``latents_std`` (not SDXL-base's latent space).
    """

    pipeline_class = StableDiffusionXLPipeline
    denoiser_name = "unet"
    denoiser_label = "an SDXL UNet"
    lora_keys = "diffusers"

    def __init__(
        self,
        pipe: StableDiffusionXLPipeline,
        *,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_SDXL_LORA_TARGET_MODULES,
        lora_seed: int = 0,
        original_size: Sequence[int] | None = None,
        crops_coords_top_left: Sequence[int] = (0, 0),
        target_size: Sequence[int] | None = None,
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        self.check_prediction_type(pipe.scheduler, type(self).__name__)
        check_lora_arguments(lora_rank, lora_target_modules, "UNet", ["to_q", "to_k", "to_v"])
        if pipe.text_encoder_2 is None:
            raise ValueError("StableDiffusionXLPolicy needs the pipeline's text_encoder_2 (its pooled embeddings "
                             "condition the UNet); load the full SDXL pipeline")
        for name, size in (("original_size", original_size), ("crops_coords_top_left", crops_coords_top_left),
                           ("target_size", target_size)):
            if size is not None and len(size) != 2:
                raise ValueError(f"`{name}` must be a pair (height, width) or (top, left), got {size!r}.")
        expected = pipe.unet.add_embedding.linear_1.in_features if pipe.unet.config.addition_embed_type else None
        passed = pipe.unet.config.addition_time_embed_dim * NUM_TIME_IDS + pipe.text_encoder_2.config.projection_dim \
            if pipe.unet.config.addition_time_embed_dim else None
        if pipe.unet.config.addition_embed_type != "text_time" or expected != passed:
            raise ValueError(
                f"the UNet's added conditioning (addition_embed_type={pipe.unet.config.addition_embed_type!r}, width "
                f"{expected}) does not take {NUM_TIME_IDS} time ids plus the {pipe.text_encoder_2.config.projection_dim}"
                "-d pooled embedding of SDXL-base; StableDiffusionXLPolicy supports SDXL-base-style text-to-image "
                "UNets (not the refiner)")
        if getattr(pipe.vae.config, "latents_mean", None) is not None:
            raise ValueError("the VAE normalises its latents with latents_mean/latents_std (not SDXL-base's latent "
                             "space); StableDiffusionXLPolicy supports VAEs scaled by scaling_factor only")

        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.vae = pipe.vae.requires_grad_(False).eval()
        if self.vae.dtype == torch.float16 and self.vae.config.force_upcast:
            # the SDXL VAE overflows in fp16 (the pipeline upcasts it to decode; diffusers' training scripts keep it
            # float32): keep it float32 unless it is a VAE fixed for fp16 (force_upcast false)
            self.vae.to(torch.float32)
        self.text_encoder = pipe.text_encoder.requires_grad_(False).eval() if pipe.text_encoder is not None else None
        self.text_encoder_2 = pipe.text_encoder_2.requires_grad_(False).eval()
        self.unet = pipe.unet.requires_grad_(False)
        self.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        self.original_size = tuple(original_size) if original_size is not None else None
        self.crops_coords_top_left = tuple(crops_coords_top_left)
        self.target_size = tuple(target_size) if target_size is not None else None
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)
        if gradient_checkpointing:
            self.unet.enable_gradient_checkpointing()

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
        pretrained_vae_model_name_or_path: str | None = None,
        lora_rank: int | None = 4,
        lora_alpha: float | None = None,
        lora_target_modules: Sequence[str] = DEFAULT_SDXL_LORA_TARGET_MODULES,
        lora_seed: int = 0,
        original_size: Sequence[int] | None = None,
        crops_coords_top_left: Sequence[int] = (0, 0),
        target_size: Sequence[int] | None = None,
        gradient_checkpointing: bool = False,
    ) -> StableDiffusionXLPolicy:
        """Loads an SDXL diffusers folder or hub id with `StableDiffusionXLPipeline.from_pretrained`.

        Args:
            pretrained_model_name_or_path (`str`): a local folder with `model_index.json` or a hub id
                (e.g. "stabilityai/stable-diffusion-xl-base-1.0").
            revision, variant (`str`, *optional*): hub revision, weight variant (e.g. "fp16").
            torch_dtype (`str`, defaults to "float32"): dtype of the frozen weights; trainable ones stay float32. In
                float16 the SDXL-base VAE is kept float32 (it overflows in fp16) unless a VAE fixed for fp16 is given.
            local_files_only (`bool`, *optional*): never contact the hub; `None` means True when `HF_HUB_OFFLINE` is
                set to a true value.
            pretrained_vae_model_name_or_path (`str`, *optional*): a VAE folder or hub id used instead of the
                pipeline's (e.g. "madebyollin/sdxl-vae-fp16-fix", as the released Diffusion-DPO SDXL runs do).
            other arguments: see the class docstring.

        Raises:
            ValueError: for an unknown `torch_dtype` or a local path that is not a pipeline folder (before loading).
        """
        extra = {}
        if pretrained_vae_model_name_or_path is not None:
            offline = truthy_env("HF_HUB_OFFLINE") if local_files_only is None else local_files_only
            extra["vae"] = AutoencoderKL.from_pretrained(pretrained_vae_model_name_or_path,
                                                         dtype=resolve_dtype(torch_dtype), local_files_only=offline)
        pipe = load_pipeline(
            StableDiffusionXLPipeline, pretrained_model_name_or_path, revision=revision, variant=variant,
            torch_dtype=torch_dtype, local_files_only=local_files_only, kind="SDXL",
            example_hub_id="stabilityai/stable-diffusion-xl-base-1.0", add_watermarker=False, **extra,
        )
        return cls(pipe, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules,
                   lora_seed=lora_seed, original_size=original_size, crops_coords_top_left=crops_coords_top_left,
                   target_size=target_size, gradient_checkpointing=gradient_checkpointing)

    def to_pipeline(self) -> StableDiffusionXLPipeline:
        """A `StableDiffusionXLPipeline` sharing this policy's modules and DDIM scheduler (same
        ``force_zeros_for_empty_prompt``), so it generates with the current (adapted) weights."""
        pipe = StableDiffusionXLPipeline(
            vae=self.vae, text_encoder=self.text_encoder, text_encoder_2=self.text_encoder_2,
            tokenizer=self.pipe.tokenizer, tokenizer_2=self.pipe.tokenizer_2, unet=self.unet, scheduler=self.scheduler,
            force_zeros_for_empty_prompt=self.pipe.config.force_zeros_for_empty_prompt, add_watermarker=False,
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
        """Encodes prompts with `StableDiffusionXLPipeline.encode_prompt` (both encoders, frozen, no gradients).

        Args:
            prompts (`list[str]`): `P` prompts (sent to both encoders).
            negative_prompts (`list[str]`, *optional*): `P` negative prompts, or one for every prompt. Without them
                the unconditional embeddings are the pipeline's: zeros when ``force_zeros_for_empty_prompt`` (SDXL-base),
                else the encoded "".
            do_classifier_free_guidance (`bool`, defaults to True): also encode the negatives.
            num_images_per_prompt (`int`, defaults to 1): `n`; every row is repeated `n` times in place.

        Returns:
            `PromptEmbeds` with `prompt_embeds` `(P·n, L, D₁ + D₂)` (penultimate hidden states of both encoders,
            concatenated), `pooled_prompt_embeds` `(P·n, projection_dim)` (second encoder) and, with CFG, the negatives
            in the same layout; rows ``[p0]*n + [p1]*n + ...``.

        Raises:
            ValueError: if `prompts` is not a non-empty list of strings, `num_images_per_prompt < 1`, or
                `negative_prompts` has a length other than 1 or `P`.
        """
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        negatives = (expand_negative_prompts(prompts, negative_prompts)
                     if do_classifier_free_guidance and negative_prompts is not None else None)
        pe, npe, pooled, npooled = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=num_images_per_prompt,
            do_classifier_free_guidance=do_classifier_free_guidance, negative_prompt=negatives,
        )
        if not do_classifier_free_guidance:
            npe = npooled = None
        return PromptEmbeds(pe, npe, pooled, npooled)

    def add_time_ids(self, height: int, width: int) -> torch.Tensor:
        """The micro-conditioning of one `height` × `width` px image: float32 `(1, 6)`
        ``[*original_size, *crops_coords_top_left, *target_size]`` (the pipeline's `_get_add_time_ids` layout), with
        `original_size` and `target_size` defaulting to ``(height, width)``."""
        original = self.original_size or (height, width)
        target = self.target_size or (height, width)
        return torch.tensor([[*original, *self.crops_coords_top_left, *target]], dtype=torch.float32)

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool) -> torch.Tensor:
        """The UNet on `latents` (`(B, C, h, w)`, or ``2B`` rows when `guided`) with the token embeddings as
        cross-attention states and ``added_cond_kwargs`` = pooled embeddings (``text_embeds``) and ``time_ids``;
        integer timesteps (a scalar or `(B,)`)."""
        if prompt_embeds.pooled_prompt_embeds is None:
            raise ValueError("SDXL's UNet needs pooled_prompt_embeds (the second text encoder's); encode the prompts "
                             "with this policy's encode_prompts")
        if guided and isinstance(timesteps, torch.Tensor) and timesteps.ndim == 1:
            timesteps = torch.cat([timesteps, timesteps])
        if guided:
            states, pooled = cfg_batch(prompt_embeds), cfg_batch(prompt_embeds, pooled=True)
        else:
            states, pooled = prompt_embeds.prompt_embeds, prompt_embeds.pooled_prompt_embeds
        f = self.vae_scale_factor
        time_ids = self.add_time_ids(latents.shape[-2] * f, latents.shape[-1] * f)
        time_ids = time_ids.to(device=latents.device, dtype=self.dtype).repeat(latents.shape[0], 1)
        added = {"text_embeds": pooled.to(self.dtype), "time_ids": time_ids}
        return self.forward_module(latents, timesteps, encoder_hidden_states=states.to(self.dtype),
                                   added_cond_kwargs=added, return_dict=False)[0]


@dataclass
class StableDiffusionXLPolicyConfig:
    """Hydra config for `StableDiffusionXLPolicy.from_pretrained`; the fields mirror its arguments."""

    _target_: str = "diffalign.models.sdxl.StableDiffusionXLPolicy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    variant: str | None = None
    torch_dtype: str = "float32"
    local_files_only: bool | None = None
    pretrained_vae_model_name_or_path: str | None = None
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_SDXL_LORA_TARGET_MODULES))
    lora_seed: int = 0
    original_size: list[int] | None = None
    crops_coords_top_left: list[int] = field(default_factory=lambda: [0, 0])
    target_size: list[int] | None = None
    gradient_checkpointing: bool = False
