"""Stable Diffusion 1.x / 2.x (UNet, ε- or v-prediction) as a `DiffusionPolicy` with a peft LoRA adapter.

Latents are `(B, 4, H/8, W/8)` for SD (the VAE factor is `vae_scale_factor`), already multiplied by
`vae.config.scaling_factor`. Text embeddings are `(B, 77, 768)` (SD1.x) or `(B, 77, 1024)` (SD2.x).

Other families get their own adapter file with the same members (`diffalign.models.base.DiffusionPolicy`):
SDXL adds pooled embeddings (`PromptEmbeds.pooled_prompt_embeds`, batched by `cfg_batch(..., pooled=True)` in the same
``[negative, positive]`` order) and micro-conditioning `time_ids` computed from the image size; flow models (SD3,
FLUX, Wan) predict a velocity on a continuous sigma; video models keep their native `(B, C, F, h, w)` latents.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import safetensors.torch
import torch
from diffusers import AutoencoderKL, DDIMScheduler, SchedulerMixin, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from omegaconf import MISSING
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import CLIPTextModel, PreTrainedTokenizerBase

from diffalign.models.base import ForwardModuleMixin, add_trainable_lora, check_prompts, expand_negative_prompts
from diffalign.text_context import TruncationWarner
from diffalign.types import PromptEmbeds

logger = logging.getLogger(__name__)

DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cfg_batch(prompt_embeds: PromptEmbeds, *, pooled: bool = False) -> torch.Tensor:
    """Builds the classifier-free-guidance conditioning batch, always in the order ``[negative, positive]``.

    This is the one place the order is decided (diffusers pipelines use the same order); rollouts and the
    training-time recomputation of log-probs both go through it (a OneTrainer
    sampler that ordered token and pooled embeddings differently mixed the conditioning:
    docs/field_cases.md#cfg-batch-order).

    Args:
        prompt_embeds (`PromptEmbeds`): `B` rows with negative embeddings.
        pooled (`bool`, defaults to False): batch the pooled embeddings `(B, D')` instead of the token embeddings.

    Returns:
        `torch.Tensor` `(2B, L, D)` (or `(2B, D')` if `pooled`): rows ``0..B-1`` negative, rows ``B..2B-1`` positive.

    Raises:
        ValueError: if the needed negative (or pooled) embeddings are `None`.
    """
    if pooled:
        positive, negative = prompt_embeds.pooled_prompt_embeds, prompt_embeds.negative_pooled_prompt_embeds
    else:
        positive, negative = prompt_embeds.prompt_embeds, prompt_embeds.negative_prompt_embeds
    if positive is None or negative is None:
        kind = "pooled " if pooled else ""
        raise ValueError(
            f"Classifier-free guidance needs both {kind}prompt and negative {kind}prompt embeddings; encode the prompts"
            " with `do_classifier_free_guidance=True` or use `guidance_scale=1.0`."
        )
    return torch.cat([negative, positive])


def _truthy_env(name: str) -> bool:
    """True if environment variable `name` is set to 1/ON/YES/TRUE (the `huggingface_hub` convention)."""
    return os.environ.get(name, "").upper() in {"1", "ON", "YES", "TRUE"}


def check_pipeline_folder(path: str, original: str, kind: str = "", example_hub_id: str | None = None) -> None:
    """Raises a clear `ValueError` (naming `model.pretrained_model_name_or_path`) when a local-looking path is not a
    diffusers pipeline folder, before anything is loaded; hub ids pass through.

    Args:
        path (`str`): the path with ``~`` expanded.
        original (`str`): the value as the user wrote it (quoted in the message).
        kind (`str`): the model family named in the message, e.g. "Stable Diffusion".
        example_hub_id (`str`, *optional*): a hub id quoted as an example.
    """
    looks_local = os.path.isabs(path) or path.startswith(".") or path.count("/") > 1 or "\\" in path
    if not (os.path.exists(path) or looks_local):
        return
    if not os.path.isdir(path):
        family = f"{kind} " if kind else ""
        example = f" such as {example_hub_id!r}" if example_hub_id else ""
        raise ValueError(
            f"Model folder {original!r} does not exist. Point `model.pretrained_model_name_or_path` at a diffusers"
            f" {family}folder (the one holding `model_index.json`) or at a hub id{example}."
        )
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        raise ValueError(
            f"{original!r} has no `model_index.json`, so it is not a diffusers pipeline folder. Point"
            " `model.pretrained_model_name_or_path` at the folder that holds `model_index.json`."
        )


class StableDiffusionPolicy(ForwardModuleMixin, nn.Module):
    """A Stable Diffusion 1.x/2.x model as a trainable policy: frozen base weights plus a LoRA adapter on the UNet.

    The VAE, text encoder and UNet base weights are frozen (`requires_grad=False`, VAE and text encoder in eval
    mode). With `lora_rank` set, a peft LoRA adapter named "default" is added to the UNet's attention projections and
    is the only trainable part; with `lora_rank=None` the whole UNet is trained. Trainable parameters are float32 even
    when the frozen parts are fp16/bf16 (docs/field_cases.md#trainable-parameters-left-in-half-precision). The
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

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    flow_matching = False  # rectified-flow velocity model (the flow SDEs apply) or not (DDIM)

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
        prediction_type = scheduler.config.prediction_type
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(
                f"scheduler.config.prediction_type={prediction_type!r} is not supported by StableDiffusionPolicy;"
                " use a checkpoint whose scheduler predicts 'epsilon' or 'v_prediction'."
            )
        if lora_rank is not None and lora_rank < 1:
            raise ValueError(f"`lora_rank` must be >= 1, or None for a full UNet fine-tune; got {lora_rank}.")
        if lora_rank is not None and len(lora_target_modules) == 0:
            raise ValueError("`lora_target_modules` is empty; list module names such as ['to_q', 'to_k', 'to_v'].")

        self.vae = vae.requires_grad_(False).eval()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.unet = unet.requires_grad_(False)
        self.tokenizer = tokenizer
        self._truncation = TruncationWarner("the text encoder", logger)  # reports each too-long prompt once
        self.scheduler = DDIMScheduler.from_config(scheduler.config)
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank

        add_trainable_lora(self.unet, lora_rank, self.lora_alpha, lora_target_modules, lora_seed)

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
        if torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"`torch_dtype` must be one of {sorted(TORCH_DTYPES)}, got {torch_dtype!r}.")
        path = os.path.expanduser(pretrained_model_name_or_path)
        check_pipeline_folder(path, pretrained_model_name_or_path, kind="Stable Diffusion",
                              example_hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5")
        if local_files_only is None:
            local_files_only = _truthy_env("HF_HUB_OFFLINE")
        pipe = StableDiffusionPipeline.from_pretrained(
            path,
            revision=revision,
            variant=variant,
            dtype=TORCH_DTYPES[torch_dtype],
            local_files_only=local_files_only,
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

    def train(self, mode: bool = True) -> StableDiffusionPolicy:
        """Sets the UNet's mode; the frozen VAE and text encoder always stay in eval mode."""
        super().train(mode)
        self.vae.eval()
        self.text_encoder.eval()
        return self

    # ------------------------------------------------------------------ properties

    @property
    def denoiser(self) -> nn.Module:
        """The bare trained network (the UNet); LoRA adapters are switched on it."""
        return self.unet

    @property
    def num_train_timesteps(self) -> int:
        """Length of the training noise schedule (1000 for SD)."""
        return self.scheduler.config.num_train_timesteps

    @property
    def prediction_type(self) -> str:
        """What `predict` returns: "epsilon" (ε̂) or "v_prediction" (v̂ = sqrt(ᾱ) ε − sqrt(1 − ᾱ) x0)."""
        return self.scheduler.config.prediction_type

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell, 2 ** (number of VAE blocks − 1) (8 for SD)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """`(C, h, w)` of the default latent, from `unet.config.in_channels` and `unet.config.sample_size`."""
        size = self.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return (self.unet.config.in_channels, h, w)

    @property
    def device(self) -> torch.device:
        """Device of the UNet."""
        return self.unet.conv_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the UNet's (frozen) base weights, the dtype its inputs are cast to."""
        return self.unet.conv_in.weight.dtype

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
            precomputed embeddings: docs/field_cases.md#several-images-per-prompt); `L` is
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

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor | int,
        prompt_embeds: PromptEmbeds,
        guidance_scale: float = 1.0,
        detach_unconditional: bool = False,
    ) -> torch.Tensor:
        """The UNet's prediction (ε̂ or v̂, see `prediction_type`), with classifier-free guidance when
        `guidance_scale > 1`.

        With guidance w > 1 the UNet runs once on the batch ``[negative, positive]`` (`cfg_batch`) and the result is
        ``uncond + w · (cond − uncond)`` (Ho & Salimans, arXiv:2207.12598, eq. 6), as in `StableDiffusionPipeline`.
        With w = 1 only the conditional batch runs and its output is returned unchanged. Inputs are cast to the UNet's
        dtype; gradients flow to the trainable parameters unless called under `torch.no_grad()`.

        Args:
            latents (`torch.Tensor`): `(B, C, h, w)` noisy latents x_t.
            timesteps (`torch.Tensor` or `int`): a scalar or `(B,)` integer timesteps in [0, num_train_timesteps).
            prompt_embeds (`PromptEmbeds`): `B` rows (with negatives when `guidance_scale > 1`).
            guidance_scale (`float`, defaults to 1.0): w ≥ 1.
            detach_unconditional (`bool`, defaults to False): with w > 1, stop gradients through the unconditional
                branch (Flow-GRPO/ViPO training forwards, docs/algorithms.md#classifier-free-guidance); the value is
                unchanged.

        Returns:
            `torch.Tensor` float32 `(B, C, h, w)`.

        Raises:
            ValueError: if `guidance_scale < 1`, the batch sizes differ, or negatives are missing for CFG.
        """
        if guidance_scale < 1:
            raise ValueError(f"`guidance_scale` must be >= 1 (1 disables guidance), got {guidance_scale}.")
        if len(prompt_embeds) != latents.shape[0]:
            raise ValueError(
                f"`prompt_embeds` has {len(prompt_embeds)} rows but `latents` has batch {latents.shape[0]}; encode one"
                " row per sample (see `num_images_per_prompt`)."
            )
        dtype = self.dtype
        if guidance_scale == 1.0:
            out = self.forward_module(
                latents.to(dtype),
                timesteps,
                encoder_hidden_states=prompt_embeds.prompt_embeds.to(dtype),
                return_dict=False,
            )[0]
            return out.float()
        if isinstance(timesteps, torch.Tensor) and timesteps.ndim == 1:
            timesteps = torch.cat([timesteps, timesteps])
        latents = latents.to(dtype)
        out = self.forward_module(
            torch.cat([latents, latents]),
            timesteps,
            encoder_hidden_states=cfg_batch(prompt_embeds).to(dtype),
            return_dict=False,
        )[0]
        uncond, cond = out.float().chunk(2)
        if detach_unconditional:
            uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)

    def forward(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor | int,
        prompt_embeds: PromptEmbeds,
        guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """Same as `predict` (so the policy can be wrapped by DDP)."""
        return self.predict(latents, timesteps, prompt_embeds, guidance_scale)

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | int) -> torch.Tensor:
        """x_t = sqrt(ᾱ_t) x_0 + sqrt(1 − ᾱ_t) ε (docs/algorithms.md#forward-processes), via `DDIMScheduler.add_noise`.

        Args:
            latents (`torch.Tensor`): `(B, C, h, w)` clean scaled latents x_0.
            noise (`torch.Tensor`): `(B, C, h, w)` ε.
            timesteps (`torch.Tensor` or `int`): a scalar or `(B,)` integer timesteps.

        Returns:
            `torch.Tensor` `(B, C, h, w)`, dtype of `latents`.
        """
        return self.scheduler.add_noise(latents, noise, torch.as_tensor(timesteps, device=latents.device))

    def training_target(
        self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | int
    ) -> torch.Tensor:
        """What `predict` should output for x_t = `add_noise(latents, noise, timesteps)`
        (docs/algorithms.md#denoising-loss).

        Returns ε for "epsilon" and v = sqrt(ᾱ_t) ε − sqrt(1 − ᾱ_t) x_0 (`DDIMScheduler.get_velocity`) for
        "v_prediction"; shape `(B, C, h, w)`.
        """
        if self.prediction_type == "epsilon":
            return noise
        return self.scheduler.get_velocity(latents, noise, torch.as_tensor(timesteps, device=latents.device))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents `(B, C, h, w)` → float32 images `(B, 3, h·f, w·f)` in [0, 1] (f = `vae_scale_factor`).

        Same arithmetic as `StableDiffusionPipeline` with `output_type="pt"`: decode ``latents / scaling_factor``, then
        ``(x · 0.5 + 0.5).clamp(0, 1)``. Differentiable (wrap in `torch.no_grad()` when not needed).
        """
        latents = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        images = self.vae.decode(latents, return_dict=False)[0]
        return (images * 0.5 + 0.5).clamp(0, 1).float()

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images `(B, 3, H, W)` in [0, 1] → float32 scaled latents `(B, C, H/f, W/f)`.

        Uses the mean of the VAE's latent distribution (its mode; deterministic, no sampling), times
        `vae.config.scaling_factor`, the convention of diffusers' Diffusion-DPO example for pre-encoded data.

        Raises:
            ValueError: if `images` is not `(B, 3, H, W)` or has values outside [0, 1].
        """
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"`images` must be (B, 3, H, W), got shape {tuple(images.shape)}.")
        if images.min() < 0 or images.max() > 1:
            raise ValueError("`images` must be in [0, 1]; convert uint8 images with `images.float() / 255`.")
        pixels = images.to(device=self.vae.device, dtype=self.vae.dtype) * 2 - 1
        latents = self.vae.encode(pixels).latent_dist.mean
        return (latents * self.vae.config.scaling_factor).float()

    # ------------------------------------------------------------------ training state

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters to optimise: the LoRA matrices, or every UNet parameter when `lora_rank is None`. All
        float32."""
        return [p for p in self.unet.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[StableDiffusionPolicy]:
        """Context under which the UNet runs with its LoRA adapter disabled: the frozen base model, i.e. the
        reference model of DPO-style objectives. The adapter is re-enabled on exit, also when the block raises.

        Raises:
            ValueError: for a full fine-tune (`lora_rank=None`), which has no frozen base inside the policy; use a
                frozen-copy reference strategy instead.
        """
        if self.lora_rank is None:
            raise ValueError(
                "`reference()` disables the LoRA adapter, but this policy fine-tunes the full UNet (lora_rank=None)"
                " and keeps no frozen base. Use a frozen-copy reference (a deep copy of the initial UNet), or set"
                " `lora_rank`."
            )
        self.unet.disable_adapters()
        try:
            yield self
        finally:
            self.unet.enable_adapters()

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter weights in diffusers format (keys like ``down_blocks.1....to_q.lora.down.weight``), detached
        float32 copies (safe to keep as a snapshot).

        An adapter with layers that the diffusers format does not name (convolutions, e.g. ``conv1``) keeps PEFT's
        names (``...conv1.lora_A.weight``, ``...to_q.lora_A.weight``) for every layer: `load_lora_weights` of a
        diffusers pipeline reads either format, but not a mix of the two (it would drop the attention layers).

        Raises:
            ValueError: if the policy has no LoRA adapter (`lora_rank=None`).
        """
        if self.lora_rank is None:
            raise ValueError("This policy fine-tunes the full UNet (lora_rank=None); save `policy.unet` instead.")
        peft_state_dict = get_peft_model_state_dict(self.unet)
        state_dict = convert_state_dict_to_diffusers(peft_state_dict)
        if any(".lora_A." in k or ".lora_B." in k for k in state_dict):  # partly unconverted: keep PEFT names
            state_dict = peft_state_dict
        return {k: v.detach().clone() for k, v in state_dict.items()}

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """Writes `directory/pytorch_lora_weights.safetensors` with `StableDiffusionPipeline.save_lora_weights`,
        including the adapter config (rank, alpha, targets) as metadata, so that
        ``StableDiffusionPipeline(...).load_lora_weights(directory)`` reproduces this policy's outputs."""
        StableDiffusionPipeline.save_lora_weights(
            save_directory=directory,
            unet_lora_layers=self.lora_state_dict(),
            safe_serialization=True,
            unet_lora_adapter_metadata=self.unet.peft_config["default"].to_dict(),
        )

    def load_lora_weights(self, directory: str | os.PathLike) -> None:
        """Loads `directory/pytorch_lora_weights.safetensors` (written by `save_lora_weights`) into this policy's
        adapter, in place; the parameters stay float32 and trainable (used on resume).

        Raises:
            ValueError: if the file is missing, or its keys or shapes do not match this policy's adapter.
        """
        path = os.path.join(directory, LORA_WEIGHT_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"No {LORA_WEIGHT_NAME} in {directory!r}; pass the folder `save_lora_weights` wrote.")
        try:
            state_dict = safetensors.torch.load_file(path)
        except (safetensors.SafetensorError, OSError) as err:  # a truncated or damaged file
            raise ValueError(f"{path!r} cannot be read ({err}); the file is truncated or damaged: use another "
                             "checkpoint folder") from None
        if not any(k.startswith("unet.") for k in state_dict):
            found = sorted({k.split(".", 1)[0] for k in state_dict})
            raise ValueError(f"{path!r} holds LoRA weights for {found} modules, not for a UNet (SD1.x/2.x) "
                             f"('unet.*' keys); it was saved from another model family: pass a LoRA folder of a "
                             "run with this model")
        state_dict = {k.removeprefix("unet."): v for k, v in state_dict.items() if k.startswith("unet.")}
        state_dict = convert_unet_state_dict_to_peft(state_dict)
        expected = get_peft_model_state_dict(self.unet)
        if set(state_dict) != set(expected):
            missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
            raise ValueError(
                f"LoRA weights in {path!r} do not match this policy's adapter (missing {missing[:3]}, unexpected"
                f" {unexpected[:3]}); build the policy with the same lora_rank and lora_target_modules."
            )
        for key, value in state_dict.items():
            if value.shape != expected[key].shape:
                raise ValueError(
                    f"LoRA weight {key!r} in {path!r} has shape {tuple(value.shape)}, the policy expects"
                    f" {tuple(expected[key].shape)}; build the policy with the same lora_rank."
                )
        set_peft_model_state_dict(self.unet, state_dict)


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
