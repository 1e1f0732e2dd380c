"""DGPO's rollout policy θ⁻ (`EmaRolloutPolicy`) beyond the one-step check of tests/unit/objectives/test_dgpo.py, found
by mutation testing (docs/contributing.md#mutation-testing): the released defaults and the bounds with their messages,
the decay ramp up to its cap (d = min(decay, ramp·step), docs/methods/algorithms.md#dgpo), the ``"old"`` adapter, and
the checkpoint state round trip."""

from __future__ import annotations

import pytest
import torch

from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.reference.old_policy import EmaRolloutPolicy


def test_defaults_and_bounds():
    old = EmaRolloutPolicy()
    assert (old.switch_step, old.decay, old.ramp, old.step, old.adapter) == (200, 0.3, 0.001, 0, None)
    edge = EmaRolloutPolicy(switch_step=0, decay=0.0, ramp=0.0)
    assert edge.active  # θ⁻ is the EMA from the start
    with pytest.raises(ValueError, match=r"^method.old_policy_switch_step=-1 must be >= 0.$"):
        EmaRolloutPolicy(switch_step=-1)
    with pytest.raises(ValueError, match=r"^method.old_policy_decay=1.0 must be in \[0, 1\).$"):
        EmaRolloutPolicy(decay=1.0)
    with pytest.raises(ValueError, match=r"^method.old_policy_decay=-0.1 must be in \[0, 1\).$"):
        EmaRolloutPolicy(decay=-0.1)
    with pytest.raises(ValueError, match=r"^method.old_policy_ramp=-0.1 must be >= 0.$"):
        EmaRolloutPolicy(ramp=-0.1)


def test_the_decay_ramps_to_its_cap_in_the_old_adapter(perturb_lora):
    """ramp 0.2, cap 0.3: d = 0.2 after update 1, then min(0.3, 0.4) = 0.3 after update 2 — θ⁻ ← d θ⁻ + (1 − d) θ."""
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy, seed=1)
    old = EmaRolloutPolicy(switch_step=5, decay=0.3, ramp=0.2)
    old.setup(policy)
    assert any(".old." in name for name, _ in policy.unet.named_parameters())  # its own "old" adapter
    theta_minus = {k: v.detach().clone() for k, v in old.adapter.params.items()}
    for d, seed in ((0.2, 2), (0.3, 3)):
        perturb_lora(policy, seed=seed)
        old.after_update()
        theta = {k: p.detach() for k, p in old.adapter.policy_params.items()}
        theta_minus = {k: d * theta_minus[k] + (1 - d) * theta[k] for k in theta_minus}
        for key, value in theta_minus.items():
            torch.testing.assert_close(old.adapter.params[key].detach(), value)
    assert old.step == 2 and not old.active


def test_state_round_trip(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    old = EmaRolloutPolicy(switch_step=1, decay=0.3, ramp=1.0)
    old.setup(policy)
    for seed in (1, 2):
        perturb_lora(policy, seed=seed)
        old.after_update()
    state = old.state_dict()
    assert set(state) == {"step", "weights"} and state["step"] == 2
    restored = EmaRolloutPolicy(switch_step=1, decay=0.3, ramp=1.0)
    restored.setup(build_tiny_random_policy(seed=0))
    restored.load_state_dict(state)
    assert restored.step == 2 and restored.active
    assert all(torch.equal(restored.adapter.params[k], p) for k, p in old.adapter.params.items())
    with pytest.raises(ValueError, match=r"^the checkpoint's rollout policy: LoRA keys do not match"):
        restored.load_state_dict({"step": 2, "weights": {}})
