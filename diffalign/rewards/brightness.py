"""Brightness: a toy reward for checking that a training loop learns (docs/guides/rewards.md, "Toy rewards").

The score is the image's mean luma, Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601), in [0, 1]. It has a lot of
headroom in the tiny world, whose images are mostly black (mean about 0.1), every pixel can raise it, and it needs no
model, so a method that works raises it within a few epochs on a CPU, and a method that does not shows it at once.
It says nothing about prompt alignment: use it to test a loop, then the verifier (``geneval_shapes``) to align.
A rise bought by collapse (every image one bright texture) shows in the hacking monitors (held-out verifier, diversity),
which the learning benchmark reports beside it (`diffalign.evaluation.bench`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffalign.config.schemas import config_schema
from diffalign.types import RewardOutput

LUMA_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's convert("L")


def luma(images: torch.Tensor) -> torch.Tensor:
    """Per-pixel luma of `(B, 3, H, W)` images or `(B, F, 3, H, W)` videos in [0, 1]: `(B, H, W)` or `(B, F, H, W)`.

    Raises:
        ValueError: if the channel axis (``-3``) does not have 3 entries, or a value is non-finite or outside [0, 1].
    """
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(f"brightness expects (B, 3, H, W) images or (B, F, 3, H, W) videos in [0, 1]; got shape "
                         f"{tuple(images.shape)}")
    pixels = images.detach().float()
    if not torch.isfinite(pixels).all() or pixels.min() < 0 or pixels.max() > 1:
        raise ValueError("brightness expects finite pixel values in [0, 1]; decode and clamp the images first")
    weights = torch.tensor(LUMA_WEIGHTS, device=pixels.device).view(3, 1, 1)
    return (pixels * weights).sum(dim=-3)


class Brightness:
    """Mean luma of each image (or video), a toy reward with large headroom for checking that a method learns.

    Returns scores `(B,)` in [0, 1] and the luma itself as the dense map (`(B, H, W)`, or `(B, F, H, W)` for videos,
    the `RewardOutput.maps` convention).
    """

    modality = "any"  # images and videos alike
    differentiable = False
    name = "brightness"

    def __init__(self) -> None:  # no settings (the config dataclass has no fields)
        pass

    def __call__(self, images: torch.Tensor, prompts: list[str],
                 metadata: list[dict[str, Any]] | None = None) -> RewardOutput:
        """Scores `(B, 3, H, W)` images or `(B, F, 3, H, W)` videos in [0, 1].

        Returns:
            `RewardOutput` with ``scores`` `(B,)` float32 = the mean luma and ``maps`` the per-pixel luma.

        Raises:
            ValueError: see `luma`.
        """
        maps = luma(images)
        return RewardOutput(scores=maps.flatten(1).mean(1), maps=maps)


@config_schema("reward", "brightness")
@dataclass
class BrightnessConfig:
    """Config of `Brightness` (no settings)."""

    _target_: str = "diffalign.rewards.brightness.Brightness"
