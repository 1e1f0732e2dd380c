"""diffalign.advantages on cases computed by hand: the clip, the statistics, the DDPO tracker's buffer, clip and state,
`EpochAdvantages` passing its options on, best-of-N selection, and the one-line errors (issue 35: the survivors of
``python scripts/mutation.py advantages``)."""

from __future__ import annotations

import re

import pytest
import torch

from diffalign.advantages import EpochAdvantages, PerPromptStatTracker, best_of_n_rows, group_advantages


def test_clip_binds_on_both_sides():
    """Rewards (0, 1) in one group: centred ±0.5, population std 0.5, A = ±0.5 / (0.5 + 1e-4) ≈ ±0.9998, clipped to
    ±0.5; without a clip they stay."""
    adv, _ = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), clip=0.5)
    assert adv.tolist() == [-0.5, 0.5]
    adv, _ = group_advantages(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), clip=None)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]) / (0.5 + 1e-4))


def test_reward_statistics_are_the_batch_population_mean_and_std():
    """Rewards 0, 1, 2, 3: mean 1.5, population std sqrt(5/4) (whatever the correction of the advantages)."""
    for correction in (0, 1):
        _, stats = group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0, 0, 1, 1]),
                                    correction=correction)
        assert stats["reward_mean"] == 1.5
        assert stats["reward_std"] == pytest.approx(1.25**0.5, rel=1e-6)


def test_global_std_of_one_reward_with_the_sample_std_is_refused():
    message = "1 reward(s) have no sample std (online.advantage_std_correction=1)"
    with pytest.raises(ValueError, match=re.escape(message)):
        group_advantages(torch.tensor([1.0]), torch.tensor([0]), std="global", correction=1)
    adv, _ = group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), std="global", correction=1)
    # sample std of (1, 2) = sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5]) / (0.5**0.5 + 1e-4))


@pytest.mark.parametrize("kwargs, message", [
    ({"std": "batch"}, "online.advantage_std must be 'group', 'global' or 'none', got 'batch'."),
    ({"correction": 2}, ("online.advantage_std_correction=2 must be 0 (population std, flow_grpo) or 1 (sample std, "
                         "DanceGRPO/ViPO).")),
])
def test_bad_options_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), **kwargs)


def test_bad_rewards_name_the_problem():
    with pytest.raises(ValueError, match=re.escape("rewards (3,) and group_ids (2,) must match.")):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=re.escape("rewards (3,) and group_ids (2,) must match.")):
        best_of_n_rows(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0]), 2)
    nan = "rewards contain NaN/inf; fix the reward (diffalign never replaces them silently)."
    with pytest.raises(ValueError, match=f"^{re.escape(nan)}$"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=f"^{re.escape(nan)}$"):
        PerPromptStatTracker().update(["a", "b"], torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match=re.escape("2 prompts for 3 rewards.")):
        PerPromptStatTracker().update(["a", "b"], torch.tensor([1.0, 2.0, 3.0]))


# ------------------------------------------------------------------------------------------ DDPO's stat tracker


def test_tracker_defaults_are_ddpo_pytorchs():
    """ddpo-pytorch's PerPromptStatTracker: a buffer of 16, 16 rewards before a prompt's own statistics, ε = 1e-6, and
    its advantage clip of 5 (``config.train.adv_clip_max``)."""
    tracker = PerPromptStatTracker()
    assert (tracker.buffer_size, tracker.min_count, tracker.eps, tracker.clip) == (16, 16, 1e-6, 5.0)


@pytest.mark.parametrize("kwargs", [{"buffer_size": 0}, {"min_count": 0}])
def test_tracker_sizes_below_one_are_refused(kwargs):
    with pytest.raises(ValueError, match=f"^{re.escape('`buffer_size` and `min_count` must be >= 1.')}$"):
        PerPromptStatTracker(**kwargs)
    PerPromptStatTracker(buffer_size=1, min_count=1)  # the smallest allowed


def test_tracker_eps_and_clip_by_hand():
    """One prompt, rewards (0, 1): batch mean 0.5, population std 0.5; with ε = 0.5, A = ±0.5 / (0.5 + 0.5) = ±0.5,
    clipped to ±0.3; no clip keeps ±0.5."""
    rewards = torch.tensor([0.0, 1.0])
    assert PerPromptStatTracker(eps=0.5, clip=None).update(["a", "a"], rewards).tolist() == [-0.5, 0.5]
    assert PerPromptStatTracker(eps=0.5, clip=0.3).update(["a", "a"], rewards).tolist() == pytest.approx([-0.3, 0.3])


def test_tracker_keeps_the_last_buffer_size_rewards_of_each_prompt():
    """buffer_size 2, min_count 2: after rewards 10, 0, 2 the buffer is (0, 2): mean 1, std 1, so the reward 2 of the
    third call gets (2 − 1) / (1 + ε) (a buffer of 3 would give (2 − 4) / std(10, 0, 2))."""
    tracker = PerPromptStatTracker(buffer_size=2, min_count=2, eps=1e-6, clip=None)
    tracker.update(["a"], torch.tensor([10.0]))
    tracker.update(["a"], torch.tensor([0.0]))
    adv = tracker.update(["a"], torch.tensor([2.0]))
    assert list(tracker.buffers["a"]) == [0.0, 2.0]
    assert float(adv) == pytest.approx(1 / (1 + 1e-6), rel=1e-6)


def test_tracker_state_round_trip_keeps_the_buffer_size():
    tracker = PerPromptStatTracker(buffer_size=2, min_count=2)
    tracker.load_state_dict({"buffers": {"a": [5.0, 6.0, 7.0]}})
    assert list(tracker.buffers["a"]) == [6.0, 7.0]  # (maxlen 2 keeps the newest)
    tracker.update(["a"], torch.tensor([8.0]))
    assert tracker.state_dict() == {"buffers": {"a": [7.0, 8.0]}}
    tracker.load_state_dict({})
    assert tracker.buffers == {}


# ------------------------------------------------------------------------------------------------ EpochAdvantages


def test_epoch_advantages_defaults_are_the_released_ones():
    advantages = EpochAdvantages("per_prompt")
    assert advantages.options == {"std": "group", "clip": 5.0, "correction": 0, "eps": 1e-4}
    tracker = advantages.tracker
    assert (tracker.buffer_size, tracker.min_count, tracker.clip) == (16, 16, 5.0)
    assert EpochAdvantages("group").tracker is None and EpochAdvantages("group").state_dict() == {}
    with pytest.raises(ValueError, match=re.escape("the method's advantage='ppo' must be one of ('group', "
                                                   "'per_prompt', 'per_reward')")):
        EpochAdvantages("ppo")


def test_epoch_advantages_pass_their_options_on():
    """std="global", correction 1, ε 0.5, clip 0.4 on rewards (0, 1, 2, 3) in groups (0, 0, 1, 1): centred ±0.5, the
    batch sample std sqrt(5/3), A = ±0.5 / (sqrt(5/3) + 0.5) ≈ ±0.2795 (under the clip)."""
    rewards, gids = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0, 0, 1, 1])
    expected = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / ((5 / 3) ** 0.5 + 0.5)
    advantages = EpochAdvantages("group", std="global", clip=0.4, correction=1, eps=0.5)
    torch.testing.assert_close(advantages(rewards, gids, ["p"] * 4, None)[0], expected)
    per_reward = EpochAdvantages("per_reward", std="global", clip=0.25, correction=1, eps=0.5)
    adv, stats = per_reward(rewards, gids, ["p"] * 4, lambda: torch.stack([torch.ones(4), rewards], 1))
    torch.testing.assert_close(adv, torch.stack([torch.zeros(4), expected.clamp(-0.25, 0.25)], 1))
    assert stats["zero_std_fraction"] == 1.0  # the first reward's (constant: every group teaches nothing)


def test_epoch_advantages_per_prompt_uses_its_tracker_settings_and_state():
    """min_count 1, buffer 1, clip 0.3: each prompt is normalised by its own last reward (std 0), so A = 0; after a
    state round trip the buffers carry over."""
    advantages = EpochAdvantages("per_prompt", clip=0.3, tracker_buffer_size=1, tracker_min_count=1)
    adv, _ = advantages(torch.tensor([1.0, 5.0]), torch.tensor([0, 1]), ["a", "b"], None)
    assert adv.tolist() == [0.0, 0.0]
    assert advantages.tracker.clip == 0.3
    state = advantages.state_dict()
    assert state == {"buffers": {"a": [1.0], "b": [5.0]}}
    restored = EpochAdvantages("per_prompt", clip=0.3, tracker_buffer_size=1, tracker_min_count=1)
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    # min_count 2 with one stored reward: the batch (1, 5) statistics, mean 3, std 2 → ±2 / 2 = ±1, clipped to ±0.3
    fresh = EpochAdvantages("per_prompt", clip=0.3, tracker_buffer_size=4, tracker_min_count=2)
    assert fresh(torch.tensor([1.0, 5.0]), torch.tensor([0, 1]), ["a", "b"], None)[0].tolist() == pytest.approx(
        [-0.3, 0.3])


# ------------------------------------------------------------------------------------------------------ best of N


def test_best_of_n_keeps_the_extremes_of_each_group_by_hand():
    """n = 2 keeps each group's lowest and highest reward; a group of exactly n rows keeps all of them; ties are broken
    by row order (the first of the lowest, the last of the highest)."""
    rewards = torch.tensor([5.0, 1.0, 3.0, 2.0, 9.0, 0.0, 7.0, 7.0, 7.0, 7.0])
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
    assert best_of_n_rows(rewards, gids, 2).tolist() == [0, 1, 4, 5, 6, 9]
    assert best_of_n_rows(rewards, gids, 4).tolist() == list(range(10))
    with pytest.raises(ValueError, match=re.escape("online.best_of_n=3 must be an even number >= 2")):
        best_of_n_rows(rewards, gids, 3)
