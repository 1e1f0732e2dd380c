"""Stable Diffusion 3 / 3.5 format (MMDiT transformer, rectified flow, velocity prediction) as a `DiffusionPolicy`.

Latents are `(B, C, H/f, W/f)` (C = 16 for SD3, 4 for the tiny world's model; f = `vae_scale_factor`, 8 for SD3),
in the pipeline's normalised space ``(z − shift_factor) · scaling_factor``. The forward process is rectified flow
(docs/algorithms.md#forward-processes): x_σ = (1 − σ) x_0 + σ ε with σ ∈ [0, 1] (σ = 1 is pure noise), the model
predicts the velocity v̂ ≈ ε − x_0, and the transformer is fed the timestep ``1000 σ`` — the values
`FlowMatchEulerDiscreteScheduler.timesteps` holds, so a timestep t in this file always means σ = t / 1000. The
schedule's shift s (σ' = sσ / (1 + (s − 1)σ), the scheduler's `shift`, 3.0 for SD3) is applied by the scheduler when it
builds inference timesteps.

Text conditioning is `StableDiffusion3Pipeline.encode_prompt` itself (two CLIP encoders, the optional T5 encoder, the
zero T5 block of length `max_sequence_length` when T5 is absent), so embeddings match the pipeline's exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import safetensors.torch
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from diffusers.utils import convert_unet_state_dict_to_peft
from omegaconf import MISSING
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from diffalign.models.base import ForwardModuleMixin, add_trainable_lora, check_prompts, expand_negative_prompts
from diffalign.models.stable_diffusion import (
    LORA_WEIGHT_NAME,
    TORCH_DTYPES,
    _truthy_env,
    cfg_batch,
    check_pipeline_folder,
)
from diffalign.types import PromptEmbeds

# Flow-GRPO / DGPO adapt the joint-attention projections of both streams (docs/algorithms.md#flow-grpo,
# docs/algorithms.md#dgpo).
DEFAULT_SD3_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)


class FlowMatchingPolicy(ForwardModuleMixin, nn.Module):
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

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    flow_matching = True  # rectified-flow velocity model (the flow SDEs apply) or not (DDIM)

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
                f"FlowMatchingPolicy needs a FlowMatchEulerDiscreteScheduler, the pipeline has a"
                f" {type(pipe.scheduler).__name__}; load an SD3-format (rectified flow) checkpoint."
            )
        if lora_rank is not None and lora_rank < 1:
            raise ValueError(f"`lora_rank` must be >= 1, or None for a full fine-tune; got {lora_rank}.")
        if lora_rank is not None and len(lora_target_modules) == 0:
            raise ValueError("`lora_target_modules` is empty; list module names such as ['attn.to_q', 'attn.to_k'].")
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
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        self.max_sequence_length = max_sequence_length
        add_trainable_lora(self.transformer, lora_rank, self.lora_alpha, lora_target_modules, lora_seed)

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
    ) -> FlowMatchingPolicy:
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
        if torch_dtype not in TORCH_DTYPES:
            raise ValueError(f"`torch_dtype` must be one of {sorted(TORCH_DTYPES)}, got {torch_dtype!r}.")
        path = os.path.expanduser(pretrained_model_name_or_path)
        check_pipeline_folder(path, pretrained_model_name_or_path, kind="SD3-format",
                              example_hub_id="stabilityai/stable-diffusion-3.5-medium")
        if local_files_only is None:
            local_files_only = _truthy_env("HF_HUB_OFFLINE")
        no_t5 = not load_t5
        index = os.path.join(path, "model_index.json")
        if os.path.isfile(index):  # a folder saved without T5 (the tiny world's) lists it as [null, null]
            with open(index) as f:
                no_t5 = no_t5 or json.load(f).get("text_encoder_3", [None])[0] is None
        extra = {"text_encoder_3": None, "tokenizer_3": None} if no_t5 else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(
            path, revision=revision, variant=variant, dtype=TORCH_DTYPES[torch_dtype],
            local_files_only=local_files_only, **extra,
        )
        return cls(pipe, lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules,
                   lora_seed=lora_seed, max_sequence_length=max_sequence_length)

    def train(self, mode: bool = True) -> FlowMatchingPolicy:
        """Sets the transformer's mode; the VAE and text encoders always stay in eval mode."""
        super().train(mode)
        self.vae.eval()
        self.text_encoders.eval()
        return self

    # ------------------------------------------------------------------ properties

    @property
    def denoiser(self) -> nn.Module:
        """The bare trained network (the transformer); LoRA adapters are switched on it."""
        return self.transformer

    @property
    def prediction_type(self) -> str:
        """Always "flow": `predict` returns the velocity v̂ ≈ ε − x_0."""
        return "flow"

    @property
    def num_train_timesteps(self) -> int:
        """1000: the transformer is fed t = 1000 σ."""
        return self.scheduler.config.num_train_timesteps

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell, 2 ** (number of VAE blocks − 1)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """`(C, h, w)` from `transformer.config.in_channels` and `sample_size`."""
        size = self.transformer.config.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return (self.transformer.config.in_channels, h, w)

    @property
    def device(self) -> torch.device:
        return self.transformer.pos_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.pos_embed.proj.weight.dtype

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

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor | float,
        prompt_embeds: PromptEmbeds,
        guidance_scale: float = 1.0,
        detach_unconditional: bool = False,
    ) -> torch.Tensor:
        """The velocity v̂(x_σ, σ, c), guided as ``v_u + w (v_c − v_u)`` when `guidance_scale` w > 1 (one transformer
        call on ``[negative, positive]``, as `StableDiffusion3Pipeline.__call__`).

        Args:
            latents (`torch.Tensor`): `(B, C, h, w)` x_σ.
            timesteps (`torch.Tensor` or `float`): scalar or `(B,)` timesteps t = 1000 σ (floats allowed).
            prompt_embeds (`PromptEmbeds`): `B` rows with pooled embeddings (and negatives for CFG).
            guidance_scale (`float`, defaults to 1.0): w ≥ 1.
            detach_unconditional (`bool`, defaults to False): with w > 1, stop gradients through the unconditional
                branch (Flow-GRPO/ViPO training forwards, docs/algorithms.md#classifier-free-guidance); the value is
                unchanged.

        Returns:
            `torch.Tensor` float32 `(B, C, h, w)`.

        Raises:
            ValueError: if `guidance_scale < 1` or the batch sizes differ.
        """
        if guidance_scale < 1:
            raise ValueError(f"`guidance_scale` must be >= 1 (1 disables guidance), got {guidance_scale}.")
        batch = latents.shape[0]
        if len(prompt_embeds) != batch:
            raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows but `latents` has batch {batch}.")
        dtype = self.dtype
        t = torch.as_tensor(timesteps, device=latents.device, dtype=torch.float32)
        t = t.expand(batch) if t.ndim == 0 else t
        if guidance_scale == 1.0:
            out = self.forward_module(
                hidden_states=latents.to(dtype), timestep=t,
                encoder_hidden_states=prompt_embeds.prompt_embeds.to(dtype),
                pooled_projections=prompt_embeds.pooled_prompt_embeds.to(dtype), return_dict=False,
            )[0]
            return out.float()
        latents = latents.to(dtype)
        out = self.forward_module(
            hidden_states=torch.cat([latents, latents]), timestep=torch.cat([t, t]),
            encoder_hidden_states=cfg_batch(prompt_embeds).to(dtype),
            pooled_projections=cfg_batch(prompt_embeds, pooled=True).to(dtype), return_dict=False,
        )[0]
        uncond, cond = out.float().chunk(2)
        if detach_unconditional:
            uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)

    def forward(self, latents, timesteps, prompt_embeds, guidance_scale: float = 1.0) -> torch.Tensor:
        """Same as `predict`."""
        return self.predict(latents, timesteps, prompt_embeds, guidance_scale)

    def sigmas_of(self, timesteps: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
        """σ = t / 1000 broadcast to `like`'s shape `(B, 1, 1, 1)`, float32."""
        sigma = torch.as_tensor(timesteps, device=like.device, dtype=torch.float32) / self.num_train_timesteps
        sigma = sigma.reshape(-1) if sigma.ndim else sigma.expand(like.shape[0])
        return sigma.reshape(-1, *([1] * (like.ndim - 1)))

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | float) -> torch.Tensor:
        """x_σ = (1 − σ) x_0 + σ ε with σ = t / 1000 (docs/algorithms.md#forward-processes;
        `FlowMatchEulerDiscreteScheduler.scale_noise`).

        Args: `latents` x_0 and `noise` ε `(B, C, h, w)`; `timesteps` scalar or `(B,)` in [0, 1000].
        Returns: `(B, C, h, w)` float32.
        """
        sigma = self.sigmas_of(timesteps, latents)
        return (1 - sigma) * latents.float() + sigma * noise.float()

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps=None) -> torch.Tensor:
        """The velocity target u = ε − x_0 (docs/algorithms.md#denoising-loss), independent of σ; `(B, C, h, w)`."""
        return noise.float() - latents.float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `(B, C, h, w)` → float32 images `(B, 3, h·f, w·f)` in [0, 1]: decode
        ``latents / scaling_factor + shift_factor`` as `StableDiffusion3Pipeline` does."""
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        images = self.vae.decode(z, return_dict=False)[0]
        return (images * 0.5 + 0.5).clamp(0, 1).float()

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images `(B, 3, H, W)` in [0, 1] → float32 latents ``(mean − shift_factor) · scaling_factor``.

        Raises:
            ValueError: if `images` is not `(B, 3, H, W)` in [0, 1].
        """
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"`images` must be (B, 3, H, W), got shape {tuple(images.shape)}.")
        if images.min() < 0 or images.max() > 1:
            raise ValueError("`images` must be in [0, 1]; convert uint8 images with `images.float() / 255`.")
        pixels = images.to(device=self.vae.device, dtype=self.vae.dtype) * 2 - 1
        z = self.vae.encode(pixels).latent_dist.mean
        return ((z - self.vae.config.shift_factor) * self.vae.config.scaling_factor).float()

    # ------------------------------------------------------------------ training state

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The LoRA matrices (or every transformer parameter with `lora_rank=None`), all float32."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[FlowMatchingPolicy]:
        """The frozen base model: the transformer with its adapter disabled, re-enabled on exit.

        Raises:
            ValueError: for a full fine-tune (`lora_rank=None`), which keeps no frozen base.
        """
        if self.lora_rank is None:
            raise ValueError("`reference()` disables the LoRA adapter, but this policy fine-tunes the full transformer"
                             " (lora_rank=None); set `lora_rank` or use a frozen-copy reference.")
        self.transformer.disable_adapters()
        try:
            yield self
        finally:
            self.transformer.enable_adapters()

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """Adapter weights (peft keys, ``lora_A``/``lora_B``) as detached float32 copies.

        Raises:
            ValueError: if the policy has no adapter.
        """
        if self.lora_rank is None:
            raise ValueError("This policy fine-tunes the full transformer (lora_rank=None); save `policy.transformer`.")
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.transformer).items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads weights from `lora_state_dict` in place."""
        set_peft_model_state_dict(self.transformer, state_dict)

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """Writes `directory/pytorch_lora_weights.safetensors` with `StableDiffusion3Pipeline.save_lora_weights`
        (adapter config as metadata), loadable by ``StableDiffusion3Pipeline.load_lora_weights(directory)``."""
        StableDiffusion3Pipeline.save_lora_weights(
            save_directory=directory, transformer_lora_layers=self.lora_state_dict(), safe_serialization=True,
            transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict(),
        )

    def load_lora_weights(self, directory: str | os.PathLike) -> None:
        """Loads a folder written by `save_lora_weights` into the adapter, in place (used on resume).

        Raises:
            ValueError: if the file is missing or its keys/shapes do not match this policy's adapter.
        """
        path = os.path.join(directory, LORA_WEIGHT_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"No {LORA_WEIGHT_NAME} in {directory!r}; pass the folder `save_lora_weights` wrote.")
        try:
            state_dict = safetensors.torch.load_file(path)
        except (safetensors.SafetensorError, OSError) as err:  # a truncated or damaged file
            raise ValueError(f"{path!r} cannot be read ({err}); the file is truncated or damaged: use another "
                             "checkpoint folder") from None
        if not any(k.startswith("transformer.") for k in state_dict):
            found = sorted({k.split(".", 1)[0] for k in state_dict})
            raise ValueError(f"{path!r} holds LoRA weights for {found} modules, not for an SD3-format transformer "
                             f"('transformer.*' keys); it was saved from another model family: pass a LoRA folder of a "
                             "run with this model")
        state_dict = {k.removeprefix("transformer."): v for k, v in state_dict.items() if k.startswith("transformer.")}
        state_dict = convert_unet_state_dict_to_peft(state_dict)
        expected = get_peft_model_state_dict(self.transformer)
        if set(state_dict) != set(expected) or any(v.shape != expected[k].shape for k, v in state_dict.items()):
            missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
            raise ValueError(f"LoRA weights in {path!r} do not match this policy's adapter (missing {missing[:3]},"
                             f" unexpected {unexpected[:3]}, or other shapes); build the policy with the same"
                             " lora_rank and lora_target_modules.")
        set_peft_model_state_dict(self.transformer, state_dict)


@dataclass
class FlowMatchingPolicyConfig:
    """Hydra config for `FlowMatchingPolicy.from_pretrained`; the fields mirror its arguments."""

    _target_: str = "diffalign.models.sd3.FlowMatchingPolicy.from_pretrained"
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
