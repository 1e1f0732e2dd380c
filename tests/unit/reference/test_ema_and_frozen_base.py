"""The EMA and frozen-base reference strategies' contract beyond the EMA arithmetic of
tests/unit/reference/test_reference.py, found by mutation testing (docs/contributing.md#mutation-testing): defaults and
argument bounds with their messages, the version count, the checkpoint state round trip (no mapped test saved either
strategy), the LoRA requirement, and the frozen base's eval mode inside `use`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.reference.ema import EmaReference
from diffalign.reference.frozen_base import FrozenBaseReference


def test_ema_defaults_and_bounds():
    ema = EmaReference()
    assert (ema.decay, ema.update_every, ema.version, ema.last_step, ema.adapter) == (0.999, 1, 0, None, None)
    assert EmaReference(decay=0.0).decay == 0.0  # the reference is the policy as of the last update
    with pytest.raises(ValueError, match=r"^reference.decay=1.0 must be in \[0, 1\), e.g. 0.999.$"):
        EmaReference(decay=1.0)
    with pytest.raises(ValueError, match=r"^reference.decay=-0.1 must be in \[0, 1\), e.g. 0.999.$"):
        EmaReference(decay=-0.1)
    with pytest.raises(ValueError, match=r"^reference.update_every=0 must be >= 1.$"):
        EmaReference(update_every=0)


@pytest.mark.parametrize("strategy", [EmaReference, FrozenBaseReference])
def test_a_full_unet_policy_is_refused_naming_the_strategy(strategy):
    with pytest.raises(ValueError, match=rf"^reference={strategy.strategy} needs a LoRA policy, but model.lora_rank "
                                         r"is null \(full UNet fine-tune\)"):
        strategy().setup(SimpleNamespace(lora_rank=None))


def test_ema_counts_its_steps_and_round_trips_its_state(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    ema = EmaReference(decay=0.5)
    ema.setup(policy)
    fresh = ema.state_dict()
    initial = {k: w.clone() for k, w in fresh["weights"].items()}  # (a state dict's tensors alias the live weights)
    assert (fresh["strategy"], fresh["decay"], fresh["update_every"], fresh["version"], fresh["last_step"]) == (
        "ema", 0.5, 1, 0, None)
    for step in (1, 2, 3):
        perturb_lora(policy, seed=step)
        assert ema.on_step(policy, step)
    assert (ema.version, ema.last_step) == (3, 3)
    ema.samples.items["a red circle"] = torch.arange(3.0)
    state = ema.state_dict()
    assert set(state) == {"strategy", "decay", "update_every", "version", "last_step", "weights", "samples"}

    restored = EmaReference(decay=0.5)
    restored.setup(build_tiny_random_policy(seed=0))
    restored.load_state_dict(state)
    assert (restored.version, restored.last_step) == (3, 3)
    assert torch.equal(restored.samples.items["a red circle"], torch.arange(3.0))
    assert all(torch.equal(restored.adapter.params[k], p) for k, p in ema.adapter.params.items())
    assert any(not torch.equal(p, initial[k]) for k, p in state["weights"].items())  # the EMA moved
    assert not restored.on_step(policy, 3)  # step 3 was already taken before the checkpoint

    with pytest.raises(ValueError, match=r"^the checkpoint's reference state is for reference='frozen_base', this run "
                                         r"uses reference='ema'"):
        restored.load_state_dict({**state, "strategy": "frozen_base"})
    with pytest.raises(ValueError, match=r"^the checkpoint's EMA reference: LoRA keys do not match"):
        restored.load_state_dict({**state, "weights": {}})


def test_frozen_base_runs_in_eval_mode_and_restores_the_mode():
    policy = build_tiny_random_policy(seed=0)
    reference = FrozenBaseReference()
    reference.setup(policy)
    for training in (True, False):
        policy.denoiser.train(training)
        with reference.use(policy) as used:
            assert used is policy and not policy.denoiser.training
        assert policy.denoiser.training is training


def test_frozen_base_never_changes_and_round_trips_its_samples():
    reference = FrozenBaseReference()
    assert not reference.on_step(None, 5) and reference.version == 0
    reference.samples.items["a blue square"] = torch.ones(2)
    state = reference.state_dict()
    assert (set(state), state["strategy"], state["version"]) == ({"strategy", "version", "samples"}, "frozen_base", 0)
    restored = FrozenBaseReference()
    restored.load_state_dict(state)
    assert torch.equal(restored.samples.items["a blue square"], torch.ones(2))
    with pytest.raises(ValueError, match=r"^the checkpoint's reference state is for reference='ema', this run uses "
                                         r"reference='frozen_base'"):
        restored.load_state_dict({**state, "strategy": "ema"})
