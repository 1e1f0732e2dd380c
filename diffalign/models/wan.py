"""Wan 2.1 text-to-video (`WanPipeline`: `WanTransformer3DModel`, rectified flow, velocity prediction) as a
`DiffusionPolicy`.

Latents are native, channels first then time (docs/methods/algorithms.md#latent-layouts):
`(B, 16, 1 + (F − 1)/4, H/8, W/8)` — the causal 3-D VAE (`AutoencoderKLWan`) compresses time by 4 (the first frame on
its own); latents are normalised per channel, ``(z − latents_mean) / latents_std``. Decoding returns pixels
`(B, F, 3, H, W)` in [0, 1] (frames first). The forward process is rectified flow
(`diffalign.models.pipeline_policy.RectifiedFlowMixin`), so the Flow-GRPO SDE, the DanceGRPO-style SDE and the
Euler/DPM-Solver ODEs of `diffalign.samplers` step it. LoRA sits on the self- and cross-attention of every block and
is saved with `WanPipeline.save_lora_weights`, which `WanPipeline.load_lora_weights` reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
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

DEFAULT_WAN_LORA_TARGET_MODULES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                   "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


class WanPolicy(RectifiedFlowMixin, PipelinePolicy):
    """A `WanPipeline` model (rectified flow, velocity) as a policy; latents `(B, C, F_lat, h, w)`.

    The pipeline's scheduler (UniPC in the released checkpoints) is replaced for sampling by a
    `FlowMatchEulerDiscreteScheduler` with the same shift (`flow_shift`; Wan 2.1 480p: 3.0, ViPO trains with 8), so
    the flow samplers step it. The transformer is fed t = 1000 σ as in `WanPipeline`.

    Args:
        pipe (`WanPipeline`): the pipeline (components shared).
        num_frames (`int`, defaults to 9): pixel frames F (1 + 4k); F_lat = (F − 1)/4 + 1.
        height, width (`int`, defaults to 32): pixel size (Wan has no sample size: 32×32 for the tiny world, 480×832
            for Wan 2.1).
        flow_shift (`float`, *optional*): the schedule shift; defaults to the pipeline scheduler's `flow_shift`/`shift`.
        lora_rank, lora_alpha, lora_seed: as `StableDiffusion3Policy`.
        lora_target_modules (`Sequence[str]`, defaults to `DEFAULT_WAN_LORA_TARGET_MODULES`): module-name suffixes.
        max_sequence_length (`int`, defaults to 512): text tokens (Wan: 512).

    Raises:
        ValueError: for `lora_rank < 1`, empty targets, or `num_frames` not 1 + 4k.
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    pipeline_class = WanPipeline
    denoiser_name = "transformer"
    denoiser_label = "a Wan transformer"

    def __init__(self, pipe: WanPipeline, *, num_frames: int = 9, height: int = 32, width: int = 32,
                 flow_shift: float | None = None, lora_rank: int | None = 4, lora_alpha: float | None = None,
                 lora_target_modules: Sequence[str] = DEFAULT_WAN_LORA_TARGET_MODULES, lora_seed: int = 0,
                 max_sequence_length: int = 512):
        super().__init__()
        check_lora_arguments(lora_rank, lora_target_modules, "transformer", ["attn1.to_q", "attn2.to_k"])
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
        self.max_sequence_length = max_sequence_length
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, revision: str | None = None,
                        variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                        local_files_only: bool | None = None, **kwargs) -> WanPolicy:
        """Loads a `WanPipeline` folder or hub id (e.g. ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``); `kwargs` go to the
        constructor.

        Raises:
            ValueError: for an unknown `torch_dtype` or a local path that is not a pipeline folder (before loading).
        """
        pipe = load_pipeline(WanPipeline, pretrained_model_name_or_path, revision=revision, variant=variant,
                             torch_dtype=torch_dtype, local_files_only=local_files_only, kind="Wan",
                             example_hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
        return cls(pipe, **kwargs)

    def to_pipeline(self) -> WanPipeline:
        """The `WanPipeline` this policy wraps (modules shared; it keeps the pipeline's own scheduler)."""
        return self.pipe

    # ------------------------------------------------------------------ properties

    @property
    def _input_weight(self) -> torch.Tensor:
        return self.transformer.patch_embedding.weight

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell in space (8 for Wan 2.1)."""
        return self.pipe.vae_scale_factor_spatial

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """`(C, F_lat, h, w)` = `(z_dim, (F − 1)/4 + 1, H/8, W/8)`."""
        f_lat = (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1
        s = self.pipe.vae_scale_factor_spatial
        return (self.transformer.config.in_channels, f_lat, self.height // s, self.width // s)

    # ------------------------------------------------------------------ model calls

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompts: list[str] | None = None,
                       do_classifier_free_guidance: bool = True, num_images_per_prompt: int = 1) -> PromptEmbeds:
        """`WanPipeline.encode_prompt` (umT5, zero-padded to `max_sequence_length`); negatives default to "".

        Returns:
            `PromptEmbeds` with `prompt_embeds` `(P·n, max_sequence_length, D)` (and the negatives with CFG), rows
            ``[p0]*n + [p1]*n + ...``; no pooled embeddings.

        Raises:
            ValueError: as `diffalign.models.base.check_prompts`.
        """
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        negatives = expand_negative_prompts(prompts, negative_prompts) if do_classifier_free_guidance else None
        pe, npe = self.pipe.encode_prompt(prompt=prompts, negative_prompt=negatives,
                                          do_classifier_free_guidance=do_classifier_free_guidance,
                                          num_videos_per_prompt=num_images_per_prompt,
                                          max_sequence_length=self.max_sequence_length, device=self.device)
        return PromptEmbeds(pe, npe if do_classifier_free_guidance else None)

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool) -> torch.Tensor:
        """The transformer on `latents` (`(B, C, F_lat, h, w)`, or ``2B`` rows when `guided`); t = 1000 σ."""
        t = self._flow_timesteps(timesteps, latents, len(prompt_embeds), guided)
        states = cfg_batch(prompt_embeds) if guided else prompt_embeds.prompt_embeds
        return self.forward_module(hidden_states=latents, timestep=t, encoder_hidden_states=states.to(self.dtype),
                                   return_dict=False)[0]

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
        """Videos `(B, F, 3, H, W)` in [0, 1] → normalised latents ``(mean_z − latents_mean) / latents_std``.

        Raises:
            ValueError: for another shape.
        """
        if videos.ndim != 5:
            raise ValueError(f"`videos` must be (B, F, 3, H, W), got shape {tuple(videos.shape)}.")
        pixels = (videos.permute(0, 2, 1, 3, 4) * 2 - 1).to(device=self.vae.device, dtype=self.vae.dtype)
        z = self.vae.encode(pixels).latent_dist.mean.float()
        mean, std = self._stats(z)
        return (z - mean) / std
