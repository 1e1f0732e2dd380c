"""An exponential moving average of the policy's LoRA as the reference
(docs/methods/algorithms.md#dgpo-rollout-policy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diffalign.config.schemas import config_schema
from diffalign.reference.adapter import ReferenceAdapter, SampleCache, check_strategy, require_lora

if TYPE_CHECKING:
    from diffalign.models.stable_diffusion import StableDiffusionPolicy


@config_schema("reference", "ema")
@dataclass
class EmaReferenceConfig:
    """Config of `EmaReference`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.reference.ema.EmaReference"
    decay: float = 0.999
    update_every: int = 1


class EmaReference:
    r"""An exponential moving average of the policy's LoRA as the reference:
    $\theta_r \leftarrow \text{decay}\cdot\theta_r + (1-\text{decay})\cdot\theta$ every `update_every` updates, starting
    from the policy's initial adapter (an EMA reference as DGPO's θ⁻, arXiv:2510.08425;
    docs/methods/algorithms.md#dgpo-rollout-policy).

    Args:
        decay (`float`, defaults to 0.999): in [0, 1); 0 makes the reference the policy as of the last update.
        update_every (`int`, defaults to 1): EMA period in optimizer updates, ≥ 1.

    Raises:
        ValueError: if `decay` is outside [0, 1) or `update_every` < 1 (naming ``reference.decay`` /
            ``reference.update_every``).
    """

    strategy = "ema"

    def __init__(self, decay: float = 0.999, update_every: int = 1):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"reference.decay={decay} must be in [0, 1), e.g. 0.999.")
        if update_every < 1:
            raise ValueError(f"reference.update_every={update_every} must be >= 1.")
        self.decay, self.update_every = decay, update_every
        self.version = 0
        self.last_step: int | None = None
        self.samples = SampleCache()
        self.adapter: ReferenceAdapter | None = None

    def setup(self, policy: StableDiffusionPolicy) -> None:
        """Adds the reference adapter and copies the policy's current (initial) adapter into it."""
        require_lora(policy, self.strategy)
        self.adapter = ReferenceAdapter(policy)
        self.adapter.load(self.adapter.snapshot_policy(), "the policy's initial adapter")

    @contextlib.contextmanager
    def use(self, policy: StableDiffusionPolicy) -> Iterator[StableDiffusionPolicy]:
        with self.adapter.activate():
            yield policy

    def on_step(self, policy: StableDiffusionPolicy, global_step: int) -> bool:
        """Before update `global_step` (0-based; the policy has had `global_step` updates): an EMA step when
        ``global_step > 0`` and ``global_step % update_every == 0``. Returns True when θ_r changed. Calling it twice
        for one step does nothing the second time."""
        if global_step == self.last_step:
            return False
        self.last_step = global_step
        if global_step == 0 or global_step % self.update_every != 0:
            return False
        self.adapter.lerp_towards_policy(1.0 - self.decay)
        self.version += 1
        self.samples.clear()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "decay": self.decay, "update_every": self.update_every,
                "version": self.version, "last_step": self.last_step,
                "weights": {k: p.detach() for k, p in self.adapter.params.items()},
                "samples": self.samples.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_strategy(state, self.strategy)
        self.adapter.load(state["weights"], "the checkpoint's EMA reference")
        self.version, self.last_step = state["version"], state["last_step"]
        self.samples.load_state_dict(state["samples"])
