"""What every diffusers-pipeline policy shares: loading, the guided forward, the image VAE, the LoRA adapter, and the
two forward processes (ε/v-prediction and rectified flow).

A model family is one file (`stable_diffusion.py`, `sdxl.py`, `sd3.py`, `flux.py`, `text_to_video.py`, `wan.py`) whose
policy derives from `PipelinePolicy` and one of the forward-process mixins here (`NoisePredictionMixin` for ε/v models,
`RectifiedFlowMixin` for flow models) and supplies only what differs between families:

- the constructor (which modules, which scheduler) and ``from_pretrained`` (through `load_pipeline`);
- ``encode_prompts`` (the family's text encoders);
- ``_denoise(latents, timesteps, prompt_embeds, guided)``: one call of the denoiser with the family's conditioning;
- ``_input_weight``: a weight of the denoiser's input layer (its device and dtype are the policy's);
- the class attributes ``pipeline_class`` (whose ``save_lora_weights`` writes the adapter), ``denoiser_name`` (the
  denoiser's attribute and the key prefix of its LoRA file: "unet" or "transformer"), ``denoiser_label`` (how error
  messages name it) and, where they differ from the defaults, ``lora_keys`` and ``latent_shift``.

The members the loops, samplers, objectives and evaluation use are listed by `diffalign.models.base.DiffusionPolicy`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import safetensors.torch
import torch
from diffusers.utils import convert_state_dict_to_diffusers, convert_unet_state_dict_to_peft
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from diffalign.models.base import ForwardModuleMixin, add_trainable_lora
from diffalign.runtime.files import readable_by_umask
from diffalign.types import PromptEmbeds

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cfg_batch(prompt_embeds: PromptEmbeds, *, pooled: bool = False) -> torch.Tensor:
    """Builds the classifier-free-guidance conditioning batch, always in the order ``[negative, positive]``.

    This is the one place the order is decided (diffusers pipelines use the same order); rollouts and the
    training-time recomputation of log-probs both go through it (a OneTrainer
    sampler that ordered token and pooled embeddings differently mixed the conditioning:
    docs/guides/field_cases.md#cfg-batch-order).

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


def truthy_env(name: str) -> bool:
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


def resolve_dtype(torch_dtype: str | torch.dtype) -> torch.dtype:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` (or a `torch.dtype`) → the `torch.dtype`.

    Raises:
        ValueError: for any other name.
    """
    if isinstance(torch_dtype, torch.dtype):
        return torch_dtype
    if torch_dtype not in TORCH_DTYPES:
        raise ValueError(f"`torch_dtype` must be one of {sorted(TORCH_DTYPES)}, got {torch_dtype!r}.")
    return TORCH_DTYPES[torch_dtype]


def load_pipeline(pipeline_class, pretrained_model_name_or_path: str | os.PathLike, *, revision: str | None = None,
                  variant: str | None = None, torch_dtype: str | torch.dtype = "float32",
                  local_files_only: bool | None = None, kind: str = "", example_hub_id: str | None = None,
                  **components):
    """``pipeline_class.from_pretrained`` of a local diffusers folder or hub id, with the checks every family makes
    first: a known `torch_dtype`, and a local-looking path that is a pipeline folder (`check_pipeline_folder`).

    Args:
        pipeline_class: the diffusers pipeline class, e.g. `StableDiffusionPipeline`.
        pretrained_model_name_or_path (`str`): a local folder (with `model_index.json`; ``~`` expanded) or a hub id.
        revision, variant: passed to ``from_pretrained``.
        torch_dtype (`str` or `torch.dtype`, defaults to "float32"): dtype of the loaded weights.
        local_files_only (`bool`, *optional*): never contact the hub; `None` means True when `HF_HUB_OFFLINE` is set
            to a true value.
        kind, example_hub_id (`str`): named in the error for a bad folder.
        **components: components passed on (e.g. ``safety_checker=None``, ``text_encoder_3=None``).

    Raises:
        ValueError: for an unknown `torch_dtype`, or a local path that does not exist or has no `model_index.json`
            (before anything is loaded).
        OSError: from diffusers, for a hub id that is neither cached nor reachable.
    """
    dtype = resolve_dtype(torch_dtype)
    original = os.fspath(pretrained_model_name_or_path)
    path = os.path.expanduser(original)
    check_pipeline_folder(path, original, kind=kind, example_hub_id=example_hub_id)
    if local_files_only is None:
        local_files_only = truthy_env("HF_HUB_OFFLINE")
    return pipeline_class.from_pretrained(path, revision=revision, variant=variant, dtype=dtype,
                                          local_files_only=local_files_only, **components)


def load_vae_folder(vae: str | os.PathLike, torch_dtype: str | torch.dtype = "float32"):
    """An `AutoencoderKL` from a local folder (with `config.json`; ``~`` expanded), in `torch_dtype`: the ``model.vae``
    of a pipeline folder that stores no VAE of its own (the shipped tiny FLUX and text-to-video models use tiny_sd3's,
    ``${diffalign_asset:tiny_sd3/vae}``), passed on as ``Pipeline.from_pretrained(path, vae=...)``.

    Raises:
        ValueError: for an unknown `torch_dtype`, or a path that is not a VAE folder (before loading).
    """
    from diffusers import AutoencoderKL

    dtype = resolve_dtype(torch_dtype)
    path = os.path.expanduser(os.fspath(vae))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model.vae={os.fspath(vae)!r} is not a VAE folder (no config.json); point it at an "
                         "AutoencoderKL folder such as <pipeline>/vae, or set model.vae=null to load the "
                         "pipeline's own")
    return AutoencoderKL.from_pretrained(path, torch_dtype=dtype)


def check_lora_arguments(lora_rank: int | None, lora_target_modules: Sequence[str], denoiser: str,
                         example: Sequence[str]) -> None:
    """The LoRA arguments every policy checks before it touches a module.

    Raises:
        ValueError: for `lora_rank < 1`, or an empty `lora_target_modules` with a rank set.
    """
    if lora_rank is not None and lora_rank < 1:
        raise ValueError(f"`lora_rank` must be >= 1, or None for a full {denoiser} fine-tune; got {lora_rank}.")
    if lora_rank is not None and len(lora_target_modules) == 0:
        raise ValueError(f"`lora_target_modules` is empty; list module names such as {list(example)}.")


class PipelinePolicy(ForwardModuleMixin, nn.Module):
    """The members every diffusers-pipeline policy shares (see the module docstring for what a family supplies).

    The frozen parts (VAE, text encoders) stay in eval mode; the denoiser carries a peft LoRA adapter named
    "default" (or is trained whole with ``lora_rank=None``), whose matrices are the only trainable parameters,
    float32.

    Class attributes:
        modality (`str`): "image" or "video": what the policy makes; validation pairs it with the rewards'.
        flow_matching (`bool`): a rectified-flow velocity model (the flow SDEs apply) or not (DDIM).
        pipeline_class: the diffusers pipeline class whose ``save_lora_weights`` writes the adapter.
        denoiser_name (`str`): "unet" or "transformer": the denoiser's attribute, its name in the pipeline and the
            key prefix of its LoRA file.
        denoiser_label (`str`): the denoiser as error messages name it, e.g. "a UNet (SD1.x/2.x)".
        lora_keys (`str`): "diffusers" (UNet LoRA keys converted like diffusers' training scripts do) or "peft".
        latent_shift (`bool`): the VAE's latents are ``(z − shift_factor) · scaling_factor`` (SD3) instead of
            ``z · scaling_factor``.
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    flow_matching = False  # rectified-flow velocity model (the flow SDEs apply) or not (DDIM)
    pipeline_class = None
    denoiser_name = "unet"
    denoiser_label = "a denoiser"
    lora_keys = "peft"
    latent_shift = False

    def _init_lora(self, lora_rank: int | None, lora_alpha: float | None, lora_target_modules: Sequence[str],
                   lora_seed: int) -> None:
        """Records the adapter settings and makes the denoiser trainable (`add_trainable_lora`)."""
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        add_trainable_lora(self.denoiser, lora_rank, self.lora_alpha, lora_target_modules, lora_seed)

    def train(self, mode: bool = True):
        """Sets the denoiser's mode; every other part (VAE, text encoders) stays in eval mode."""
        super().train(mode)
        denoiser = self.denoiser
        for child in self.children():
            if child is not denoiser:
                child.eval()
        return self

    # ------------------------------------------------------------------ properties

    @property
    def denoiser(self) -> nn.Module:
        """The bare trained network (the UNet or transformer); LoRA adapters are switched on it."""
        return getattr(self, self.denoiser_name)

    @property
    def _input_weight(self) -> torch.Tensor:
        """A weight of the denoiser's input layer: its device and dtype are the policy's."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Device of the denoiser."""
        return self._input_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the denoiser's (frozen) base weights, the dtype its inputs are cast to."""
        return self._input_weight.dtype

    @property
    def num_train_timesteps(self) -> int:
        """Length of the training noise schedule (1000 for SD; flow models are fed t = 1000 σ)."""
        return self.scheduler.config.num_train_timesteps

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell, 2 ** (number of VAE blocks − 1) (8 for SD)."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """`(C, h, w)` of the default latent, from the denoiser's `config.in_channels` and `config.sample_size`."""
        config = self.denoiser.config
        size = config.sample_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return (config.in_channels, h, w)

    # ------------------------------------------------------------------ model calls

    def _denoise(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds, guided: bool) -> torch.Tensor:
        """One call of the denoiser (through `forward_module`) on `latents` already in the policy's dtype: `B` rows,
        or ``2B`` rows ``[latents, latents]`` with the conditioning batched ``[negative, positive]`` (`cfg_batch`)
        when `guided`. Returns the raw output in the denoiser's dtype."""
        raise NotImplementedError

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor | float,
        prompt_embeds: PromptEmbeds,
        guidance_scale: float = 1.0,
        detach_unconditional: bool = False,
    ) -> torch.Tensor:
        """The denoiser's prediction (ε̂, v̂ or the flow velocity, see `prediction_type`), with classifier-free
        guidance when `guidance_scale > 1`.

        With guidance w > 1 the denoiser runs once on the batch ``[negative, positive]`` (`cfg_batch`) and the result
        is ``uncond + w · (cond − uncond)`` (Ho & Salimans, arXiv:2207.12598, eq. 6), as in the diffusers pipelines.
        With w = 1 only the conditional batch runs and its output is returned unchanged. Inputs are cast to the
        denoiser's dtype; gradients flow to the trainable parameters unless called under `torch.no_grad()`.

        Args:
            latents (`torch.Tensor`): `(B, *latent_shape)` noisy latents x_t.
            timesteps (`torch.Tensor`, `int` or `float`): a scalar or `(B,)` timesteps: integers in
                [0, num_train_timesteps) for ε/v models, t = 1000 σ (floats allowed) for flow models.
            prompt_embeds (`PromptEmbeds`): `B` rows (with negatives when `guidance_scale > 1`).
            guidance_scale (`float`, defaults to 1.0): w ≥ 1.
            detach_unconditional (`bool`, defaults to False): with w > 1, stop gradients through the unconditional
                branch (Flow-GRPO/ViPO training forwards, docs/methods/algorithms.md#classifier-free-guidance); the
                value is unchanged.

        Returns:
            `torch.Tensor` float32, the shape of `latents`.

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
        latents = latents.to(self.dtype)
        if guidance_scale == 1.0:
            return self._denoise(latents, timesteps, prompt_embeds, guided=False).float()
        out = self._denoise(torch.cat([latents, latents]), timesteps, prompt_embeds, guided=True)
        uncond, cond = out.float().chunk(2)
        if detach_unconditional:
            uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)

    def forward(self, latents: torch.Tensor, timesteps, prompt_embeds: PromptEmbeds,
                guidance_scale: float = 1.0) -> torch.Tensor:
        """Same as `predict` (so the policy can be wrapped by DDP)."""
        return self.predict(latents, timesteps, prompt_embeds, guidance_scale)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents `(B, C, h, w)` → float32 images `(B, 3, h·f, w·f)` in [0, 1] (f = `vae_scale_factor`).

        Same arithmetic as the diffusers pipelines with `output_type="pt"`: decode ``latents / scaling_factor`` (plus
        ``shift_factor`` with `latent_shift`), then ``(x · 0.5 + 0.5).clamp(0, 1)``. Differentiable (wrap in
        `torch.no_grad()` when not needed).
        """
        z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
        if self.latent_shift:
            z = z + self.vae.config.shift_factor
        images = self.vae.decode(z, return_dict=False)[0]
        return (images * 0.5 + 0.5).clamp(0, 1).float()

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images `(B, 3, H, W)` in [0, 1] → float32 scaled latents `(B, C, H/f, W/f)`.

        Uses the mean of the VAE's latent distribution (its mode; deterministic, no sampling), times
        `vae.config.scaling_factor` (after subtracting ``shift_factor`` with `latent_shift`), the convention of
        diffusers' Diffusion-DPO example for pre-encoded data.

        Raises:
            ValueError: if `images` is not `(B, 3, H, W)` or has values outside [0, 1].
        """
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"`images` must be (B, 3, H, W), got shape {tuple(images.shape)}.")
        if images.min() < 0 or images.max() > 1:
            raise ValueError("`images` must be in [0, 1]; convert uint8 images with `images.float() / 255`.")
        pixels = images.to(device=self.vae.device, dtype=self.vae.dtype) * 2 - 1
        z = self.vae.encode(pixels).latent_dist.mean
        if self.latent_shift:
            z = z - self.vae.config.shift_factor
        return (z * self.vae.config.scaling_factor).float()

    # ------------------------------------------------------------------ training state

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The parameters to optimise: the LoRA matrices, or every denoiser parameter when `lora_rank is None`. All
        float32."""
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference(self) -> Iterator[PipelinePolicy]:
        """Context under which the denoiser runs with its LoRA adapter disabled: the frozen base model, i.e. the
        reference model of DPO-style objectives. The adapter is re-enabled on exit, also when the block raises.

        Raises:
            ValueError: for a full fine-tune (`lora_rank=None`), which has no frozen base inside the policy; use a
                frozen-copy reference strategy instead.
        """
        if self.lora_rank is None:
            raise ValueError(
                f"`reference()` disables the LoRA adapter, but this policy fine-tunes the full {self.denoiser_name}"
                " (lora_rank=None) and keeps no frozen base. Use a frozen-copy reference (a deep copy of the initial"
                f" {self.denoiser_name}), or set `lora_rank`."
            )
        layers = self._tuner_layers()
        if layers is None:  # (a denoiser that is not a diffusers model with peft adapters: its own methods)
            self.denoiser.disable_adapters()
        else:
            for layer in layers:
                layer.enable_adapters(False)
        try:
            yield self
        finally:
            if layers is None:
                self.denoiser.enable_adapters()
            else:
                for layer in layers:
                    layer.enable_adapters(True)

    def _tuner_layers(self) -> list[nn.Module] | None:
        """The denoiser's peft tuner layers in module order, found once per denoiser and adapter set; `None` when the
        denoiser is not a diffusers model with adapters loaded.

        `reference` switches these layers itself, as diffusers' `disable_adapters` / `enable_adapters` do (the same
        `BaseTunerLayer.enable_adapters` call on every such module, in the same order), without the package-metadata
        version check and the module walk diffusers repeats on every call: ~8 ms per switch pair on the tiny models,
        a reference forward is 30–120 ms (docs/results/performance.md#the-reference-switch)."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        denoiser = self.denoiser
        if not getattr(denoiser, "_hf_peft_config_loaded", False):
            return None
        key = (id(denoiser), tuple(denoiser.peft_config))
        cached = self.__dict__.get("_tuner_layer_cache")
        if cached is None or cached[0] != key:
            cached = (key, [m for m in denoiser.modules() if isinstance(m, BaseTunerLayer)])
            self.__dict__["_tuner_layer_cache"] = cached
        return cached[1]

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter weights as detached float32 copies (safe to keep as a snapshot), keyed as the family's
        diffusers LoRA files are (without the ``unet.``/``transformer.`` prefix).

        With ``lora_keys == "diffusers"`` (UNets) the keys are converted like diffusers' training scripts do
        (``down_blocks.1....to_q.lora.down.weight``); an adapter with layers that format does not name (convolutions,
        e.g. ``conv1``) keeps PEFT's names (``...conv1.lora_A.weight``, ``...to_q.lora_A.weight``) for every layer:
        `load_lora_weights` of a diffusers pipeline reads either format, but not a mix of the two (it would drop the
        attention layers). Transformers keep PEFT's names (``...lora_A.weight``), diffusers' format for them.

        Raises:
            ValueError: if the policy has no LoRA adapter (`lora_rank=None`).
        """
        if self.lora_rank is None:
            raise ValueError(f"This policy fine-tunes the full {self.denoiser_name} (lora_rank=None); save "
                             f"`policy.{self.denoiser_name}` instead.")
        state_dict = peft_state_dict = get_peft_model_state_dict(self.denoiser)
        if self.lora_keys == "diffusers":
            state_dict = convert_state_dict_to_diffusers(peft_state_dict)
            if any(".lora_A." in k or ".lora_B." in k for k in state_dict):  # partly unconverted: keep PEFT names
                state_dict = peft_state_dict
        return {k: v.detach().clone() for k, v in state_dict.items()}

    def load_lora_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads weights from `lora_state_dict` (either key format) into the adapter in place."""
        set_peft_model_state_dict(self.denoiser, convert_unet_state_dict_to_peft(dict(state_dict)))

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """Writes `directory/pytorch_lora_weights.safetensors` with the family pipeline's ``save_lora_weights``
        (keys prefixed ``unet.``/``transformer.``), including the adapter config (rank, alpha, targets) as metadata,
        so that ``<Pipeline>.load_lora_weights(directory)`` of a plain diffusers pipeline reproduces this policy's
        outputs."""
        name = self.denoiser_name
        self.pipeline_class.save_lora_weights(
            save_directory=directory,
            safe_serialization=True,
            **{f"{name}_lora_layers": self.lora_state_dict(),
               f"{name}_lora_adapter_metadata": self.denoiser.peft_config["default"].to_dict()},
        )
        readable_by_umask(os.path.join(directory, LORA_WEIGHT_NAME))  # safetensors writes 0600

    def load_lora_weights(self, directory: str | os.PathLike) -> None:
        """Loads `directory/pytorch_lora_weights.safetensors` (written by `save_lora_weights`) into this policy's
        adapter, in place; the parameters stay float32 and trainable (used on resume).

        Raises:
            ValueError: if the file is missing or unreadable, holds no weights for this family's denoiser, or its keys
                or shapes do not match this policy's adapter.
        """
        path = os.path.join(directory, LORA_WEIGHT_NAME)
        if not os.path.isfile(path):
            raise ValueError(f"No {LORA_WEIGHT_NAME} in {directory!r}; pass the folder `save_lora_weights` wrote.")
        try:
            state_dict = safetensors.torch.load_file(path)
        except (safetensors.SafetensorError, OSError) as err:  # a truncated or damaged file
            raise ValueError(f"{path!r} cannot be read ({err}); the file is truncated or damaged: use another "
                             "checkpoint folder") from None
        prefix = f"{self.denoiser_name}."
        if not any(k.startswith(prefix) for k in state_dict):
            found = sorted({k.split(".", 1)[0] for k in state_dict})
            raise ValueError(f"{path!r} holds LoRA weights for {found} modules, not for {self.denoiser_label} "
                             f"('{prefix}*' keys); it was saved from another model family: pass "
                             "a LoRA folder of a run with this model")
        state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        state_dict = convert_unet_state_dict_to_peft(state_dict)
        expected = get_peft_model_state_dict(self.denoiser)
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
        set_peft_model_state_dict(self.denoiser, state_dict)


class NoisePredictionMixin:
    """The VP forward process of ε- and v-prediction models (SD1.x/2.x, SDXL, UNet3D video), stepped by DDIM.

    Needs ``self.scheduler``, a diffusers scheduler with ``add_noise`` and ``get_velocity`` (`DDIMScheduler`).
    """

    flow_matching = False

    @staticmethod
    def check_prediction_type(scheduler, owner: str) -> None:
        """Refuses a scheduler whose `prediction_type` is neither "epsilon" nor "v_prediction".

        Raises:
            ValueError: naming `owner` (the policy class) and the value.
        """
        prediction_type = scheduler.config.prediction_type
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(
                f"scheduler.config.prediction_type={prediction_type!r} is not supported by {owner};"
                " use a checkpoint whose scheduler predicts 'epsilon' or 'v_prediction'."
            )

    @property
    def prediction_type(self) -> str:
        """What `predict` returns: "epsilon" (ε̂) or "v_prediction" (v̂ = sqrt(ᾱ) ε − sqrt(1 − ᾱ) x0)."""
        return self.scheduler.config.prediction_type

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | int) -> torch.Tensor:
        """x_t = sqrt(ᾱ_t) x_0 + sqrt(1 − ᾱ_t) ε (docs/methods/algorithms.md#forward-processes), via
        `DDIMScheduler.add_noise`.

        Args:
            latents (`torch.Tensor`): `(B, *latent_shape)` clean scaled latents x_0.
            noise (`torch.Tensor`): ε, the shape of `latents`.
            timesteps (`torch.Tensor` or `int`): a scalar or `(B,)` integer timesteps.

        Returns:
            `torch.Tensor`, the shape and dtype of `latents`.
        """
        return self.scheduler.add_noise(latents, noise, torch.as_tensor(timesteps, device=latents.device))

    def training_target(
        self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | int
    ) -> torch.Tensor:
        """What `predict` should output for x_t = `add_noise(latents, noise, timesteps)`
        (docs/methods/algorithms.md#denoising-loss).

        Returns ε for "epsilon" and v = sqrt(ᾱ_t) ε − sqrt(1 − ᾱ_t) x_0 (`DDIMScheduler.get_velocity`) for
        "v_prediction"; the shape of `latents`.
        """
        if self.prediction_type == "epsilon":
            return noise
        return self.scheduler.get_velocity(latents, noise, torch.as_tensor(timesteps, device=latents.device))


class RectifiedFlowMixin:
    """The rectified-flow forward process of velocity models (SD3, Wan): x_σ = (1 − σ) x_0 + σ ε with σ = t / 1000
    (σ = 1 is pure noise); the model predicts v̂ ≈ ε − x_0 and is fed the timestep t = 1000 σ, the values
    `FlowMatchEulerDiscreteScheduler.timesteps` holds."""

    flow_matching = True

    @property
    def prediction_type(self) -> str:
        """Always "flow": `predict` returns the velocity v̂ ≈ ε − x_0."""
        return "flow"

    def _flow_timesteps(self, timesteps: torch.Tensor | float, latents: torch.Tensor, batch: int,
                        guided: bool) -> torch.Tensor:
        """The float32 `(B,)` (or `(2B,)` when `guided`) timestep tensor a flow denoiser is fed."""
        t = torch.as_tensor(timesteps, device=latents.device, dtype=torch.float32)
        t = t.expand(batch) if t.ndim == 0 else t
        return torch.cat([t, t]) if guided else t

    def sigmas_of(self, timesteps: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
        """σ = t / 1000 broadcast to `like`'s shape `(B, 1, ..., 1)`, float32."""
        sigma = torch.as_tensor(timesteps, device=like.device, dtype=torch.float32) / self.num_train_timesteps
        sigma = sigma.reshape(-1) if sigma.ndim else sigma.expand(like.shape[0])
        return sigma.reshape(-1, *([1] * (like.ndim - 1)))

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | float) -> torch.Tensor:
        """x_σ = (1 − σ) x_0 + σ ε with σ = t / 1000 (docs/methods/algorithms.md#forward-processes;
        `FlowMatchEulerDiscreteScheduler.scale_noise`).

        Args: `latents` x_0 and `noise` ε `(B, *latent_shape)`; `timesteps` scalar or `(B,)` in [0, 1000].
        Returns: float32, the shape of `latents`.
        """
        sigma = self.sigmas_of(timesteps, latents)
        return (1 - sigma) * latents.float() + sigma * noise.float()

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps=None) -> torch.Tensor:
        """The velocity target u = ε − x_0 (docs/methods/algorithms.md#denoising-loss), independent of σ; float32."""
        return noise.float() - latents.float()
