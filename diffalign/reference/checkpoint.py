"""A named LoRA checkpoint as the reference: the base model plus that LoRA, loaded into the reference adapter once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffalign.config.schemas import config_schema
from diffalign.reference.adapter import POLICY_ADAPTER, ReferenceAdapter, SampleCache, check_strategy, require_lora

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy


@config_schema("reference", "checkpoint")
@dataclass
class CheckpointReferenceConfig:
    """Config of `CheckpointReference`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.reference.checkpoint.CheckpointReference"
    path: str = "???"


class CheckpointReference:
    """A named LoRA as the reference: the base model plus that LoRA (not the adapter-disabled base). The path is a
    diffalign ``checkpoint-<step>/`` or ``final/`` folder, a diffusers LoRA folder or file, or a kohya-format
    ``.safetensors`` file (`diffalign.lora.io.read_lora`), with the policy's rank, alpha and target modules — e.g. the
    run's ``model.init_lora``, which makes the policy start equal to its reference (docs/guides/lora.md).

    Args:
        path (`str`): the folder or file.

    Raises:
        ValueError: at `setup`, if the path is missing, is not a LoRA, or the LoRA does not fit the policy (other
            modules, rank or alpha; the message names ``reference.path``).
    """

    strategy = "checkpoint"

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): ``reference.path`` is given
        and holds LoRA weights.

        Raises:
            ValueError: when it is unset or not a LoRA; FileNotFoundError: when it does not exist or a folder holds no
                ``pytorch_lora_weights.safetensors``.
        """
        from omegaconf import OmegaConf

        from diffalign.lora.io import read_lora

        if OmegaConf.is_missing(cfg.reference, "path"):
            raise ValueError("reference.path is required for reference=checkpoint; pass reference.path=<LoRA folder or "
                             ".safetensors file>")
        read_lora(cfg.reference.path, field_name="reference.path")

    def __init__(self, path: str):
        self.path = str(path)
        self.version = 0
        self.samples = SampleCache()
        self.adapter: ReferenceAdapter | None = None

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Adds the reference adapter and loads the LoRA into it (float32).

        Raises:
            ValueError: naming ``reference.path``: see the class docstring.
        """
        from diffalign.lora.io import read_lora

        require_lora(policy, self.strategy)
        source = f"reference.path={self.path!r}"
        try:
            weights = read_lora(self.path, field_name="reference.path",
                                unet_config=getattr(policy.denoiser, "config", None))
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
        config = policy.denoiser.peft_config[POLICY_ADAPTER]
        if int(config.r) != weights.rank or float(config.lora_alpha) != weights.alpha:
            raise ValueError(f"{source} has r={weights.rank}, alpha={weights.settings['lora_alpha']} but the policy's "
                             f"adapter r={config.r}, alpha={config.lora_alpha}; use a LoRA of the run's "
                             "model.lora_rank and model.lora_alpha (the reference adapter copies the policy's)")
        self.adapter = ReferenceAdapter(policy)
        self.adapter.load({k: v.float() for k, v in weights.state.items()}, source)

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        """Runs the block with the checkpoint's adapter active and the UNet in eval mode."""
        with self.adapter.activate():
            yield policy

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Nothing to do; returns False."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """The path and the loaded tensors (so a resumed run does not depend on the folder still existing)."""
        return {"strategy": self.strategy, "path": self.path, "version": self.version,
                "weights": {k: p.detach() for k, p in self.adapter.params.items()},
                "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_strategy(state, self.strategy)
        self.adapter.load(state["weights"], "the checkpoint's reference state")
        self.samples.load_state_dict(state["samples"])
