"""DGPO's rollout ("old") policy θ⁻: the policy itself for the first `switch_step` updates, then an EMA of it.

DGPO (arXiv:2510.08425; docs/methods/algorithms.md#dgpo-rollout-policy) samples its groups with θ⁻ and, with the
PPO-style clip, compares the policy's denoising loss with θ⁻'s. θ⁻ is θ for the first 200 updates (500 for GenEval) and
afterwards θ⁻ ← d·θ⁻ + (1 − d)·θ after every optimizer step, with the decay ramped as d = min(decay, ramp·step) (decay
0.3, ramp 0.001 in the released code). The EMA is tracked from the first update, so it is ready at the switch.

θ⁻ lives in a second LoRA adapter (``"old"``) on the denoiser (`diffalign.reference.adapter.ReferenceAdapter`), so it
costs one adapter's memory, and its state is saved with every checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from diffalign.reference.adapter import ReferenceAdapter

OLD_ADAPTER = "old"


class EmaRolloutPolicy:
    """θ⁻ for DGPO.

    Args:
        switch_step (`int`, defaults to 200): updates during which θ⁻ = θ (≥ 0).
        decay (`float`, defaults to 0.3): the EMA decay cap d_max in [0, 1).
        ramp (`float`, defaults to 0.001): d = min(decay, ramp · step).

    Raises:
        ValueError: for out-of-range arguments (naming the `method.` field).
    """

    def __init__(self, switch_step: int = 200, decay: float = 0.3, ramp: float = 0.001):
        if switch_step < 0:
            raise ValueError(f"method.old_policy_switch_step={switch_step} must be >= 0.")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"method.old_policy_decay={decay} must be in [0, 1).")
        if ramp < 0:
            raise ValueError(f"method.old_policy_ramp={ramp} must be >= 0.")
        self.switch_step, self.decay, self.ramp = switch_step, decay, ramp
        self.adapter: ReferenceAdapter | None = None
        self.step = 0

    def setup(self, policy) -> None:
        """Adds the ``"old"`` adapter holding a copy of the policy's current adapter."""
        self.adapter = ReferenceAdapter(policy, adapter_name=OLD_ADAPTER)
        self.adapter.load(self.adapter.snapshot_policy(), "the policy's initial adapter")

    @property
    def active(self) -> bool:
        """True once θ⁻ differs from θ (after `switch_step` updates)."""
        return self.step >= self.switch_step

    def after_update(self) -> None:
        """Called after every optimizer step: θ⁻ ← d θ⁻ + (1 − d) θ with d = min(decay, ramp · step)."""
        self.step += 1
        d = min(self.decay, self.ramp * self.step)
        self.adapter.lerp_towards_policy(1.0 - d)

    @contextlib.contextmanager
    def use(self, policy) -> Iterator[Any]:
        """Runs the block with θ⁻ (the ``"old"`` adapter once active; the policy itself before)."""
        if not self.active:
            yield policy
            return
        with self.adapter.activate():
            yield policy

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weights": {k: p.detach() for k, p in self.adapter.params.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.adapter.load(state["weights"], "the checkpoint's rollout policy")
