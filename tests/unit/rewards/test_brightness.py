"""The toy `brightness` reward: mean BT.601 luma, by hand."""

from __future__ import annotations

import pytest
import torch

from diffalign.config.registry import registered_reward_configs
from diffalign.rewards.brightness import Brightness


def test_brightness_is_the_mean_bt601_luma_by_hand():
    images = torch.zeros(2, 3, 2, 2)
    images[0, 0] = 1.0  # pure red everywhere: 0.299
    images[1, :, 0, 0] = torch.tensor([0.2, 0.4, 1.0])  # one pixel: 0.0598 + 0.2348 + 0.114 = 0.4086
    out = Brightness()(images, ["a", "b"])
    torch.testing.assert_close(out.scores, torch.tensor([0.299, 0.4086 / 4]))
    assert out.maps.shape == (2, 2, 2)
    torch.testing.assert_close(out.maps[1, 0, 0], torch.tensor(0.4086))
    videos = torch.stack([torch.full((3, 2, 2), 0.5), torch.ones(3, 2, 2)]).unsqueeze(0)  # (1, F=2, 3, 2, 2)
    video = Brightness()(videos, ["v"])
    torch.testing.assert_close(video.scores, torch.tensor([0.75]))  # the weights sum to 1
    assert video.maps.shape == (1, 2, 2, 2)


def test_brightness_refuses_bad_images_and_is_a_registered_reward():
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        Brightness()(torch.full((1, 3, 2, 2), 1.5), ["a"])
    with pytest.raises(ValueError, match="\\(B, 3, H, W\\)"):
        Brightness()(torch.zeros(1, 1, 2, 2), ["a"])
    assert "brightness" in registered_reward_configs()  # registered by its own file, no entry point
