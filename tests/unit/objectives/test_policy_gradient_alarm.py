"""The rest of `diffalign.objectives.policy_gradient`, found by mutation testing (docs/contributing.md#mutation-testing):
the train/rollout consistency alarm of `StoredTransitionMethod` on log-probs given directly (the end-to-end tests of
tests/unit/objectives/test_rollout_consistency.py run the online loop, too slow to map), the transitions an inner epoch
trains (``n = max(1, ⌊K · timestep_fraction⌋)``, the released loops' ``int(num_steps * timestep_fraction)``), the
stochastic-sampler check, and `ClippedPolicyGradient`'s defaults and bounds with every message."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from diffalign.objectives.policy_gradient import (
    CAUSES,
    LOGPROB_TOLERANCE,
    ClippedPolicyGradient,
    check_stochastic_sampler,
    per_sample_transitions,
    train_transitions,
)
from diffalign.runtime.faults import RolloutMismatchError


def mismatch(worst: str, tolerance: str, where: str) -> str:
    """The alarm's text, written out (docs/guides/reliability.md#trainrollout-consistency)."""
    return (f"the log-probs recomputed for training differ from the rollout's stored ones before the first update of "
            f"{where}: max |Δ log π| = {worst} > method.logprob_tolerance={tolerance} (the ratio π_θ / π_old should be "
            f"1 there, up to float noise). Likely causes: {CAUSES}")


def first_update(objective, epoch: int = 4):
    """`checked_updates` over two updates, entered into its first one (when the alarm checks)."""
    updates = objective.checked_updates(SimpleNamespace(epoch=epoch), iter([["update 0"], ["update 1"]]))
    assert next(updates) == ["update 0"]
    return updates


def test_the_alarm_settings_and_their_messages():
    objective = ClippedPolicyGradient(logprob_check="warn", logprob_tolerance=2)
    assert objective.logprob_check == "warn" and objective.logprob_tolerance == 2.0
    assert isinstance(objective.logprob_tolerance, float)
    assert ClippedPolicyGradient(logprob_check="off").logprob_check == "off"
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.logprob_check='loud' must be one of ('stop', 'warn', 'off').") + "$"):
        ClippedPolicyGradient(logprob_check="loud")
    for bad in (0.0, -1.0, float("nan")):  # (NaN is not > 0 either)
        with pytest.raises(ValueError, match="^" + re.escape(
                f"method.logprob_tolerance={bad} must be > 0 (default 0.001).") + "$"):
            ClippedPolicyGradient(logprob_tolerance=bad)
    assert LOGPROB_TOLERANCE == 1e-3


def test_stop_raises_during_the_first_update_only_beyond_the_tolerance():
    objective = ClippedPolicyGradient(logprob_tolerance=0.5)
    objective.check_logprobs(torch.tensor([9.0]), torch.tensor([0.0]), 0)  # outside an epoch's first update: nothing
    updates = first_update(objective)
    objective.check_logprobs(torch.tensor([1.5, 2.0]), torch.tensor([1.0, 2.0]), 1)  # |Δ| = 0.5: not beyond
    assert objective._worst == 0.5
    objective.check_logprobs(torch.tensor([float("nan")]), torch.tensor([0.0]), 1)  # NaN: left to the skip guard
    assert objective._worst == 0.5
    objective.check_logprobs(torch.tensor([0.1]), torch.tensor([0.0]), 1)
    assert objective._worst == 0.5  # the largest so far
    with pytest.raises(RolloutMismatchError) as raised:
        objective.check_logprobs(torch.tensor([1.0, -0.75]), torch.tensor([1.0, 0.0]), 2)  # |−0.75| is the largest
    assert str(raised.value) == (mismatch("0.75", "0.5", "epoch 4 (transition 2)") + ". The run stopped before "
                                 "training on it; pass method.logprob_check=warn to train anyway, or raise "
                                 "method.logprob_tolerance if this is float noise of your hardware")
    objective.check_logprobs(torch.tensor([9.0]), torch.tensor([0.0]), 2)  # it stopped checking
    # the second update is not checked
    objective = ClippedPolicyGradient(logprob_tolerance=0.5)
    updates = first_update(objective)
    assert next(updates) == ["update 1"]
    objective.check_logprobs(torch.tensor([9.0]), torch.tensor([0.0]), 0)
    assert list(updates) == []
    # the stored log-probs of another dtype are compared in float32
    objective = ClippedPolicyGradient(logprob_tolerance=0.5)
    first_update(objective)
    objective.check_logprobs(torch.tensor([0.25], dtype=torch.float16), torch.tensor([0.0], dtype=torch.float64), 0)
    assert objective._worst == 0.25


def test_warn_says_it_once_per_epoch_and_off_never_checks(caplog):
    objective = ClippedPolicyGradient(logprob_check="warn", logprob_tolerance=0.5)
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.policy_gradient"):
        updates = first_update(objective, epoch=3)
        objective.check_logprobs(torch.tensor([2.0]), torch.tensor([1.0]), 0)  # no raise in "warn"
        objective.check_logprobs(torch.tensor([0.0]), torch.tensor([0.0]), 1)
        assert caplog.messages == []  # said after the first update, once
        assert next(updates) == ["update 1"]
        assert caplog.messages == ["1 epoch(s) trained on anyway (method.logprob_check=warn): "
                                   + mismatch("1", "0.5", "epoch 3")]
        assert list(updates) == []
        # the next epoch starts from 0: a matching first update says nothing
        caplog.clear()
        updates = first_update(objective, epoch=4)
        objective.check_logprobs(torch.tensor([0.25]), torch.tensor([0.0]), 0)
        assert list(updates) == [["update 1"]] and caplog.messages == []
    off = ClippedPolicyGradient(logprob_check="off", logprob_tolerance=0.5)
    updates = first_update(off)
    off.check_logprobs(torch.tensor([9.0]), torch.tensor([0.0]), 0)
    assert list(updates) == [["update 1"]] and off._worst == 0.0


def test_transitions_trained_per_inner_epoch():
    """n = max(1, ⌊K · f⌋): K = 10, f = 0.99 -> 9; K = 4, f = 0.5 -> 2; K = 3, f = 0.1 -> 1 (at least one)."""
    assert train_transitions(10, 0.99, "first") == list(range(9))
    assert train_transitions(3, 0.1, "first") == [0]
    assert train_transitions(4, 1.0, "first") == [0, 1, 2, 3]
    chosen = train_transitions(10, 0.5, "random", torch.Generator().manual_seed(3))
    assert chosen == sorted(torch.randperm(10, generator=torch.Generator().manual_seed(3))[:5].tolist())
    assert train_transitions(4, 1.0, "random", torch.Generator().manual_seed(0)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.timestep_selection='last' must be one of ('first', 'random', 'per_sample').") + "$"):
        train_transitions(10, 0.5, "last")
    with pytest.raises(ValueError, match="^" + re.escape(
            "method.timestep_selection='per_sample': train_transitions gives one list for all rollouts, so it takes "
            "'first' or 'random'; 'per_sample' is per_sample_transitions.") + "$"):
        train_transitions(10, 0.5, "per_sample")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="^" + re.escape(f"method.timestep_fraction={bad} must be in (0, 1].")):
            train_transitions(10, bad, "first")
    # per sample: the same n, a (0, n) int64 tensor without rows, K >= 1
    chosen = per_sample_transitions(2, 10, 0.99, torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(1)
    assert chosen.tolist() == [torch.randperm(10, generator=g)[:9].tolist() for _ in range(2)]
    assert per_sample_transitions(3, 4, 1.0, torch.Generator().manual_seed(0)).shape == (3, 4)
    empty = per_sample_transitions(0, 10, 0.5)
    assert empty.shape == (0, 5) and empty.dtype == torch.long
    with pytest.raises(ValueError, match="^" + re.escape(
            "the trajectory has 0 stored transitions; per-sample selection needs at least 1.") + "$"):
        per_sample_transitions(2, 0, 0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="^" + re.escape(f"method.timestep_fraction={bad} must be in (0, 1].")):
            per_sample_transitions(2, 4, bad)


def config(sampler: dict):
    return SimpleNamespace(sampler=sampler, method=SimpleNamespace(_target_="diffalign.objectives.ddpo.DDPO"))


def test_a_policy_gradient_method_needs_a_stochastic_sampler():
    check_stochastic_sampler(config({"name": "ddim", "eta": 1.0}))
    ClippedPolicyGradient.check_config(config({"name": "flow_sde", "noise_level": 0.7}))
    message = ("method=DDPO is a policy-gradient method: it needs a stochastic sampler with log-probs, but "
               "sampler=ddim eta=0.0. Use sampler=flow_sde, cps_sde or window_sde (flow models, sampler.noise_level > "
               "0) or sampler=ddim (eps-models, sampler.eta > 0)")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        check_stochastic_sampler(config({"name": "ddim", "eta": 0.0}))
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        ClippedPolicyGradient.check_config(config({"name": "ddim", "eta": 0.0}), num_processes=2)


def test_clipped_policy_gradient_defaults_bounds_and_contract():
    objective = ClippedPolicyGradient()
    assert (objective.clip_range, objective.beta_kl, objective.kl_form, objective.detach_unconditional,
            objective.advantage, objective.timestep_fraction, objective.timestep_selection, objective.logprob_check,
            objective.logprob_tolerance) == (1e-4, 0.0, "code", False, "group", 1.0, "random", "stop", 1e-3)
    given = ClippedPolicyGradient(clip_range=0.2, beta_kl=0.04, kl_form="exact", detach_unconditional=True,
                                  advantage="per_prompt", timestep_fraction=0.5, timestep_selection="first")
    assert (given.clip_range, given.beta_kl, given.kl_form, given.detach_unconditional, given.advantage,
            given.timestep_fraction, given.timestep_selection) == (0.2, 0.04, "exact", True, "per_prompt", 0.5, "first")
    assert ClippedPolicyGradient(timestep_fraction=1.0, timestep_selection="per_sample").timestep_fraction == 1.0
    bad = {
        "clip_range": (0.0, "method.clip_range=0.0 must be > 0 (1e-4 in DDPO/Flow-GRPO)."),
        "beta_kl": (-0.1, "method.beta_kl=-0.1 must be >= 0."),
        "kl_form": ("approx", "method.kl_form='approx' must be 'code' or 'exact'."),
        "advantage": ("global", "method.advantage='global' must be 'group' or 'per_prompt'."),
        "timestep_selection": ("last", ("method.timestep_selection='last' must be one of ('first', 'random', "
                                        "'per_sample').")),
    }
    for field, (value, message) in bad.items():
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            ClippedPolicyGradient(**{field: value})
    for fraction in (0.0, 1.01):
        with pytest.raises(ValueError, match="^" + re.escape(f"method.timestep_fraction={fraction} must be in (0, 1]."
                                                             ) + "$"):
            ClippedPolicyGradient(timestep_fraction=fraction)
    # the contract members: no set-up, no extra state, updates_per_epoch x num_inner_epochs updates, no epoch stats
    assert objective.setup(None) is None and objective.checkpoint_states() == {}
    assert objective.epoch_updates(3, 2) == 6 and objective.prepare(None, None) == {}
    assert (ClippedPolicyGradient.data_flow, ClippedPolicyGradient.rollout_sampler_kind,
            ClippedPolicyGradient.log_prob_reduction) == ("online_trajectories", "sde", "mean")


def test_clipped_loss_on_a_given_log_ratio_with_a_weight():
    """The table of tests/unit/objectives/test_clip_binding.py (ε = 0.2; A = 2, 2, −1, −1; ρ = 1.5, 0.5, 1.5, 0.5):
    terms −2.4, −1.0, 1.5, 0.8, mean −0.275; the weight (GRPO-Guard's reweighting) multiplies it, a weight of 1 (int,
    float) leaves it; ``approx_kl`` is over the raw log π_θ − log π_old (here 0.2 for row 0 at k = 1), not the given
    log-ratio."""
    objective = ClippedPolicyGradient(clip_range=0.2)
    log_probs = torch.zeros(4, 3)
    log_probs[:, 1] = torch.tensor([-0.2, 0.0, 0.0, 0.0])
    trajectory = SimpleNamespace(log_probs=log_probs)
    step = SimpleNamespace(log_prob=torch.zeros(4))
    log_ratio = torch.tensor([1.5, 0.5, 1.5, 0.5]).log()
    adv = torch.tensor([2, 2, -1, -1])  # (integers: made float)
    weights = ((1, 1.0), (1.0, 1.0), (0.5, 0.5), (2, 2.0), (torch.tensor(0.5), 0.5), (torch.tensor(1.0), 1.0))
    for weight, factor in weights:
        loss, metrics = objective.clipped_loss(None, trajectory, adv, 1, step, log_ratio, weight=weight)
        torch.testing.assert_close(loss, torch.tensor(-0.275 * factor), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(metrics["ratio"], torch.tensor(1.0))
    assert metrics["clipfrac"].item() == 1.0 and metrics["kl"].item() == 0.0
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(0.5 * 0.2 ** 2 / 4))
    assert set(metrics) == {"loss", "ratio", "clipfrac", "approx_kl", "kl"}
    inside = objective.clipped_loss(None, trajectory, adv, 1, step, torch.tensor([1.1, 0.9, 1.0, 1.19]).log())[1]
    assert inside["clipfrac"].item() == 0.0


def test_the_warning_edges_its_kind_and_the_end_of_the_epoch(monkeypatch, caplog):
    """A worst |Δ| exactly at the tolerance is not a mismatch; in a training loop's console summary the warning is
    counted under "logprob_mismatch" (one per epoch); it is shared (every process sees the same agreed value), so only
    process 0 reports it; after the epoch's updates the alarm is off again."""
    from diffalign.runtime import console

    objective = ClippedPolicyGradient(logprob_check="warn", logprob_tolerance=0.5)
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.policy_gradient"):
        updates = first_update(objective)
        objective.check_logprobs(torch.tensor([0.5]), torch.tensor([0.0]), 0)
        assert list(updates) == [["update 1"]] and caplog.messages == []
    with console.console_summary() as counts:
        updates = first_update(objective)
        objective.check_logprobs(torch.tensor([0.75]), torch.tensor([0.0]), 0)
        list(updates)
        assert counts.pending() == {"logprob_mismatch": 1}
    caplog.clear()  # (the summary's "at the end" line)
    monkeypatch.setattr(console, "_first_process", lambda: False)
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.policy_gradient"):
        updates = first_update(objective)
        objective.check_logprobs(torch.tensor([0.75]), torch.tensor([0.0]), 0)
        list(updates)
    assert caplog.messages == []
    stop = ClippedPolicyGradient(logprob_tolerance=0.5)
    assert list(stop.checked_updates(SimpleNamespace(epoch=0), iter([["only update"]]))) == [["only update"]]
    stop.check_logprobs(torch.tensor([9.0]), torch.tensor([0.0]), 0)  # (after the epoch: not checked)


def test_one_stored_transition_is_enough_per_sample():
    assert per_sample_transitions(2, 1, 0.5, torch.Generator().manual_seed(0)).tolist() == [[0], [0]]


def test_the_worst_difference_is_agreed_over_the_processes(monkeypatch):
    """On several processes the largest |Δ| is all-reduced with MAX, so every process stops (or not) alike: here this
    process's 0.1 and another's 0.9 (a faked two-process group: the reduction sets the other's value)."""
    import torch.distributed as dist

    calls = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM):
        calls.append(op)
        assert op == dist.ReduceOp.MAX and tensor.shape == (1,)
        tensor.copy_(torch.maximum(tensor, torch.tensor([0.9])))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    objective = ClippedPolicyGradient(logprob_tolerance=0.5)
    first_update(objective)
    with pytest.raises(RolloutMismatchError, match=r"max \|Δ log π\| = 0\.9 > method\.logprob_tolerance=0\.5"):
        objective.check_logprobs(torch.tensor([0.1]), torch.tensor([0.0]), 0)
    assert calls == [dist.ReduceOp.MAX]
