"""FLUX.1 (`FluxPipeline`: `FluxTransformer2DModel`, rectified flow, velocity prediction) as a `DiffusionPolicy`.

What differs from SD3 (`diffalign.models.sd3`), all handled inside the policy:

- **Latent layout.** The transformer reads *packed* latents: 2×2 patches of the 16-channel VAE latent as tokens,
  `(B, (h/2)(w/2), 64)`. The policy's latents are the *unpacked* VAE grid `(B, 16, H/8, W/8)` (`latent_shape`), the
  layout `FluxPipeline.prepare_latents` draws its noise in (so the same generators give the same initial noise), and
  the layout the rest of diffalign uses (per-position log-probs and ViPO's maps live on the `(H/8, W/8)` grid, DDSPO's
  and DPO's losses average over elements either way). `predict` packs on the way in and unpacks on the way out with
  `FluxPipeline._pack_latents` / ``_unpack_latents``; the flow steps act element-wise, so stepping in either layout is
  the same arithmetic. Latents are normalised ``(z − shift_factor) · scaling_factor`` as in `FluxPipeline`.
- **Guidance.** FLUX.1-dev is guidance-distilled (``transformer.config.guidance_embeds``): the guidance scale is an
  input of the transformer, there is no classifier-free-guidance batch and no negative prompt. `predict`'s
  `guidance_scale` then goes to that input (``FluxPipeline(guidance_scale=...)``), or, when the policy is built with
  `guidance`, that fixed value does and `guidance_scale` must be 1 (CFG-free methods such as DiffusionNFT keep the
  model's embedded guidance). A model without the embedding (FLUX.1-schnell, de-distilled variants) gets true CFG
  ``uncond + w (cond − uncond)`` with the negative prompt, as ``FluxPipeline(true_cfg_scale=w, negative_prompt="")``.
- **Text.** CLIP-L's pooled embedding (`pooled_prompt_embeds` `(B, 768)`) plus T5-XXL's token states
  (`prompt_embeds` `(B, max_sequence_length, 4096)`), from `FluxPipeline.encode_prompt` itself; the text position ids
  (zeros) and the image position ids are rebuilt in `predict` from the shapes.
- **Timesteps.** The transformer is fed σ = t / 1000 (the pipeline divides by 1000); a timestep t in this file is
  1000 σ as everywhere in diffalign.
- **Schedule.** `FluxPipeline` samples on σ_k = linspace(1, 1/K, K) shifted by the resolution-dependent
  ``exp(μ) / (exp(μ) + 1/σ − 1)`` with μ = `calculate_shift` of the packed token count (the scheduler's base/max
  shift, 0.5 / 1.15 for 256 / 4096 tokens). The policy's scheduler, `FluxFlowMatchScheduler`, does exactly that in
  ``set_timesteps(K)``, so diffalign's samplers step on FluxPipeline's sigmas; ``flow_shift`` replaces μ by a fixed
  shift s (σ' = sσ / (1 + (s − 1)σ); DanceGRPO's and ViPO's FLUX scripts use s = 3).

LoRA sits on the attention projections of the double- and single-stream blocks and is saved with
`FluxPipeline.save_lora_weights`, which `FluxPipeline.load_lora_weights` reads; `flux_kohya_state_dict` writes the
kohya / ComfyUI names (``lora_unet_double_blocks_<i>_img_attn_qkv`` ...), whose map is diffusers' own
(`diffusers.loaders.lora_conversion_utils._convert_kohya_flux_lora_to_diffusers`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.configuration_utils import register_to_config
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from omegaconf import MISSING
from torch import nn

from diffalign.models.base import check_prompts, expand_negative_prompts
from diffalign.models.pipeline_policy import (
    PipelinePolicy,
    RectifiedFlowMixin,
    cfg_batch,
    check_lora_arguments,
    load_pipeline,
    load_vae_folder,
)
from diffalign.types import PromptEmbeds

# The attention projections of both streams (the double blocks' image and text projections; the single blocks'
# to_q/to_k/to_v match the same suffixes), as Flow-GRPO's FLUX LoRA (docs/guides/flux.md#lora-files).
DEFAULT_FLUX_LORA_TARGET_MODULES = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
)


class FluxFlowMatchScheduler(FlowMatchEulerDiscreteScheduler):
    """`FlowMatchEulerDiscreteScheduler` whose ``set_timesteps(K)`` gives `FluxPipeline`'s schedule without arguments.

    FluxPipeline calls ``set_timesteps(sigmas=np.linspace(1, 1/K, K), mu=calculate_shift(image_seq_len, ...))``;
    diffalign's samplers call ``set_timesteps(K)``. This subclass fills in the same `sigmas` and `mu` when they are not
    passed, with the packed token count of the policy's resolution stored in the config (``image_seq_len``), so copies
    made with ``from_config`` keep it. With ``use_dynamic_shifting=False`` the fixed `shift` applies instead of μ.

    Args:
        image_seq_len (`int`, defaults to 256): packed latent tokens (H/16)(W/16), e.g. 4096 at 1024², 1024 at 512².
        other arguments: those of `FlowMatchEulerDiscreteScheduler`.
    """

    @register_to_config
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 1.0, use_dynamic_shifting: bool = False,
                 base_shift: float | None = 0.5, max_shift: float | None = 1.15, base_image_seq_len: int = 256,
                 max_image_seq_len: int = 4096, invert_sigmas: bool = False, shift_terminal: float | None = None,
                 use_karras_sigmas: bool = False, use_exponential_sigmas: bool = False,
                 use_beta_sigmas: bool = False, time_shift_type: str = "exponential",
                 stochastic_sampling: bool = False, image_seq_len: int = 256):
        super().__init__(num_train_timesteps=num_train_timesteps, shift=shift,
                         use_dynamic_shifting=use_dynamic_shifting, base_shift=base_shift, max_shift=max_shift,
                         base_image_seq_len=base_image_seq_len, max_image_seq_len=max_image_seq_len,
                         invert_sigmas=invert_sigmas, shift_terminal=shift_terminal,
                         use_karras_sigmas=use_karras_sigmas, use_exponential_sigmas=use_exponential_sigmas,
                         use_beta_sigmas=use_beta_sigmas, time_shift_type=time_shift_type,
                         stochastic_sampling=stochastic_sampling)

    @property
    def mu(self) -> float:
        """μ = `calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift, max_shift)`, the
        line through (256, 0.5) and (4096, 1.15) for FLUX.1 (FluxPipeline's step 5)."""
        c = self.config
        return calculate_shift(c.image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)

    @property
    def effective_shift(self) -> float:
        """The shift s of σ' = sσ / (1 + (s − 1)σ) this schedule applies: exp(μ) with dynamic shifting (the
        exponential time shift exp(μ) / (exp(μ) + 1/σ − 1) is that map), else the config's `shift`. Solvers that
        take one shift (`diffalign.samplers.ode`'s flow DPM-Solver) use it."""
        return math.exp(self.mu) if self.config.use_dynamic_shifting else float(self.config.shift)

    def set_timesteps(self, num_inference_steps: int | None = None, device=None, sigmas=None, mu: float | None = None,
                      timesteps=None):
        """`FlowMatchEulerDiscreteScheduler.set_timesteps` with FluxPipeline's defaults: ``sigmas = linspace(1, 1/K,
        K)`` when neither `sigmas` nor `timesteps` is given, and ``mu = self.mu``."""
        if sigmas is None and timesteps is None and num_inference_steps is not None:
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        if mu is None:
            mu = self.mu
        super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)


class FluxPolicy(RectifiedFlowMixin, PipelinePolicy):
    """A `FluxPipeline` model (FLUX.1-dev/-schnell format) as a policy; latents unpacked `(B, 16, H/8, W/8)`.

    Args:
        pipe (`FluxPipeline`): supplies the VAE, CLIP-L and T5 encoders/tokenizers and the transformer (shared).
        height, width (`int`, *optional*): image size in pixels, multiples of 2 × the VAE factor (16 for FLUX.1);
            default ``pipe.default_sample_size · vae_scale_factor`` (1024 for FLUX.1).
        flow_shift (`float`, *optional*): a fixed schedule shift s instead of FluxPipeline's resolution-dependent
            μ (DanceGRPO/ViPO: 3.0); `None` keeps the pipeline's.
        guidance (`float`, *optional*): for a guidance-distilled transformer, a fixed embedded guidance value; then
            `predict` takes `guidance_scale` 1 only (for CFG-free methods). `None`: `guidance_scale` is the embedded
            guidance. Refused for a transformer without the embedding.
        lora_rank, lora_alpha, lora_seed: as `diffalign.models.sd3.StableDiffusion3Policy`.
        lora_target_modules (`Sequence[str]`, defaults to `DEFAULT_FLUX_LORA_TARGET_MODULES`): module-name suffixes.
        max_sequence_length (`int`, defaults to 512): T5 tokens (FLUX.1-dev: 512, schnell: 256).

    Raises:
        TypeError: for a scheduler that is not a `FlowMatchEulerDiscreteScheduler`.
        ValueError: for `lora_rank < 1`, empty targets, a size that is not a multiple of 2 × the VAE factor, a
            non-positive `flow_shift` or `guidance`, `guidance` without a guidance embedding, or a VAE without
            `shift_factor`.
    """

    pipeline_class = FluxPipeline
    denoiser_name = "transformer"
    denoiser_label = "a FLUX transformer"
    latent_shift = True

    def __init__(self, pipe: FluxPipeline, *, height: int | None = None, width: int | None = None,
                 flow_shift: float | None = None, guidance: float | None = None, lora_rank: int | None = 4,
                 lora_alpha: float | None = None,
                 lora_target_modules: Sequence[str] = DEFAULT_FLUX_LORA_TARGET_MODULES, lora_seed: int = 0,
                 max_sequence_length: int = 512):
        super().__init__()
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise TypeError(f"FluxPolicy needs a FlowMatchEulerDiscreteScheduler, the pipeline has a "
                            f"{type(pipe.scheduler).__name__}; load a FLUX.1-format checkpoint.")
        check_lora_arguments(lora_rank, lora_target_modules, "transformer", ["attn.to_q", "attn.add_k_proj"])
        cell = 2 * pipe.vae_scale_factor  # one packed token covers 2x2 latent cells
        height = height if height is not None else pipe.default_sample_size * pipe.vae_scale_factor
        width = width if width is not None else pipe.default_sample_size * pipe.vae_scale_factor
        if height % cell or width % cell or height < cell or width < cell:
            raise ValueError(f"model.height={height} / model.width={width} must be positive multiples of {cell} (2 x "
                             f"the VAE factor {pipe.vae_scale_factor}: FLUX packs 2x2 latent cells into one token).")
        if flow_shift is not None and flow_shift <= 0:
            raise ValueError(f"model.flow_shift={flow_shift} must be > 0 (or null for FluxPipeline's "
                             "resolution-dependent shift).")
        distilled = bool(pipe.transformer.config.guidance_embeds)
        if guidance is not None and (not distilled or guidance <= 0):
            raise ValueError(f"model.guidance={guidance} needs a guidance-distilled transformer (guidance_embeds) "
                             "and a value > 0; set model.guidance=null" + ("" if distilled else
                                                                           " (this transformer has no guidance input)"))
        if pipe.vae.config.shift_factor is None:
            raise ValueError("The VAE config has no `shift_factor`; FLUX pipelines need one (0.0 for none).")
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.vae = pipe.vae.requires_grad_(False).eval()
        self.text_encoders = nn.ModuleList([m.requires_grad_(False).eval() for m in (pipe.text_encoder,
                                                                                     pipe.text_encoder_2)])
        self.transformer = pipe.transformer.requires_grad_(False)
        self.height, self.width = height, width
        self.guidance_distilled, self.guidance = distilled, guidance
        self.max_sequence_length = max_sequence_length
        config = dict(pipe.scheduler.config, image_seq_len=(height // cell) * (width // cell))
        if flow_shift is not None:
            config.update(use_dynamic_shifting=False, shift=float(flow_shift))
        if config.get("use_dynamic_shifting") and config.get("time_shift_type", "exponential") != "exponential":
            raise ValueError("FluxPolicy reproduces FluxPipeline's exponential time shift; the scheduler has "
                             f"time_shift_type={config['time_shift_type']!r}. Set model.flow_shift instead.")
        self.scheduler = FluxFlowMatchScheduler.from_config(config)
        self._init_lora(lora_rank, lora_alpha, lora_target_modules, lora_seed)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, *, revision: str | None = None,
                        variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                        local_files_only: bool | None = None, vae: str | os.PathLike | None = None,
                        **kwargs) -> FluxPolicy:
        """Loads a `FluxPipeline` folder or hub id (e.g. "black-forest-labs/FLUX.1-dev", gated: accept the licence
        on the hub and log in first); `kwargs` go to the constructor.

        Args:
            vae (`str`, *optional*): a local `AutoencoderKL` folder (with `config.json`) loaded, in `torch_dtype`,
                instead of the pipeline's ``vae/`` — as ``FluxPipeline.from_pretrained(path, vae=AutoencoderKL
                .from_pretrained(vae))``. The shipped tiny FLUX (`model=tiny_flux`) has no VAE of its own and uses
                tiny_sd3's (``${diffalign_asset:tiny_sd3/vae}``).

        Raises:
            ValueError: for an unknown `torch_dtype`, a local path that is not a pipeline folder, or a `vae` that is
                not a VAE folder (before loading).
        """
        components = {} if vae is None else {"vae": load_vae_folder(vae, torch_dtype)}
        pipe = load_pipeline(FluxPipeline, pretrained_model_name_or_path, revision=revision, variant=variant,
                             torch_dtype=torch_dtype, local_files_only=local_files_only, kind="FLUX",
                             example_hub_id="black-forest-labs/FLUX.1-dev", **components)
        return cls(pipe, **kwargs)

    def to_pipeline(self) -> FluxPipeline:
        """The `FluxPipeline` this policy wraps (modules shared; it keeps the pipeline's own scheduler and takes
        ``height``/``width``/``guidance_scale`` per call)."""
        return self.pipe

    # ------------------------------------------------------------------ properties

    @property
    def _input_weight(self) -> torch.Tensor:
        return self.transformer.x_embedder.weight

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per (unpacked) latent cell: 8 for FLUX.1 (the pipeline's ``vae_scale_factor``)."""
        return self.pipe.vae_scale_factor

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """`(C, H/f, W/f)`, unpacked: C = ``in_channels / 4`` (16 for FLUX.1), f = `vae_scale_factor`."""
        f = self.vae_scale_factor
        return (self.transformer.config.in_channels // 4, self.height // f, self.width // f)

    # ------------------------------------------------------------------ model calls

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompts: list[str] | None = None,
                       do_classifier_free_guidance: bool = True, num_images_per_prompt: int = 1) -> PromptEmbeds:
        """`FluxPipeline.encode_prompt` (frozen encoders, no gradients): CLIP-L pooled plus T5 token states.

        A guidance-distilled model never uses negatives, so `do_classifier_free_guidance` only matters without the
        guidance embedding.

        Returns:
            `PromptEmbeds` with `prompt_embeds` `(P·n, max_sequence_length, joint_attention_dim)`,
            `pooled_prompt_embeds` `(P·n, pooled_projection_dim)` and, with true CFG, the negatives (default "") in the
            same layout; rows ``[p0]*n + [p1]*n + ...``.

        Raises:
            ValueError: as `diffalign.models.base.check_prompts`.
        """
        check_prompts(prompts, negative_prompts, num_images_per_prompt)
        pe, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                                num_images_per_prompt=num_images_per_prompt,
                                                max_sequence_length=self.max_sequence_length)
        if not do_classifier_free_guidance or self.guidance_distilled:
            return PromptEmbeds(pe, None, pooled, None)
        npe, npooled, _ = self.pipe.encode_prompt(prompt=expand_negative_prompts(prompts, negative_prompts),
                                                  prompt_2=None, device=self.device,
                                                  num_images_per_prompt=num_images_per_prompt,
                                                  max_sequence_length=self.max_sequence_length)
        return PromptEmbeds(pe, npe, pooled, npooled)

    def predict(self, latents: torch.Tensor, timesteps: torch.Tensor | float, prompt_embeds: PromptEmbeds,
                guidance_scale: float = 1.0, detach_unconditional: bool = False) -> torch.Tensor:
        """The velocity v̂ ≈ ε − x_0 for unpacked `latents` `(B, C, h, w)`, float32, the same shape.

        With a guidance-distilled transformer one call is made with the embedded guidance `guidance_scale` (or the
        policy's fixed `guidance`, when `guidance_scale` is 1), as FluxPipeline's loop; otherwise
        `PipelinePolicy.predict` (true CFG ``uncond + w (cond − uncond)`` for w > 1, Ho & Salimans arXiv:2207.12598
        eq. 6, batched ``[negative, positive]``).

        Raises:
            ValueError: if `guidance_scale < 1`, the batch sizes differ, negatives are missing for true CFG, or a
                fixed `guidance` is set and `guidance_scale` is not 1.
        """
        if not self.guidance_distilled:
            return super().predict(latents, timesteps, prompt_embeds, guidance_scale, detach_unconditional)
        if guidance_scale < 1:
            raise ValueError(f"`guidance_scale` must be >= 1, got {guidance_scale}.")
        if self.guidance is not None and guidance_scale != 1.0:
            raise ValueError(f"this FLUX policy embeds the fixed guidance model.guidance={self.guidance}; pass "
                             f"guidance_scale=1 (got {guidance_scale}), or set model.guidance=null to feed "
                             "guidance_scale to the transformer")
        if len(prompt_embeds) != latents.shape[0]:
            raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows but `latents` has batch "
                             f"{latents.shape[0]}; encode one row per sample (see `num_images_per_prompt`).")
        embedded = self.guidance if self.guidance is not None else guidance_scale
        return self._denoise(latents.to(self.dtype), timesteps, prompt_embeds, guided=False,
                             embedded_guidance=embedded).float()

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool,
                 embedded_guidance: float | None = None) -> torch.Tensor:
        """The transformer on unpacked `latents` (`(B, C, h, w)`, or ``2B`` rows when `guided`): packs to
        `(B, hw/4, 4C)`, feeds σ = t/1000 in the model dtype, the text states, pooled embeddings, position ids and
        (distilled models) the guidance, and unpacks the output to `(B, C, h, w)`."""
        b, c, h, w = latents.shape
        t = self._flow_timesteps(timesteps, latents, len(prompt_embeds), guided).to(self.dtype)
        if guided:
            states, pooled = cfg_batch(prompt_embeds), cfg_batch(prompt_embeds, pooled=True)
        else:
            states, pooled = prompt_embeds.prompt_embeds, prompt_embeds.pooled_prompt_embeds
        guidance = None
        if self.guidance_distilled:
            value = 1.0 if embedded_guidance is None else embedded_guidance
            guidance = torch.full((b,), float(value), device=latents.device, dtype=torch.float32)
        text_ids = torch.zeros(states.shape[1], 3, device=latents.device, dtype=self.dtype)
        image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, self.dtype)
        out = self.forward_module(hidden_states=FluxPipeline._pack_latents(latents, b, c, h, w), timestep=t / 1000,
                                  guidance=guidance, pooled_projections=pooled.to(self.dtype),
                                  encoder_hidden_states=states.to(self.dtype), txt_ids=text_ids, img_ids=image_ids,
                                  return_dict=False)[0]
        return unpack_latents(out, h, w)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Packed tokens `(B, (h/2)(w/2), 4C)` → latents `(B, C, h, w)`: the inverse of `FluxPipeline._pack_latents`
    (`FluxPipeline._unpack_latents` with the latent size instead of the pixel size)."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


@dataclass
class FluxPolicyConfig:
    """Hydra config for `FluxPolicy.from_pretrained`; the fields mirror its arguments."""

    _target_: str = "diffalign.models.flux.FluxPolicy.from_pretrained"
    pretrained_model_name_or_path: str = MISSING
    revision: str | None = None
    variant: str | None = None
    torch_dtype: str = "bfloat16"
    local_files_only: bool | None = None
    vae: str | None = None
    height: int | None = None
    width: int | None = None
    flow_shift: float | None = None
    guidance: float | None = None
    lora_rank: int | None = 4
    lora_alpha: float | None = None
    lora_target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_FLUX_LORA_TARGET_MODULES))
    lora_seed: int = 0
    max_sequence_length: int = 512



# ------------------------------------------------------------------------------------------------ kohya / ComfyUI keys

FLUX_KOHYA_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "txt_mod_lin": ("norm1_context.linear",),
}
"""Double-stream block ``double_blocks.<i>.<name>`` of the original (BFL) FLUX → the diffusers modules of
``transformer_blocks.<i>`` it holds, in the order its output rows stack them (the fused qkv: q, k, v). The map of
diffusers' `_convert_kohya_flux_lora_to_diffusers`."""
FLUX_KOHYA_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
"""Single-stream block ``single_blocks.<i>.<name>`` → the modules of ``single_transformer_blocks.<i>``; ``linear1``
stacks q, k, v (d rows each) and the MLP input (4d rows, FLUX's mlp_ratio 4)."""
FLUX_KOHYA_GLOBAL = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
}
"""Layers outside the blocks with a kohya name (the final layer's modulation, stored with scale and shift swapped, is
not mapped)."""
_ROW_RATIOS = {"linear1": (1, 1, 1, 4)}  # output rows of the fused members, relative (others: equal)
_KOHYA_BLOCK = {"transformer_blocks": ("double_blocks", FLUX_KOHYA_DOUBLE),
                "single_transformer_blocks": ("single_blocks", FLUX_KOHYA_SINGLE)}


def _kohya_groups(modules) -> dict[str, tuple[str, ...]]:
    """kohya name (without ``lora_unet_``) → the diffusers module paths it fuses, for the groups `modules` touch.

    Raises:
        ValueError: for a module with no kohya name.
    """
    globals_ = {v: k for k, v in FLUX_KOHYA_GLOBAL.items()}
    groups: dict[str, tuple[str, ...]] = {}
    for module in modules:
        if module in globals_:
            groups[globals_[module]] = (module,)
            continue
        parts = module.split(".", 2)
        if len(parts) == 3 and parts[0] in _KOHYA_BLOCK and parts[1].isdigit():
            kohya_block, table = _KOHYA_BLOCK[parts[0]]
            for name, members in table.items():
                if parts[2] in members:
                    groups[f"{kohya_block}_{parts[1]}_{name}"] = tuple(f"{parts[0]}.{parts[1]}.{m}" for m in members)
                    break
            else:
                parts = None
        if parts is None or module not in {m for g in groups.values() for m in g}:
            raise ValueError(f"FLUX module {module!r} has no kohya/ComfyUI name (mapped: the blocks' attention, MLP "
                             "and modulation layers and the input embedders); export this LoRA with --format "
                             "diffusers, or train without that module")
    return groups


def flux_kohya_state_dict(state: dict[str, torch.Tensor], rank: int, alpha: float,
                          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A FLUX transformer LoRA under PEFT names (``<module>.lora_A.weight`` `(r, in)`, ``.lora_B.weight`` `(out, r)`,
    scale α / r) → kohya names of the original FLUX layers, the format ComfyUI, Forge and kohya sd-scripts read:
    ``lora_unet_double_blocks_<i>_img_attn_qkv.lora_down.weight`` ...

    Fused layers (the double blocks' ``img_attn_qkv`` / ``txt_attn_qkv``, the single blocks' ``linear1`` = q, k, v and
    the MLP input) get one LoRA of rank n·r: ``lora_down`` the n down matrices stacked `(n·r, in)`, ``lora_up`` the
    block-diagonal of the n up matrices `(Σ out_j, n·r)`, ``alpha`` n·α, so that the fused layer's update
    ``(nα / nr) · up @ down`` is exactly the stacked updates of its members; members the LoRA does not adapt get zero
    blocks. This is the "sparse" layout diffusers' `_convert_kohya_flux_lora_to_diffusers` splits back into the
    members. Other layers map one to one, ``alpha`` α.

    Args:
        state: PEFT-named tensors of one adapter (rank `rank` everywhere).
        rank, alpha: r and α of the adapter.
        dtype: dtype of the matrices (default: as given); ``alpha`` is float32.

    Returns:
        `dict[str, torch.Tensor]`: ``lora_unet_<name>.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``.

    Raises:
        ValueError: for a module with no kohya name.
    """
    modules = sorted(k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight"))
    out = {}
    for name, members in _kohya_groups(modules).items():
        present = [m for m in members if f"{m}.lora_A.weight" in state]
        a0, b0 = state[f"{present[0]}.lora_A.weight"], state[f"{present[0]}.lora_B.weight"]
        ratios = _ROW_RATIOS.get(name.rsplit("_", 1)[-1] if name.startswith("single") else "", (1,) * len(members))
        unit = b0.shape[0] // ratios[members.index(present[0])]
        downs, ups = [], []
        for member, ratio in zip(members, ratios):
            if member in present:
                downs.append(state[f"{member}.lora_A.weight"])
                ups.append(state[f"{member}.lora_B.weight"])
            else:  # not adapted: a zero block keeps the fused layout
                downs.append(a0.new_zeros(a0.shape))
                ups.append(b0.new_zeros((unit * ratio, rank)))
        n = len(members)
        down = torch.cat(downs) if n > 1 else downs[0]
        up = torch.block_diag(*ups) if n > 1 else ups[0]
        key = f"lora_unet_{name}"
        out[f"{key}.lora_down.weight"] = down.to(dtype or down.dtype).contiguous()
        out[f"{key}.lora_up.weight"] = up.to(dtype or up.dtype).contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(alpha) * n, dtype=torch.float32)
    return out


def is_flux_kohya_name(name: str) -> bool:
    """Whether a kohya module name (``lora_unet_...``) names an original-FLUX layer."""
    flat = name.removeprefix("lora_unet_")
    return flat.startswith(("double_blocks_", "single_blocks_")) or flat in FLUX_KOHYA_GLOBAL


def flux_modules_from_kohya(name: str, down: torch.Tensor, up: torch.Tensor, alpha: float
                            ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """One kohya FLUX layer → ``{diffusers module path: (A (r, in), B (out, r), α)}``, the inverse of
    `flux_kohya_state_dict` and the split diffusers' converter makes: a fused layer whose ``lora_up`` is
    block-diagonal with rank n·r ("sparse") gives each member its r rows of ``lora_down``, its diagonal block and α/n
    (same scale); a dense one (sd-scripts' own trainings: one down for all) gives every member the whole ``lora_down``,
    its rows of ``lora_up`` and α. Members whose matrices are both zero (the padding of a partial export) are left
    out.

    Raises:
        ValueError: for a name that is no FLUX layer.
    """
    flat = name.removeprefix("lora_unet_")
    if flat in FLUX_KOHYA_GLOBAL:
        return {FLUX_KOHYA_GLOBAL[flat]: (down, up, alpha)}
    block, _, rest = flat.partition("_blocks_")
    index, _, layer = rest.partition("_")
    table = FLUX_KOHYA_DOUBLE if block == "double" else FLUX_KOHYA_SINGLE if block == "single" else {}
    if not index.isdigit() or layer not in table:
        known = sorted(FLUX_KOHYA_DOUBLE) + sorted(FLUX_KOHYA_SINGLE)
        raise ValueError(f"kohya name {name!r} is no FLUX layer diffalign maps (the blocks' {known} and the input "
                         "embedders)")
    prefix = f"{'transformer_blocks' if block == 'double' else 'single_transformer_blocks'}.{index}."
    members = table[layer]
    n = len(members)
    if n == 1:
        return {prefix + members[0]: (down, up, alpha)}
    ratios = _ROW_RATIOS.get(layer, (1,) * n)
    unit = up.shape[0] // sum(ratios)
    rows = [unit * r for r in ratios]
    starts = [sum(rows[:j]) for j in range(n)]
    big_rank = down.shape[0]
    sparse = big_rank % n == 0
    r = big_rank // n
    if sparse:
        for j in range(n):
            for k in range(n):
                if j != k and up[starts[j]:starts[j] + rows[j], k * r:(k + 1) * r].any():
                    sparse = False
    result = {}
    for j, member in enumerate(members):
        b_rows = up[starts[j]:starts[j] + rows[j]]
        if sparse:
            a, b, member_alpha = down[j * r:(j + 1) * r], b_rows[:, j * r:(j + 1) * r], alpha / n
        else:
            a, b, member_alpha = down, b_rows, alpha
        if a.any() or b.any():
            result[prefix + member] = (a.contiguous(), b.contiguous(), member_alpha)
    return result
