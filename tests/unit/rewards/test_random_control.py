"""The no-signal control reward (`diffalign.rewards.random_control`): fixed, batch-independent, uniform, no signal."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from diffalign.config.registry import registered_reward_configs
from diffalign.rewards.random_control import RandomControl


def test_score_is_the_documented_hash_of_the_8bit_pixels():
    image = torch.tensor([[[[0.0, 0.5], [1.0, 0.2]]]]).expand(1, 3, 2, 2)
    by_hand = np.array([[[0, 128], [255, 51]]] * 3, dtype=np.uint8)  # round(255 x): 127.5 -> 128, 51.0 -> 51
    digest = hashlib.sha256((7).to_bytes(8, "little", signed=True) + by_hand.tobytes()).digest()
    expected = int.from_bytes(digest[:8], "little") / 2.0**64
    assert RandomControl(seed=7)(image, ["p"]).scores.item() == pytest.approx(expected, abs=1e-7)


def test_scores_do_not_depend_on_the_batch_and_change_with_the_seed():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(6, 3, 8, 8, generator=g)
    reward = RandomControl()
    whole = reward(images, ["p"] * 6).scores
    assert torch.equal(whole[2:4], reward(images[2:4], ["p"] * 2).scores)
    assert torch.equal(whole, reward(images, ["other prompt"] * 6).scores)  # the prompt plays no part
    assert not torch.equal(whole, RandomControl(seed=1)(images, ["p"] * 6).scores)
    video = RandomControl()(images.view(2, 3, 3, 8, 8), ["v", "w"])
    assert video.scores.shape == (2,)


def test_scores_are_uniform_and_carry_no_brightness_signal():
    g = torch.Generator().manual_seed(1)
    level = torch.rand(2000, 1, 1, 1, generator=g)
    images = (level * torch.rand(2000, 3, 4, 4, generator=g)).clamp(0, 1)
    scores = RandomControl()(images, ["p"] * 2000).scores.double()
    assert 0 <= scores.min() and scores.max() < 1
    assert scores.mean().item() == pytest.approx(0.5, abs=4 * (1 / 12) ** 0.5 / 2000**0.5)  # 4 s.e. of U(0, 1)
    brightness = images.double().flatten(1).mean(1)
    corr = torch.corrcoef(torch.stack([scores, brightness]))[0, 1].item()
    assert abs(corr) < 4 / 2000**0.5  # no correlation with brightness beyond 4 s.e. of a null correlation


def test_bad_input_is_refused_and_the_plugin_is_registered():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        RandomControl()(torch.full((1, 3, 2, 2), 1.5), ["a"])
    with pytest.raises(ValueError, match="shape"):
        RandomControl()(torch.zeros(3, 2, 2), ["a"])
    assert "random_control" in registered_reward_configs()  # registered by its own file, no entry point
