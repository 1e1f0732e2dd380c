"""Text-to-video with a UNet3D (`TextToVideoSDPipeline`: the ModelScope T2V / Zeroscope format, ε or v-prediction) as
a `DiffusionPolicy`.

Latents are native, channels first then time (docs/methods/algorithms.md#latent-layouts): `(B, 4, F, H/8, W/8)`, one
latent frame per video frame, each encoded by the image VAE (`AutoencoderKL`) on its own and scaled by
`vae.config.scaling_factor`. Decoding returns pixels `(B, F, 3, H, W)` in [0, 1] (frames first). The samplers
(`rollout` with DDIM-η, `recompute_step`, the ODE solvers), the group rollouts and every objective run on it unchanged:
the steps reduce over every non-batch dim, and ``reduction="per_position"`` keeps `(B, F, h, w)`.

The text encoding, the UNet call and the ε/v forward process are Stable Diffusion's (the family derives from
`StableDiffusionPolicy`); LoRA sits on the spatial and temporal attention projections and is saved with
`TextToVideoSDPipeline.save_lora_weights`. diffusers' `UNet3DConditionModel` has no LoRA loader of its own, so the
policy gives it peft adapter support (`diffusers.loaders.PeftAdapterMixin`) at construction.

The denoiser may also be an AnimateDiff-style `UNetMotionModel` (an image UNet with motion modules: temporal
attentions with sinusoidal frame positions; the tiny world's `--arch motion` base, docs/methods/vipo.md). Its forward
takes the same `(B, C, F, h, w)` latents, but diffusers' `AnimateDiffPipeline` hands it one text state per *frame*
`(B·F, L, D)`, where `TextToVideoSDPipeline` and this policy pass one per *video* `(B, L, D)`; the policy therefore
gives it a forward that repeats per-video text states over the frames (`_UNetMotionWithVideoText`), so both pipelines'
calls work and the weights and saved config are unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from diffusers import TextToVideoSDPipeline, UNet3DConditionModel, UNetMotionModel
from diffusers.loaders import PeftAdapterMixin
from omegaconf import MISSING

from diffalign.models.pipeline_policy import PipelinePolicy, load_pipeline, load_vae_folder
from diffalign.models.stable_diffusion import DEFAULT_LORA_TARGET_MODULES, StableDiffusionPolicy


class _UNet3DWithAdapters(UNet3DConditionModel, PeftAdapterMixin):
    """`UNet3DConditionModel` with diffusers' peft adapter methods (`add_adapter`, `disable_adapters`, ...)."""


_UNet3DWithAdapters.__name__ = "UNet3DConditionModel"  # configs saved from it keep the diffusers class name


class _UNetMotionWithVideoText(UNetMotionModel):
    """`UNetMotionModel` that also takes one text state per video, like `UNet3DConditionModel`.

    `encoder_hidden_states` of shape `(B, L, D)` (one per video of `sample` `(B, C, F, h, w)`) is repeated over the F
    frames (`repeat_interleave`, video-major, the order in which `UNetMotionModel` folds frames into the batch) before
    diffusers' forward; `(B·F, L, D)` (`AnimateDiffPipeline`'s per-frame states) is passed through unchanged.

    Raises:
        ValueError: if `encoder_hidden_states` has neither B nor B·F rows.
    """

    def forward(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor, **kwargs):
        videos, frames = sample.shape[0], sample.shape[2]
        rows = encoder_hidden_states.shape[0]
        if rows == videos and frames > 1:
            encoder_hidden_states = encoder_hidden_states.repeat_interleave(frames, dim=0)
        elif rows != videos * frames:
            raise ValueError(f"`encoder_hidden_states` has {rows} rows for {videos} videos of {frames} frames; pass one "
                             f"per video ({videos}) or one per frame ({videos * frames}).")
        return super().forward(sample, timestep, encoder_hidden_states, **kwargs)


_UNetMotionWithVideoText.__name__ = "UNetMotionModel"


class TextToVideoPolicy(StableDiffusionPolicy):
    """A `TextToVideoSDPipeline` model (UNet3D, ε or v) as a policy; latents `(B, 4, F, h, w)`.

    Args:
        vae, text_encoder, tokenizer, scheduler, lora_*: as `StableDiffusionPolicy`.
        unet (`UNet3DConditionModel` or `UNetMotionModel`): the spatio-temporal denoiser (a `UNetMotionModel` is
            given a forward taking one text state per video, see the module docstring).
        num_frames (`int`, defaults to 8): F, the frames of a rollout (the UNet3D takes any F).
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    pipeline_class = TextToVideoSDPipeline
    denoiser_label = "a text-to-video UNet3D"

    def __init__(self, *, unet: UNet3DConditionModel | UNetMotionModel, num_frames: int = 8, **kwargs):
        if num_frames < 1:
            raise ValueError(f"`num_frames` must be >= 1, got {num_frames}.")
        if isinstance(unet, UNetMotionModel):
            if num_frames > unet.config.motion_max_seq_length:
                raise ValueError(f"`num_frames` {num_frames} exceeds the motion modules' frame positions "
                                 f"(motion_max_seq_length {unet.config.motion_max_seq_length}); sample at most that many.")
            unet.__class__ = _UNetMotionWithVideoText
        elif not isinstance(unet, PeftAdapterMixin):
            unet.__class__ = _UNet3DWithAdapters
        self.num_frames = num_frames
        super().__init__(unet=unet, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, num_frames: int = 8, revision: str | None = None,
                        variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                        local_files_only: bool | None = None, vae: str | os.PathLike | None = None,
                        lora_rank: int | None = 4, lora_alpha: float | None = None,
                        lora_target_modules: Sequence[str] = DEFAULT_LORA_TARGET_MODULES,
                        lora_seed: int = 0) -> TextToVideoPolicy:
        """Loads a `TextToVideoSDPipeline` folder or hub id (e.g. ``ali-vilab/text-to-video-ms-1.7b``); arguments as
        `StableDiffusionPolicy.from_pretrained`, plus `num_frames` and `vae`.

        Args:
            vae (`str`, *optional*): a local `AutoencoderKL` folder loaded instead of the pipeline's ``vae/``
                (`load_vae_folder`), e.g. for a pipeline folder saved without a VAE of its own that shares another
                model's (``${diffalign_asset:tiny_sd3/vae}``: the tiny world VAE).

        Raises:
            ValueError: for an unknown `torch_dtype`, a local path that is not a pipeline folder, or a `vae` that is
                not a VAE folder (before loading).
        """
        components = {} if vae is None else {"vae": load_vae_folder(vae, torch_dtype)}
        pipe = load_pipeline(TextToVideoSDPipeline, pretrained_model_name_or_path, revision=revision, variant=variant,
                             torch_dtype=torch_dtype, local_files_only=local_files_only, **components)
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
        channels, h, w = super().latent_shape
        return (channels, self.num_frames, h, w)

    def decode(self, latents: torch.Tensor, frames_per_batch: int = 64) -> torch.Tensor:
        """Latents `(B, C, F, h, w)` → float32 videos `(B, F, 3, H, W)` in [0, 1], each frame decoded by the image
        VAE as `TextToVideoSDPipeline.decode_latents` does."""
        b, c, f, h, w = latents.shape
        flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        frames = torch.cat([PipelinePolicy.decode(self, flat[s:s + frames_per_batch])
                            for s in range(0, len(flat), frames_per_batch)])
        return frames.reshape(b, f, *frames.shape[1:])

    def encode_images(self, videos: torch.Tensor) -> torch.Tensor:
        """Videos `(B, F, 3, H, W)` (or images `(B, 3, H, W)`, one frame) in [0, 1] → latents `(B, C, F, h, w)`.

        Raises:
            ValueError: for another shape, or values outside [0, 1].
        """
        if videos.ndim == 4:
            videos = videos[:, None]
        if videos.ndim != 5:
            raise ValueError(f"`videos` must be (B, F, 3, H, W), got shape {tuple(videos.shape)}.")
        b, f = videos.shape[:2]
        z = PipelinePolicy.encode_images(self, videos.reshape(b * f, *videos.shape[2:]))
        return z.reshape(b, f, *z.shape[1:]).permute(0, 2, 1, 3, 4)


@dataclass
class TextToVideoPolicyConfig:
    """Hydra config for `TextToVideoPolicy.from_pretrained`."""

    _target_: str = "diffalign.models.text_to_video.TextToVideoPolicy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    num_frames: int = 8
    torch_dtype: str = "float32"
    vae: str | None = None
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    lora_seed: int = 0
