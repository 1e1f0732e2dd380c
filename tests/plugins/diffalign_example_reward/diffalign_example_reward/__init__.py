"""A complete diffalign reward plugin: the mean HSV-style saturation (max − min over RGB) of each image."""

from dataclasses import dataclass

import torch

from diffalign.types import RewardOutput


class Saturation:
    """Scores images `(B, 3, H, W)` in [0, 1] by ``scale · mean(max_c x − min_c x)``, in [0, scale]."""

    name = "example_saturation"
    differentiable = True

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        spread = images.amax(dim=-3) - images.amin(dim=-3)  # (B, H, W), or (B, F, H, W) for videos
        return RewardOutput(scores=self.scale * spread.flatten(1).mean(1).float(), maps=spread)


@dataclass
class SaturationConfig:
    _target_: str = "diffalign_example_reward.Saturation"
    scale: float = 1.0
