"""Text-to-video policies: the UNet3D family (`TextToVideoSDPipeline`, ε/v-prediction) and the Wan family
(`WanPipeline`, rectified flow). Both implement `diffalign.models.base.DiffusionPolicy`, so the samplers
(`rollout` with DDIM-η or the Flow-GRPO SDE, `recompute_step`, the ODE solvers), the group rollouts and every
objective run on them unchanged: the steps reduce over every non-batch dim, and ``reduction="per_position"`` keeps
`(B, F, h, w)`.

Latent layouts (native, docs/algorithms.md#latent-layouts — channels first, then time):

- UNet3D (ModelScope T2V / Zeroscope format, `TextToVideoSDPipeline`): `(B, 4, F, H/8, W/8)` — one latent frame per
  video frame, each encoded by the image VAE (`AutoencoderKL`) on its own, scaled by `vae.config.scaling_factor`.
- Wan 2.1 (`WanPipeline`): `(B, 16, 1 + (F − 1)/4, H/8, W/8)` — the causal 3-D VAE (`AutoencoderKLWan`) compresses
  time by 4 (the first frame on its own); latents are normalised per channel, ``(z − latents_mean) / latents_std``.

Decoding returns pixels `(B, F, 3, H, W)` in [0, 1] (frames first) for both. LoRA sits on the attention projections
(spatial and temporal attention for UNet3D; self- and cross-attention of every Wan block) and is saved in the
diffusers format (`TextToVideoSDPipeline.save_lora_weights` / `WanPipeline.save_lora_weights`). diffusers'
`UNet3DConditionModel` has no LoRA loader of its own, so `TextToVideoPolicy` gives it peft adapter support
(`diffusers.loaders.PeftAdapterMixin`) at construction; `WanPipeline.load_lora_weights` reads the Wan files directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    TextToVideoSDPipeline,
    UNet3DConditionModel,
    WanPipeline,
)
from diffusers.loaders import PeftAdapterMixin
from omegaconf import MISSING
from torch import nn

from diffalign.models.base import add_trainable_lora, check_prompts, expand_negative_prompts
from diffalign.models.sd3 import FlowMatchingPolicy
from diffalign.models.stable_diffusion import (
    DEFAULT_LORA_TARGET_MODULES,
    TORCH_DTYPES,
    StableDiffusionPolicy,
    cfg_batch,
    check_pipeline_folder,
)
from diffalign.types import PromptEmbeds

DEFAULT_WAN_LORA_TARGET_MODULES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                   "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


class _UNet3DWithAdapters(UNet3DConditionModel, PeftAdapterMixin):
    """`UNet3DConditionModel` with diffusers' peft adapter methods (`add_adapter`, `disable_adapters`, ...)."""


_UNet3DWithAdapters.__name__ = "UNet3DConditionModel"  # configs saved from it keep the diffusers class name


class TextToVideoPolicy(StableDiffusionPolicy):
    """A `TextToVideoSDPipeline` model (UNet3D, ε or v) as a policy; latents `(B, 4, F, h, w)`.

    Args:
        vae, text_encoder, tokenizer, scheduler, lora_*: as `StableDiffusionPolicy`.
        unet (`UNet3DConditionModel`): the spatio-temporal denoiser.
        num_frames (`int`, defaults to 8): F, the frames of a rollout (the UNet3D takes any F).
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    def __init__(self, *, unet: UNet3DConditionModel, num_frames: int = 8, **kwargs):
        if num_frames < 1:
            raise ValueError(f"`num_frames` must be >= 1, got {num_frames}.")
        if not isinstance(unet, PeftAdapterMixin):
            unet.__class__ = _UNet3DWithAdapters
        self.num_frames = num_frames
        super().__init__(unet=unet, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, num_frames: int = 8, revision: str | None = None,
                        variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                        local_files_only: bool | None = None, lora_rank: int | None = 4,
                        lora_alpha: float | None = None,
                        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGET_MODULES,
                        lora_seed: int = 0) -> TextToVideoPolicy:
        """Loads a `TextToVideoSDPipeline` folder or hub id (e.g. ``ali-vilab/text-to-video-ms-1.7b``)."""
        path = os.fspath(pretrained_model_name_or_path)
        check_pipeline_folder(path, path)
        dtype = TORCH_DTYPES[torch_dtype] if isinstance(torch_dtype, str) else torch_dtype
        kwargs = {"local_files_only": local_files_only} if local_files_only is not None else {}
        pipe = TextToVideoSDPipeline.from_pretrained(path, revision=revision, variant=variant, torch_dtype=dtype,
                                                     **kwargs)
        return cls.from_video_pipeline(pipe, num_frames=num_frames, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                       lora_target_modules=lora_target_modules, lora_seed=lora_seed)

    @classmethod
    def from_video_pipeline(cls, pipe: TextToVideoSDPipeline, *, num_frames: int = 8, **lora) -> TextToVideoPolicy:
        """Wraps the components of a `TextToVideoSDPipeline` (shared, not copied)."""
        return cls(vae=pipe.vae, text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer, unet=pipe.unet,
                   scheduler=pipe.scheduler, num_frames=num_frames, **lora)

    def to_pipeline(self) -> TextToVideoSDPipeline:
        """A `TextToVideoSDPipeline` sharing this policy's modules (generates with the adapted weights)."""
        pipe = TextToVideoSDPipeline(vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                     unet=self.unet, scheduler=self.scheduler)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """`(C, F, h, w)`: `unet.config.in_channels`, `num_frames`, `unet.config.sample_size`."""
        size = self.unet.config.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return (self.unet.config.in_channels, self.num_frames, h, w)

    def decode(self, latents: torch.Tensor, frames_per_batch: int = 64) -> torch.Tensor:
        """Latents `(B, C, F, h, w)` → float32 videos `(B, F, 3, H, W)` in [0, 1], each frame decoded by the image
        VAE as `TextToVideoSDPipeline.decode_latents` does."""
        b, c, f, h, w = latents.shape
        flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        frames = torch.cat([StableDiffusionPolicy.decode(self, flat[s:s + frames_per_batch])
                            for s in range(0, len(flat), frames_per_batch)])
        return frames.reshape(b, f, *frames.shape[1:])

    def encode_images(self, videos: torch.Tensor) -> torch.Tensor:
        """Videos `(B, F, 3, H, W)` (or images `(B, 3, H, W)`, one frame) in [0, 1] → latents `(B, C, F, h, w)`."""
        if videos.ndim == 4:
            videos = videos[:, None]
        if videos.ndim != 5:
            raise ValueError(f"`videos` must be (B, F, 3, H, W), got shape {tuple(videos.shape)}.")
        b, f = videos.shape[:2]
        z = StableDiffusionPolicy.encode_images(self, videos.reshape(b * f, *videos.shape[2:]))
        return z.reshape(b, f, *z.shape[1:]).permute(0, 2, 1, 3, 4)

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """`TextToVideoSDPipeline.save_lora_weights` (``unet.*`` keys, adapter config as metadata)."""
        TextToVideoSDPipeline.save_lora_weights(
            save_directory=directory, unet_lora_layers=self.lora_state_dict(), safe_serialization=True,
            unet_lora_adapter_metadata=self.unet.peft_config["default"].to_dict())


class WanPolicy(FlowMatchingPolicy):
    """A `WanPipeline` model (rectified flow, velocity) as a policy; latents `(B, C, F_lat, h, w)`.

    The pipeline's scheduler (UniPC in the released checkpoints) is replaced for sampling by a
    `FlowMatchEulerDiscreteScheduler` with the same shift (`flow_shift`; Wan 2.1 480p: 3.0, ViPO trains with 8), so
    the Flow-GRPO SDE, the DanceGRPO-style SDE and the Euler/DPM-Solver ODEs of `diffalign.samplers` step it. The
    transformer is fed t = 1000 σ as in `WanPipeline`.

    Args:
        pipe (`WanPipeline`): the pipeline (components shared).
        num_frames (`int`, defaults to 9): pixel frames F (1 + 4k); F_lat = (F − 1)/4 + 1.
        height, width (`int`, *optional*): pixel size; defaults to 8× the transformer's… (Wan has no sample size:
            defaults 32×32 for the tiny world, 480×832 for Wan 2.1).
        flow_shift (`float`, *optional*): the schedule shift; defaults to the pipeline scheduler's `flow_shift`/`shift`.
        lora_*: as `FlowMatchingPolicy`; targets default to `DEFAULT_WAN_LORA_TARGET_MODULES`.
        max_sequence_length (`int`, defaults to 512): text tokens (Wan: 512).
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    def __init__(self, pipe: WanPipeline, *, num_frames: int = 9, height: int = 32, width: int = 32,
                 flow_shift: float | None = None, lora_rank: int | None = 4, lora_alpha: float | None = None,
                 lora_target_modules: Sequence[str] = DEFAULT_WAN_LORA_TARGET_MODULES, lora_seed: int = 0,
                 max_sequence_length: int = 512):
        nn.Module.__init__(self)
        if lora_rank is not None and lora_rank < 1:
            raise ValueError(f"`lora_rank` must be >= 1, or None for a full fine-tune; got {lora_rank}.")
        tscale = pipe.vae_scale_factor_temporal
        if (num_frames - 1) % tscale:
            raise ValueError(f"`num_frames`={num_frames} must be 1 + {tscale}k for the Wan VAE.")
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.vae = pipe.vae.requires_grad_(False).eval()
        self.text_encoders = nn.ModuleList([pipe.text_encoder.requires_grad_(False).eval()])
        self.transformer = pipe.transformer.requires_grad_(False)
        shift = flow_shift if flow_shift is not None else (pipe.scheduler.config.get("flow_shift")
                                                           or pipe.scheduler.config.get("shift") or 1.0)
        self.scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=float(shift))
        self.num_frames, self.height, self.width = num_frames, height, width
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        self.max_sequence_length = max_sequence_length
        add_trainable_lora(self.transformer, lora_rank, self.lora_alpha, lora_target_modules, lora_seed)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, revision: str | None = None,
                        variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                        local_files_only: bool | None = None, **kwargs) -> WanPolicy:
        """Loads a `WanPipeline` folder or hub id (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``)."""
        path = os.fspath(pretrained_model_name_or_path)
        check_pipeline_folder(path, path)
        dtype = TORCH_DTYPES[torch_dtype] if isinstance(torch_dtype, str) else torch_dtype
        extra = {"local_files_only": local_files_only} if local_files_only is not None else {}
        pipe = WanPipeline.from_pretrained(path, revision=revision, variant=variant, torch_dtype=dtype, **extra)
        return cls(pipe, **kwargs)

    def train(self, mode: bool = True) -> WanPolicy:
        nn.Module.train(self, mode)
        self.vae.eval()
        self.text_encoders.eval()
        return self

    @property
    def vae_scale_factor(self) -> int:
        return self.pipe.vae_scale_factor_spatial

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """`(C, F_lat, h, w)` = `(z_dim, (F − 1)/4 + 1, H/8, W/8)`."""
        f_lat = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        s = self.pipe.vae_scale_factor_spatial
        return (self.transformer.config.in_channels, f_lat, self.height // s, self.width // s)

    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.patch_embedding.weight.dtype

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompts: list[str] | None = None,
                       do_classifier_free_guidance: bool = True, num_images_per_prompt: int = 1) -> PromptEmbeds:
        """`WanPipeline.encode_prompt` (umT5, zero-padded to `max_sequence_length`); negatives default to ""."""
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        negatives = expand_negative_prompts(prompts, negative_prompts) if do_classifier_free_guidance else None
        pe, npe = self.pipe.encode_prompt(prompt=prompts, negative_prompt=negatives,
                                          do_classifier_free_guidance=do_classifier_free_guidance,
                                          num_videos_per_prompt=num_images_per_prompt,
                                          max_sequence_length=self.max_sequence_length, device=self.device)
        return PromptEmbeds(pe, npe if do_classifier_free_guidance else None)

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor | float, prompt_embeds: PromptEmbeds,
                guidance_scale: float = 1.0, detach_unconditional: bool = False) -> torch.Tensor:
        """The velocity v̂ `(B, C, F_lat, h, w)`, guided ``v_u + w (v_c − v_u)`` for w > 1 (one call on
        ``[negative, positive]``)."""
        if guidance_scale < 1:
            raise ValueError(f"`guidance_scale` must be >= 1 (1 disables guidance), got {guidance_scale}.")
        batch = latents.shape[0]
        if len(prompt_embeds) != batch:
            raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows but `latents` has batch {batch}.")
        dtype = self.dtype
        t = torch.as_tensor(timesteps, device=latents.device, dtype=torch.float32)
        t = t.expand(batch) if t.ndim == 0 else t
        if guidance_scale == 1.0:
            return self.forward_module(hidden_states=latents.to(dtype), timestep=t,
                                    encoder_hidden_states=prompt_embeds.prompt_embeds.to(dtype),
                                    return_dict=False)[0].float()
        latents = latents.to(dtype)
        out = self.forward_module(hidden_states=torch.cat([latents, latents]), timestep=torch.cat([t, t]),
                               encoder_hidden_states=cfg_batch(prompt_embeds).to(dtype), return_dict=False)[0]
        uncond, cond = out.float().chunk(2)
        if detach_unconditional:
            uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean, device=like.device, dtype=torch.float32).view(1, z, 1, 1, 1)
        std = torch.tensor(self.vae.config.latents_std, device=like.device, dtype=torch.float32).view(1, z, 1, 1, 1)
        return mean, std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents `(B, C, F_lat, h, w)` → videos `(B, F, 3, H, W)` in [0, 1] (``z · std + mean``, as `WanPipeline`)."""
        mean, std = self._stats(latents)
        z = (latents.float() * std + mean).to(self.vae.dtype)
        video = self.vae.decode(z, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return (video.float() * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    def encode_images(self, videos: torch.Tensor) -> torch.Tensor:
        """Videos `(B, F, 3, H, W)` in [0, 1] → normalised latents ``(mean_z − latents_mean) / latents_std``."""
        if videos.ndim != 5:
            raise ValueError(f"`videos` must be (B, F, 3, H, W), got shape {tuple(videos.shape)}.")
        pixels = (videos.permute(0, 2, 1, 3, 4) * 2 - 1).to(device=self.vae.device, dtype=self.vae.dtype)
        z = self.vae.encode(pixels).latent_dist.mean.float()
        mean, std = self._stats(z)
        return (z - mean) / std

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """`WanPipeline.save_lora_weights` (``transformer.*`` keys), loadable by ``WanPipeline.load_lora_weights``."""
        WanPipeline.save_lora_weights(
            save_directory=directory, transformer_lora_layers=self.lora_state_dict(), safe_serialization=True,
            transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict())

    @contextlib.contextmanager
    def reference(self) -> Iterator[WanPolicy]:
        with FlowMatchingPolicy.reference(self):
            yield self


@dataclass
class TextToVideoPolicyConfig:
    """Hydra config for `TextToVideoPolicy.from_pretrained`."""

    _target_: str = "diffalign.models.video.TextToVideoPolicy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    num_frames: int = 8
    torch_dtype: str = "float32"
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    lora_seed: int = 0
