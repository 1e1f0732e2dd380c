"""A batch whose rewards are all equal, in every advantage mode (issue 35): its std is 0, so A = (r − mean) / (0 + ε)
= 0 / ε = 0 exactly — finite, however ε is set — and every group counts as teaching nothing
(docs/methods/algorithms.md#group-advantages). Dropping ε from a branch turns it into 0 / 0 = NaN. Constant batches
are common: a binary verifier that every sample of an epoch passes (all 1) or fails (all 0)."""

from __future__ import annotations

import pytest
import torch

from diffalign.advantages import EpochAdvantages, PerPromptStatTracker, group_advantages

# 0 and 1: a binary reward all failed / all passed; 0.7: a value whose float32 batch std is not exactly 0
VALUES = [0.0, 1.0, 0.7, 123.5]
GROUPS = torch.tensor([0, 0, 0, 0, 5, 5, 5, 5])
PROMPTS = ["a red circle"] * 4 + ["a blue square"] * 4


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("std", ["group", "global", "none"])
@pytest.mark.parametrize("correction", [0, 1])
@pytest.mark.parametrize("eps", [1e-4, 1e-8])
def test_constant_batch_gives_zero_advantages_in_every_std_mode(value, std, correction, eps):
    adv, stats = group_advantages(torch.full((8,), value), GROUPS, std=std, correction=correction, eps=eps)
    assert adv.dtype == torch.float32 and adv.shape == (8,)
    assert torch.equal(adv, torch.zeros(8)), adv
    assert stats["zero_std_fraction"] == 1.0
    assert stats["reward_mean"] == pytest.approx(value, rel=1e-6)
    assert 0 <= stats["reward_std"] < 1e-6


@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_constant_batch_without_a_clip_stays_zero(std):
    adv, _ = group_advantages(torch.zeros(8), GROUPS, std=std, clip=None)
    assert torch.equal(adv, torch.zeros(8))


@pytest.mark.parametrize("value", VALUES)
def test_constant_batch_in_the_per_prompt_tracker(value):
    """DDPO's tracker: before `min_count` rewards the batch's statistics (std 0), after it the prompt's (std 0)."""
    tracker = PerPromptStatTracker(buffer_size=8, min_count=6)
    for _ in range(2):  # first call: 4 stored per prompt (batch stats); second: 8 (the prompt's own)
        adv = tracker.update(PROMPTS, torch.full((8,), value))
        assert torch.equal(adv, torch.zeros(8)), adv


@pytest.mark.parametrize("kind", ["group", "per_prompt", "per_reward"])
@pytest.mark.parametrize("std", ["group", "global"])
def test_constant_batch_for_every_epoch_advantage_kind(kind, std):
    advantages = EpochAdvantages(kind, std=std, eps=1e-8, correction=1, tracker_min_count=2)
    per_reward = torch.stack([torch.zeros(8), torch.ones(8)], dim=1)  # two rewards, each constant
    adv, stats = advantages(torch.ones(8), GROUPS, PROMPTS, lambda: per_reward)
    assert torch.equal(adv, torch.zeros(per_reward.shape if kind == "per_reward" else (8,)))
    assert stats["zero_std_fraction"] == 1.0


def test_one_constant_group_beside_a_varying_one():
    """std="group": the constant group gets 0 and counts as zero-std; the other one (rewards 0, 0, 1, 1: mean 0.5,
    population std 0.5) gets ±0.5 / (0.5 + 1e-4). std="global": the batch std (population) of
    (2, 2, 2, 2, 0, 0, 1, 1) is sqrt(mean(r²) − mean²) = sqrt(18/8 − (10/8)²) = sqrt(0.6875); the constant group is
    still 0 since its numerator is."""
    rewards = torch.tensor([2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 1.0, 1.0])
    adv, stats = group_advantages(rewards, GROUPS)
    expected = torch.tensor([0, 0, 0, 0, -1, -1, 1, 1]) * 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv, expected)
    assert stats["zero_std_fraction"] == 0.5
    adv, _ = group_advantages(rewards, GROUPS, std="global")
    expected = torch.tensor([0, 0, 0, 0, -0.5, -0.5, 0.5, 0.5]) / (0.6875**0.5 + 1e-4)
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("size", [3, 6, 7, 24])
@pytest.mark.parametrize("value", [0.3, 0.7, 2.9])
@pytest.mark.parametrize("std", ["group", "global"])
def test_constant_groups_of_any_size_are_exactly_zero(size, value, std):
    """Groups whose float32 mean is not the reward (7 × 0.7 summed in float32 is 6e-8 off): with DanceGRPO/ViPO's
    ε = 1e-8 that rounding was once divided by a std of the same size, giving A ≈ +0.8 to every member."""
    rewards = torch.full((2 * size,), value)
    gids = torch.tensor([0] * size + [1] * size)
    adv, stats = group_advantages(rewards, gids, std=std, eps=1e-8, correction=1)
    assert torch.equal(adv, torch.zeros(2 * size)), adv
    assert stats["zero_std_fraction"] == 1.0
    tracker = PerPromptStatTracker(buffer_size=size, min_count=size)
    assert torch.equal(tracker.update(["a"] * size + ["b"] * size, rewards), torch.zeros(2 * size))
