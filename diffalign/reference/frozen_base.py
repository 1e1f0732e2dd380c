"""The frozen-base reference: the policy with its LoRA adapter disabled (Diffusion-DPO's reference, arXiv:2311.12908
§4).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffalign.config.schemas import config_schema
from diffalign.reference.adapter import SampleCache, check_strategy, require_lora

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy


@config_schema("reference", "frozen_base")
@dataclass
class FrozenBaseReferenceConfig:
    """Config of `FrozenBaseReference` (no fields)."""

    _target_: str = "diffalign.reference.frozen_base.FrozenBaseReference"


class FrozenBaseReference:
    """The frozen base model: the policy with its LoRA adapter disabled (`policy.reference()`), the reference of
    Diffusion-DPO (arXiv:2311.12908 §4) and of DITTO-like "ref = θ_0" runs when the LoRA starts at zero. Holds no
    tensors; `on_step` never changes it (``version`` stays 0)."""

    strategy = "frozen_base"

    def __init__(self):
        self.version = 0
        self.samples = SampleCache()

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Checks the policy has a LoRA adapter to disable.

        Raises:
            ValueError: for a full-UNet fine-tune (``model.lora_rank=null``).
        """
        require_lora(policy, self.strategy)

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        """Runs the block with the adapter disabled and the UNet in eval mode."""
        was_training = policy.denoiser.training
        with policy.reference():
            policy.denoiser.eval()
            try:
                yield policy
            finally:
                policy.denoiser.train(was_training)

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Nothing to do; returns False (the reference never changes)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "version": self.version, "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_strategy(state, self.strategy)
        self.samples.load_state_dict(state["samples"])
