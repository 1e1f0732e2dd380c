"""The policy interface every model adapter implements (one file per diffusers family in `diffalign/models/`).

Samplers, objectives, the training loops, references, monitors and evaluation use only the members `DiffusionPolicy`
declares (and the `torch.nn.Module` ones: ``to``, ``train``/``eval``, ``state_dict``), so a new model family is one
adapter file plus one config. What the families share is written once in `diffalign.models.pipeline_policy`. Latents
keep the model's native layout, documented by each adapter (`(B, C, h, w)` for images, `(B, C, F, h, w)` for video).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from diffalign.types import PromptEmbeds


@runtime_checkable
class DiffusionPolicy(Protocol):
    """A text-to-image (or video) diffusion model seen as a policy: it encodes prompts, predicts, and decodes; a LoRA
    adapter (or the whole denoiser) is trained.

    Attributes:
        scheduler: the diffusers scheduler the samplers step with: `DDIMScheduler` (ε/v models) or
            `FlowMatchEulerDiscreteScheduler` (flow models); ``scheduler.config.num_train_timesteps`` is the training
            schedule's length.
        modality (`str`, class attribute): "image" or "video", what the policy makes (validation pairs it with the
            rewards' before anything loads).
        flow_matching (`bool`, class attribute): a rectified-flow velocity model (the flow SDEs apply; also has
            `FlowDiffusionPolicy.sigmas_of`) or an ε/v model (DDIM).
        lora_rank (`int` or `None`): the adapter's rank; `None` for a full fine-tune of the denoiser (no frozen base,
            so `reference()` raises).
    """

    scheduler: object
    modality: str
    flow_matching: bool
    lora_rank: int | None

    @property
    def prediction_type(self) -> str:
        """What `predict` returns: "epsilon", "v_prediction" (VP models) or "flow" (rectified flow)."""
        ...

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """The shape of one latent without the batch dim, e.g. `(C, h, w)` or `(C, F, h, w)`."""
        ...

    @property
    def device(self) -> torch.device:
        """The denoiser's device."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The denoiser's base-weight dtype (inputs are cast to it)."""
        ...

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell in space (8 for SD/SDXL/SD3)."""
        ...

    @property
    def num_train_timesteps(self) -> int:
        """Length of the training schedule (1000; flow models are fed t = 1000 σ)."""
        ...

    @property
    def denoiser(self) -> nn.Module:
        """The bare trained network (UNet or transformer): adapters are added and switched on it, its train/eval
        mode is the policy's, and the accelerator prepares it."""
        ...

    @property
    def forward_module(self) -> nn.Module:
        """The module `predict` calls: the denoiser, or its distributed wrapper after `set_forward_module`."""
        ...

    def set_forward_module(self, module: nn.Module | None) -> None:
        """Forward through `module` (the DDP/FSDP wrapper of the denoiser); `None` goes back to the bare denoiser."""
        ...

    def encode_prompts(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        do_classifier_free_guidance: bool = True,
        num_images_per_prompt: int = 1,
    ) -> PromptEmbeds:
        """Encodes `len(prompts)` prompts into `len(prompts) * num_images_per_prompt` rows, ``[p0]*n + [p1]*n``.
        Everything the denoiser is conditioned on travels in the `PromptEmbeds` (token and pooled embeddings, and
        their negatives with CFG); conditioning computed from the latents (SDXL's ``time_ids``) stays inside
        `predict`."""
        ...

    def predict(
        self,
        latents: torch.Tensor,
        timesteps: torch.Tensor | float,
        prompt_embeds: PromptEmbeds,
        guidance_scale: float = 1.0,
        detach_unconditional: bool = False,
    ) -> torch.Tensor:
        """Returns the (guided) model output, float32, same shape as `latents`; CFG batches are ``[negative,
        positive]``; `detach_unconditional` stops gradients through the unconditional branch."""
        ...

    def add_noise(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Forward process x_t from clean latents x_0 and noise."""
        ...

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The regression target of `predict` for the denoising loss (ε, v, or ε − x_0 for flows)."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents → float32 images `(B, 3, H, W)` (or videos `(B, F, 3, H, W)`) in [0, 1]."""
        ...

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images (or videos) in [0, 1] → scaled latents."""
        ...

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter the optimizer updates (all float32)."""
        ...

    def reference(self) -> AbstractContextManager:
        """Context under which `predict` is the frozen reference model (e.g. the LoRA adapter disabled)."""
        ...

    def save_lora_weights(self, directory: str | os.PathLike) -> None:
        """Writes ``directory/pytorch_lora_weights.safetensors`` in the family pipeline's diffusers LoRA format."""
        ...

    def load_lora_weights(self, directory: str | os.PathLike) -> None:
        """Loads a folder `save_lora_weights` wrote into the adapter, in place (resume, evaluation of checkpoints)."""
        ...

    def to_pipeline(self):
        """A diffusers pipeline sharing the policy's modules (generates with the current weights; DDSPO's pairs)."""
        ...


@runtime_checkable
class FlowDiffusionPolicy(DiffusionPolicy, Protocol):
    """A rectified-flow policy (``flow_matching = True``, ``prediction_type == "flow"``): also maps timesteps to
    noise levels (the flow-only methods, e.g. DiffusionNFT, use it)."""

    def sigmas_of(self, timesteps: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
        """σ = t / num_train_timesteps, shaped `(B, 1, ..., 1)` to broadcast against `like`."""
        ...


@contextlib.contextmanager
def bare_forward(policy) -> Iterator[None]:
    """Runs the block with forward passes through the bare denoiser instead of its distributed wrapper
    (`set_forward_module`): for work only the main process does, such as monitors and evaluation, where a DDP forward
    on one process alone could wait for the others. The wrapper is restored on exit."""
    setter = getattr(policy, "set_forward_module", None)
    wrapped = policy.__dict__.get("_forward_module")
    if setter is not None:
        setter(None)
    try:
        yield
    finally:
        if setter is not None:
            setter(wrapped)


def check_prompts(prompts, negative_prompts: list[str] | None, num_images_per_prompt: int) -> None:
    """The argument checks every policy's `encode_prompts` makes before encoding.

    Raises:
        ValueError: if `prompts` is not a non-empty list of strings, `num_images_per_prompt < 1`, or
            `negative_prompts` has a length other than 1 or ``len(prompts)``.
    """
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"`prompts` must be a non-empty list of strings, got {prompts!r}.")
    if num_images_per_prompt < 1:
        raise ValueError(f"`num_images_per_prompt` must be >= 1, got {num_images_per_prompt}.")
    if negative_prompts is not None and len(negative_prompts) not in (1, len(prompts)):
        raise ValueError(
            f"`negative_prompts` has {len(negative_prompts)} entries for {len(prompts)} prompts; pass one negative"
            " prompt per prompt, or a single one for all."
        )


def expand_negative_prompts(prompts: list[str], negative_prompts: list[str] | None) -> list[str]:
    """One negative prompt per prompt: the empty prompt "" (the unconditional embedding) by default, a single one
    repeated, or the given list."""
    negatives = [""] * len(prompts) if negative_prompts is None else list(negative_prompts)
    return negatives * len(prompts) if len(negatives) == 1 else negatives


def disable_dropout(module: nn.Module) -> int:
    """Sets the probability of every dropout layer (`nn.Dropout`, `nn.Dropout2d`, ...) in `module` to 0, so its training forward is deterministic, as trl's
    trainers do by default (`disable_dropout=True`).

    The objectives need it: a policy-gradient ratio π_θ / π_old must be exactly 1 before the first update and a DPO
    loss against an identical reference exactly ln 2, but a dropout layer makes two forwards of the same input differ.
    Most denoisers have none; diffusers' UNet3D (the text-to-video family) has dropout 0.1 in every temporal
    convolution, which made the recomputed log-probs differ from the rollout's by up to 4.5 nats per position before
    any update (docs/guides/online.md#dropout).

    Returns:
        the number of dropout layers whose probability was above 0.
    """
    changed = 0
    for layer in module.modules():
        if isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0:
            layer.p = 0.0
            changed += 1
    return changed


def add_trainable_lora(denoiser: nn.Module, lora_rank: int | None, lora_alpha: float | None,
                       target_modules, lora_seed: int) -> None:
    """Makes `denoiser` trainable: the whole module when `lora_rank` is None, else a peft LoRA adapter "default"
    (rank `lora_rank`, alpha `lora_alpha`, Gaussian init drawn under `lora_seed` without touching the global RNG) on
    `target_modules`; trainable parameters are cast to float32 (fp16 trainable
    weights broke the grad scaler in diffusers and d3po:
    docs/guides/field_cases.md#trainable-parameters-left-in-half-precision). The denoiser's dropout is switched off
    first (`disable_dropout`)."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    disable_dropout(denoiser)

    if lora_rank is None:
        denoiser.requires_grad_(True)
    else:
        config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian",
                            target_modules=list(target_modules))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora_seed)
            denoiser.add_adapter(config)
    cast_training_params(denoiser, dtype=torch.float32)


class ForwardModuleMixin:
    """`forward_module` / `set_forward_module` for a policy with a `denoiser` property (shared by the SD, SD3 and
    video policies)."""

    @property
    def forward_module(self) -> nn.Module:
        """The module `predict` calls: the denoiser, or its distributed wrapper after `set_forward_module`."""
        wrapped = self.__dict__.get("_forward_module")
        return wrapped if wrapped is not None else self.denoiser

    def set_forward_module(self, module: nn.Module | None) -> None:
        """Runs forward passes through `module` — the denoiser as returned by `accelerate.Accelerator.prepare` (DDP,
        FSDP), so gradients are synchronised — while adapter switches (`reference()`, extra adapters) keep acting on
        the bare denoiser. `None` goes back to the bare denoiser (e.g. for main-process-only evaluation). Not
        registered as a submodule."""
        self.__dict__["_forward_module"] = module


def saved_lora_settings(directory) -> dict:
    """The adapter settings a LoRA folder was saved with: ``{"lora_rank", "lora_alpha", "lora_target_modules"}``
    read from the ``lora_adapter_metadata`` that `save_lora_weights` writes into
    ``pytorch_lora_weights.safetensors`` (diffusers' format; keys prefixed by the model part, e.g. ``unet.r``).
    Empty when the file carries no such metadata (e.g. a LoRA trained elsewhere).

    Raises:
        ValueError: if the file cannot be read.
    """
    import json
    import os

    import safetensors

    path = os.path.join(directory, "pytorch_lora_weights.safetensors")
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
    except (safetensors.SafetensorError, OSError) as err:
        raise ValueError(f"{path!r} cannot be read ({err}); pass a LoRA folder written by diffalign-train") from None
    if "lora_adapter_metadata" not in metadata:
        return {}
    config = {k.split(".", 1)[-1]: v for k, v in json.loads(metadata["lora_adapter_metadata"]).items()}
    if not {"r", "lora_alpha", "target_modules"} <= set(config):
        return {}
    return {"lora_rank": config["r"], "lora_alpha": config["lora_alpha"],
            "lora_target_modules": sorted(config["target_modules"])}


def _lora_layers(denoiser: nn.Module) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in denoiser.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def inference_lora(denoiser: nn.Module, *, fuse: bool = True) -> Iterator[str]:
    """Runs the block with the denoiser's active LoRA adapters folded out of the forward pass, for sampling without
    gradients (data preparation, evaluation, monitors). Yields what it did:

    - ``"skipped"``: every active adapter is zero (``lora_B`` all 0, as peft initialises it, so before the first
      update), so the adapters are disabled: the outputs are bit-for-bit those of the adapted model, at the bare
      denoiser's cost (the LoRA branch adds ~20–55 % to a forward of the tiny model on CPU;
      `docs/guides/performance.md`);
    - ``"fused"`` (with `fuse`): each adapted layer's base weight gets its LoRA delta added (W + (α/r)·B·A, peft's
      `get_delta_weight`, what diffusers' `fuse_lora` does) and the adapters are disabled; on exit the original
      weights are copied back from a saved copy (exact, unlike peft's `unmerge`, which subtracts the delta again and
      drifts by rounding). The outputs equal the adapted model's up to float rounding (the weights are summed before
      instead of after the matmul; max |Δ| of a tiny-model forward ≈ 1e-6);
    - ``"unchanged"``: nothing to do (no LoRA layer, adapters already disabled, e.g. inside ``policy.reference()``,
      a non-LoRA tuner, or a non-zero adapter with ``fuse=False``).

    Not for training: under the context the adapters receive no gradient. The saved copies hold the adapted layers'
    base weights (memory: those weights once more while the block runs).
    """
    layers = _lora_layers(denoiser)
    if not layers or any(layer.disable_adapters or layer.merged for layer in layers):
        yield "unchanged"
        return
    active = [(layer, name) for layer in layers for name in layer.active_adapters
              if name in getattr(layer, "lora_B", {})]
    if not active or any(name in getattr(layer, "lora_embedding_B", {}) for layer in layers
                         for name in layer.active_adapters):
        yield "unchanged"
        return
    zero = all(not bool(layer.lora_B[name].weight.detach().any()) for layer, name in active)
    if not zero and not fuse:
        yield "unchanged"
        return
    saved: dict[nn.Module, torch.Tensor] = {}
    flags = [(param, param.requires_grad) for param in denoiser.parameters()]  # peft's enable_adapters resets them
    try:
        with torch.no_grad():
            if not zero:
                for layer, name in active:
                    base = layer.get_base_layer()
                    if base not in saved:
                        saved[base] = base.weight.detach().clone()
                    delta = layer.get_delta_weight(name)
                    base.weight.add_(delta.to(base.weight.dtype))
        for layer in layers:
            layer.enable_adapters(False)
        yield "skipped" if zero else "fused"
    finally:
        with torch.no_grad():
            for base, weight in saved.items():
                base.weight.copy_(weight)
        for layer in layers:
            layer.enable_adapters(True)
        for param, flag in flags:
            param.requires_grad_(flag)
