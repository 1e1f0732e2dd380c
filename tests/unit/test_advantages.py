"""Group-relative advantages and DDPO's per-prompt tracker against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from diffalign.advantages import PerPromptStatTracker, group_advantages


def test_rewards_1_2_3_4_give_the_hand_computed_advantages():
    a, stats = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4, dtype=torch.long), eps=0.0)
    std = math.sqrt(1.25)  # population std of 1..4: mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5, /4
    torch.testing.assert_close(a, torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std)
    assert stats["zero_std_fraction"] == 0.0


def test_a_group_with_equal_rewards_gives_zero_advantages_and_no_nan():
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0, 1.0])
    ids = torch.tensor([5, 5, 5, 9, 9, 9])
    a, stats = group_advantages(rewards, ids)
    assert torch.isfinite(a).all()
    assert torch.equal(a[:3], torch.zeros(3))
    assert stats["zero_std_fraction"] == 0.5
    a_global, _ = group_advantages(rewards, ids, std="global")
    assert torch.equal(a_global[:3], torch.zeros(3)) and torch.isfinite(a_global).all()


def test_global_std_and_clipping():
    rewards = torch.tensor([0.0, 1.0, 0.0, 3.0])
    ids = torch.tensor([0, 0, 1, 1])
    a, _ = group_advantages(rewards, ids, std="global", eps=0.0)
    centred = torch.tensor([-0.5, 0.5, -1.5, 1.5])
    torch.testing.assert_close(a, centred / rewards.std(unbiased=False))
    big, _ = group_advantages(torch.tensor([0.0] * 99 + [1.0]), torch.zeros(100, dtype=torch.long))
    assert big.max() == 5.0  # (1 − 0.01)/0.0995 = 9.95, clipped to 5


def test_non_finite_rewards_are_rejected():
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))


def test_per_prompt_tracker_uses_batch_stats_until_min_count_then_its_buffer():
    tracker = PerPromptStatTracker(buffer_size=4, min_count=4, eps=0.0)
    a = tracker.update(["p", "p", "q", "q"], torch.tensor([1.0, 3.0, 0.0, 4.0]))
    batch_mean, batch_std = 2.0, torch.tensor([1.0, 3.0, 0.0, 4.0]).std(unbiased=False)
    torch.testing.assert_close(a, (torch.tensor([1.0, 3.0, 0.0, 4.0]) - batch_mean) / batch_std)
    a = tracker.update(["p", "p"], torch.tensor([5.0, 7.0]))  # p's buffer now [1, 3, 5, 7]: mean 4, std sqrt(5)
    torch.testing.assert_close(a, (torch.tensor([5.0, 7.0]) - 4.0) / math.sqrt(5.0))
    restored = PerPromptStatTracker(buffer_size=4, min_count=4, eps=0.0)
    restored.load_state_dict(tracker.state_dict())
    assert restored.state_dict() == tracker.state_dict()


def test_best_of_n_keeps_the_extremes_of_each_group():
    from diffalign.advantages import best_of_n_rows

    rewards = torch.tensor([0.1, 0.9, 0.5, 0.3, 1.0, 2.0, 3.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 7, 7, 7, 7])
    assert best_of_n_rows(rewards, groups, 2).tolist() == [0, 1, 4, 7]
    assert best_of_n_rows(rewards, groups, 4).tolist() == list(range(8))  # N = G: a no-op
    with pytest.raises(ValueError, match="even"):
        best_of_n_rows(rewards, groups, 3)


def test_sample_std_and_eps_of_the_released_vipo_code_by_hand():
    # DanceGRPO/ViPO (train_vipo_*.py): (r − mean) / (group_rewards.std() + 1e-8), torch's sample std (n − 1).
    # Rewards 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, sample variance 5/3.
    a, _ = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4, dtype=torch.long), correction=1,
                            eps=1e-8)
    s = math.sqrt(5 / 3)  # 1.2909944...
    torch.testing.assert_close(a, torch.tensor([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]))
    torch.testing.assert_close(a, torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895]), rtol=0, atol=1e-6)
    # flow_grpo (stat_tracking.py): np.std (population) + 1e-4: 5/4 -> std sqrt(1.25) = 1.1180340
    p, _ = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.zeros(4, dtype=torch.long), correction=0,
                            eps=1e-4)
    torch.testing.assert_close(p, torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (math.sqrt(1.25) + 1e-4))
    # groups of two: the population std is |r1 − r2|/2 (A = ±1), the sample std |r1 − r2|/√2 (A = ±1/√2)
    rewards, ids = torch.tensor([0.0, 1.0, 0.0, 3.0]), torch.tensor([0, 0, 1, 1])
    two, _ = group_advantages(rewards, ids, correction=1, eps=1e-8)
    torch.testing.assert_close(two, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / math.sqrt(2))
    two_pop, _ = group_advantages(rewards, ids, correction=0, eps=1e-8)
    torch.testing.assert_close(two_pop, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    # global sample std: batch mean 1, deviations (−1, 0, −1, 2), SS 6, /3 -> √2; numerators stay group-centred
    glob, _ = group_advantages(rewards, ids, std="global", correction=1, eps=1e-8)
    torch.testing.assert_close(glob, torch.tensor([-0.5, 0.5, -1.5, 1.5]) / math.sqrt(2))
    with pytest.raises(ValueError, match="online.advantage_std_correction"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]), correction=1)
    with pytest.raises(ValueError, match="online.advantage_std_correction"):
        group_advantages(rewards, ids, correction=2)


@pytest.mark.parametrize("recipe,correction,eps", [
    (None, 0, 1e-4),                      # online/default.yaml: flow_grpo's np.std + 1e-4
    ("flow_grpo_sd35_geneval", 0, 1e-4),  # [CODE flow_grpo/stat_tracking.py]
    ("dgpo_sd35_geneval", 0, 1e-4),       # DGPO ships flow_grpo's stat tracker
    ("vipo_wan", 1, 1e-8),                # [CODE train_vipo_wan_fsdp.py: group_rewards.std() + 1e-8]
    ("tiny_vipo_image", 1, 1e-8),
    ("tiny_vipo_wan", 1, 1e-8),
])
def test_recipes_set_the_released_std_and_eps(recipe, correction, eps, tmp_path):
    from conftest import compose_cfg

    cfg = compose_cfg([f"output_dir={tmp_path}"] + ([f"recipe={recipe}"] if recipe else []))
    assert cfg.online.advantage_std_correction == correction and cfg.online.advantage_eps == eps
