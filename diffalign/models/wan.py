"""Wan 2.1 text-to-video (`WanPipeline`: `WanTransformer3DModel`, rectified flow, velocity prediction) as a
`DiffusionPolicy`.

Latents are native, channels first then time (docs/methods/algorithms.md#latent-layouts):
`(B, 16, 1 + (F − 1)/4, H/8, W/8)` — the causal 3-D VAE (`AutoencoderKLWan`) compresses time by 4 (the first frame on
its own); latents are normalised per channel, ``(z − latents_mean) / latents_std``. Decoding returns pixels
`(B, F, 3, H, W)` in [0, 1] (frames first). The forward process is rectified flow
(`diffalign.models.pipeline_policy.RectifiedFlowMixin`), so the Flow-GRPO SDE, the DanceGRPO-style SDE and the
Euler/DPM-Solver ODEs of `diffalign.samplers` step it. LoRA sits on the self- and cross-attention of every block and
is saved with `WanPipeline.save_lora_weights`, which `WanPipeline.load_lora_weights` reads.

**Wan 2.2 (two experts).** A `WanPipeline` with `transformer_2` and a `boundary_ratio` (Wan2.2-T2V-A14B: 0.875)
denoises with two transformers of the same architecture: `transformer` (the high-noise expert) for timesteps
t ≥ boundary_ratio · 1000 and `transformer_2` (the low-noise expert) below, as `WanPipeline.__call__` chooses per
step. The policy's denoiser is then `WanExperts`, which routes each row of a batch to its expert by its own timestep
(rollout steps share one t; the forward-process methods draw t per row), and the low-noise rows take
`guidance_scale_2` when guided (WanPipeline's argument; default: the same scale). `lora_experts` says which experts
carry a LoRA: "both" (default), "high" or "low"; the other stays frozen. Files: ``pytorch_lora_weights.safetensors``
holds the first adapted expert's LoRA (the high-noise one unless `lora_experts="low"`), and with "both"
``pytorch_lora_weights_transformer_2.safetensors`` the low-noise one's, each with ``transformer.*`` keys — the layout
of published Wan 2.2 LoRA pairs: ``pipe.load_lora_weights(folder)`` then ``pipe.load_lora_weights(folder,
weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True)`` (a "low"-only file:
the first call with ``load_into_transformer_2=True``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import safetensors.torch
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from diffalign.models.base import add_trainable_lora, check_prompts, disable_dropout, expand_negative_prompts
from diffalign.models.pipeline_policy import (
    LORA_WEIGHT_NAME,
    PipelinePolicy,
    RectifiedFlowMixin,
    cfg_batch,
    check_lora_arguments,
    load_pipeline,
)
from diffalign.runtime.files import readable_by_umask
from diffalign.types import PromptEmbeds

DEFAULT_WAN_LORA_TARGET_MODULES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                                   "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
LORA_EXPERTS = ("both", "high", "low")
SECOND_EXPERT_WEIGHT_NAME = "pytorch_lora_weights_transformer_2.safetensors"
"""The file of the low-noise expert's LoRA when both experts carry one (``transformer.*`` keys)."""


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one denoiser module: `transformer` for timesteps t ≥ `boundary_timestep`,
    `transformer_2` below (`WanPipeline.__call__`'s rule), chosen per row, so a batch may mix both.

    The adapter switches the policy uses (`disable_adapters` / `enable_adapters`, `peft_config`) act on the experts
    that carry a LoRA; a second named adapter (the EMA, checkpoint and pool references) is not supported here.

    Args:
        transformer, transformer_2 (`WanTransformer3DModel`): the high- and the low-noise expert.
        boundary_timestep (`float`): boundary_ratio · num_train_timesteps (Wan2.2-T2V-A14B: 875).
    """

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module, boundary_timestep: float):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.transformer.config

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def _adapted(self) -> list[nn.Module]:
        return [m for m in (self.transformer, self.transformer_2) if getattr(m, "peft_config", None)]

    @property
    def peft_config(self) -> dict:
        """The LoRA config of the first adapted expert (both adapted experts have the same)."""
        adapted = self._adapted()
        return adapted[0].peft_config if adapted else {}

    def disable_adapters(self) -> None:
        for m in self._adapted():
            m.disable_adapters()

    def enable_adapters(self) -> None:
        for m in self._adapted():
            m.enable_adapters()

    def add_adapter(self, *args, **kwargs):
        raise ValueError("this reference strategy adds a second LoRA adapter, which diffalign does not support on "
                         "Wan 2.2's two experts; use reference=frozen_base (the adapters disabled)")

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False, **kwargs):
        """Each row through its expert (t ≥ boundary: `transformer`, else `transformer_2`); returns ``(output,)``."""
        high = timestep >= self.boundary_timestep
        if bool(high.all()) or bool((~high).all()):
            expert = self.transformer if bool(high.all()) else self.transformer_2
            return expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                          return_dict=False, **kwargs)
        out = None
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            part = expert(hidden_states=hidden_states[rows], timestep=timestep[rows],
                          encoder_hidden_states=encoder_hidden_states[rows], return_dict=False, **kwargs)[0]
            if out is None:
                out = part.new_empty((hidden_states.shape[0], *part.shape[1:]))
            out[rows] = part
        return (out,)


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
        lora_experts (`str`, defaults to "both"): Wan 2.2 only: which experts carry the LoRA, "both", "high"
            (`transformer`) or "low" (`transformer_2`).
        guidance_scale_2 (`float`, *optional*): Wan 2.2 only: the CFG scale of the low-noise expert's rows when
            guided (Wan2.2-T2V-A14B's defaults: 4.0 high, 3.0 low); `None`: the same scale.

    Raises:
        ValueError: for `lora_rank < 1`, empty targets, `num_frames` not 1 + 4k, an unknown `lora_experts`, or the
            Wan 2.2 settings on a one-transformer pipeline.
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    pipeline_class = WanPipeline
    denoiser_name = "transformer"
    denoiser_label = "a Wan transformer"

    def __init__(self, pipe: WanPipeline, *, num_frames: int = 9, height: int = 32, width: int = 32,
                 flow_shift: float | None = None, lora_rank: int | None = 4, lora_alpha: float | None = None,
                 lora_target_modules: Sequence[str] = DEFAULT_WAN_LORA_TARGET_MODULES, lora_seed: int = 0,
                 max_sequence_length: int = 512, lora_experts: str = "both", guidance_scale_2: float | None = None):
        super().__init__()
        check_lora_arguments(lora_rank, lora_target_modules, "transformer", ["attn1.to_q", "attn2.to_k"])
        if pipe.config.get("expand_timesteps"):
            raise ValueError("this WanPipeline has expand_timesteps=True (Wan2.2 TI2V-5B: per-token timesteps), which "
                             "WanPolicy does not reproduce; use a Wan 2.1 or Wan2.2-T2V-A14B pipeline")
        two = getattr(pipe, "transformer_2", None) is not None and pipe.config.get("boundary_ratio") is not None
        if lora_experts not in LORA_EXPERTS:
            raise ValueError(f"model.lora_experts={lora_experts!r} must be one of {LORA_EXPERTS} (which Wan 2.2 "
                             "experts carry a LoRA)")
        if not two and (lora_experts != "both" or guidance_scale_2 is not None):
            raise ValueError("model.lora_experts / model.guidance_scale_2 are for Wan 2.2's two experts; this "
                             "pipeline has one transformer (no transformer_2 and boundary_ratio): leave them unset")
        if guidance_scale_2 is not None and guidance_scale_2 < 1:
            raise ValueError(f"model.guidance_scale_2={guidance_scale_2} must be >= 1 (or null: the same scale).")
        tscale = pipe.vae_scale_factor_temporal
        if (num_frames - 1) % tscale:
            raise ValueError(f"`num_frames`={num_frames} must be 1 + {tscale}k for the Wan VAE.")
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.vae = pipe.vae.requires_grad_(False).eval()
        self.text_encoders = nn.ModuleList([pipe.text_encoder.requires_grad_(False).eval()])
        self.transformer = pipe.transformer.requires_grad_(False)
        self.experts = None
        if two:
            self.transformer_2 = pipe.transformer_2.requires_grad_(False)
            self.experts = WanExperts(self.transformer, self.transformer_2,
                                      pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps)
        self.lora_experts, self.guidance_scale_2 = lora_experts, guidance_scale_2
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

    # ------------------------------------------------------------------ Wan 2.2: two experts

    @property
    def denoiser(self) -> nn.Module:
        """The trained network: `transformer`, or for Wan 2.2 the `WanExperts` pair (which routes rows by timestep)."""
        return self.experts if self.experts is not None else self.transformer

    def train(self, mode: bool = True):
        """The denoiser (both experts for Wan 2.2) takes `mode`; VAE and text encoder stay in eval mode."""
        super().train(mode)
        if self.experts is not None:
            self.experts.train(mode)
        return self

    def _lora_experts(self) -> list[tuple[nn.Module, str]]:
        """(expert, LoRA file name) of every expert that carries the LoRA, in file order (see the module docstring)."""
        chosen = {"both": [self.transformer, self.transformer_2], "high": [self.transformer],
                  "low": [self.transformer_2]}[self.lora_experts]
        return list(zip(chosen, (LORA_WEIGHT_NAME, SECOND_EXPERT_WEIGHT_NAME)))

    def _init_lora(self, lora_rank, lora_alpha, lora_target_modules, lora_seed) -> None:
        """One expert: `PipelinePolicy._init_lora`. Two: the adapter (or the full fine-tune) on each expert of
        `lora_experts` (initialisation seeds `lora_seed`, `lora_seed + 1`); the other expert stays frozen."""
        if self.experts is None:
            return super()._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        disable_dropout(self.experts)  # (the frozen expert too: it runs in the denoiser's train mode)
        for i, (expert, _) in enumerate(self._lora_experts()):
            add_trainable_lora(expert, lora_rank, self.lora_alpha, lora_target_modules, lora_seed + i)

    def predict(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guidance_scale: float = 1.0,
                detach_unconditional: bool = False) -> torch.Tensor:
        """`PipelinePolicy.predict`; for Wan 2.2 with `guidance_scale_2` set and w > 1, the rows the low-noise expert
        handles are combined with `guidance_scale_2` instead of w (``WanPipeline(guidance_scale_2=...)``)."""
        if self.experts is None or self.guidance_scale_2 is None or guidance_scale <= 1:
            return super().predict(latents, timesteps, prompt_embeds, guidance_scale, detach_unconditional)
        if len(prompt_embeds) != latents.shape[0]:
            raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows but `latents` has batch "
                             f"{latents.shape[0]}; encode one row per sample (see `num_images_per_prompt`).")
        latents = latents.to(self.dtype)
        out = self._denoise(torch.cat([latents, latents]), timesteps, prompt_embeds, guided=True)
        uncond, cond = out.float().chunk(2)
        if detach_unconditional:
            uncond = uncond.detach()
        t = self._flow_timesteps(timesteps, latents, len(prompt_embeds), guided=False)
        w = torch.where(t >= self.experts.boundary_timestep, torch.tensor(float(guidance_scale)),
                        torch.tensor(float(self.guidance_scale_2))).to(uncond.device)
        return uncond + w.view(-1, *([1] * (latents.ndim - 1))) * (cond - uncond)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """One expert: `PipelinePolicy.lora_state_dict`. Two: each adapted expert's PEFT tensors under its name
        (``transformer.<module>.lora_A.weight``, ``transformer_2.…``), detached float32 copies."""
        if self.experts is None:
            return super().lora_state_dict()
        self._require_lora()
        names = {id(self.transformer): "transformer", id(self.transformer_2): "transformer_2"}
        return {f"{names[id(m)]}.{k}": v.detach().clone() for m, _ in self._lora_experts()
                for k, v in get_peft_model_state_dict(m).items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads `lora_state_dict`'s output into the adapters in place."""
        if self.experts is None:
            return super().load_lora_state_dict(state_dict)
        for name, m in (("transformer", self.transformer), ("transformer_2", self.transformer_2)):
            part = {k.removeprefix(f"{name}."): v for k, v in state_dict.items() if k.startswith(f"{name}.")}
            if part:
                set_peft_model_state_dict(m, part)

    def _require_lora(self) -> None:
        if self.lora_rank is None:
            raise ValueError("This policy fine-tunes the full Wan experts (lora_rank=None); save "
                             "`policy.transformer` / `policy.transformer_2` instead.")

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """One expert: `PipelinePolicy.save_lora_weights`. Two: one diffusers file per adapted expert (module
        docstring), each written by `WanPipeline.save_lora_weights` with ``transformer.*`` keys and its adapter
        config as metadata."""
        if self.experts is None:
            return super().save_lora_weights(directory)
        self._require_lora()
        for expert, name in self._lora_experts():
            WanPipeline.save_lora_weights(
                save_directory=directory, weight_name=name, safe_serialization=True,
                transformer_lora_layers={k: v.detach().clone() for k, v in get_peft_model_state_dict(expert).items()},
                transformer_lora_adapter_metadata=expert.peft_config["default"].to_dict())
            readable_by_umask(os.path.join(directory, name))

    def load_lora_weights(self, directory: str | os.PathLike) -> None:
        """Loads the file(s) `save_lora_weights` wrote into the adapter(s), in place.

        Raises:
            ValueError: for a missing or unreadable file, or keys or shapes that do not match an expert's adapter.
        """
        if self.experts is None:
            return super().load_lora_weights(directory)
        for expert, name in self._lora_experts():
            path = os.path.join(directory, name)
            if not os.path.isfile(path):
                raise ValueError(f"No {name} in {directory!r}; pass the folder `save_lora_weights` wrote with "
                                 f"model.lora_experts={self.lora_experts}.")
            try:
                state = safetensors.torch.load_file(path)
            except (safetensors.SafetensorError, OSError) as err:
                raise ValueError(f"{path!r} cannot be read ({err}); use another checkpoint folder") from None
            state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
            expected = get_peft_model_state_dict(expert)
            if set(state) != set(expected) or any(v.shape != expected[k].shape for k, v in state.items()):
                raise ValueError(f"LoRA weights in {path!r} do not match this policy's adapter; build the policy with "
                                 "the same lora_rank, lora_target_modules and lora_experts.")
            set_peft_model_state_dict(expert, state)

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
