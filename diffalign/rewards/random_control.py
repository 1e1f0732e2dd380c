"""Random control: a reward with no signal, for measuring what the updates alone do to a model
(docs/results/learning.md).

Each image's score is a pseudo-random number in [0, 1), fixed by the image's 8-bit pixels and the reward's `seed`:
the first 8 bytes of SHA-256(seed ‖ round(255 · x) as uint8 bytes) read as an unsigned integer and divided by 2⁶⁴.
The same image always gets the same score, whatever else is in the batch, but nothing about the image makes a score
high, so no policy can raise the expected reward: every change a run makes is the drift of its noisy updates. Run a
method on it with the settings of a real run (`diffalign-bench --rewards control`) and compare the hacking monitors:
a held-out verifier drop that the control run shows as well is the update noise, not the reward being hacked.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from diffalign.config.schemas import config_schema
from diffalign.types import RewardOutput


def hashed_uniform(images: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A score in [0, 1) per image, a function of the image's 8-bit pixels and `seed` only.

    Args:
        images (`torch.Tensor`): `(B, C, H, W)` images or `(B, F, C, H, W)` videos, float in [0, 1].
        seed (`int`): selects another fixed assignment of scores.

    Returns:
        `torch.Tensor` of shape `(B,)`, float32 (float64 values rounded), on the input's device.

    Raises:
        ValueError: if the input is not 4-D/5-D, or a value is non-finite or outside [0, 1].
    """
    if images.ndim not in (4, 5):
        raise ValueError(f"random_control expects (B, C, H, W) images or (B, F, C, H, W) videos; got shape "
                         f"{tuple(images.shape)}")
    pixels = images.detach().float()
    if not torch.isfinite(pixels).all() or pixels.min() < 0 or pixels.max() > 1:
        raise ValueError("random_control expects finite pixel values in [0, 1]; decode and clamp the images first")
    quantised = (pixels * 255).round().to(torch.uint8).cpu().numpy()
    prefix = int(seed).to_bytes(8, "little", signed=True)
    scores = [int.from_bytes(hashlib.sha256(prefix + q.tobytes()).digest()[:8], "little") / 2.0**64
              for q in quantised]
    return torch.tensor(scores, dtype=torch.float32, device=images.device)


class RandomControl:
    """A no-signal control reward: a fixed pseudo-random score in [0, 1) per image (see the module docstring)."""

    modality = "any"
    differentiable = False
    name = "random_control"

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def __call__(self, images: torch.Tensor, prompts: list[str],
                 metadata: list[dict[str, Any]] | None = None) -> RewardOutput:
        """Scores `(B, C, H, W)` images or `(B, F, C, H, W)` videos in [0, 1]: `RewardOutput.scores` `(B,)` float32.

        Raises:
            ValueError: see `hashed_uniform`.
        """
        return RewardOutput(scores=hashed_uniform(images, self.seed))


@config_schema("reward", "random_control")
@dataclass
class RandomControlConfig:
    """Config of `RandomControl`."""

    _target_: str = "diffalign.rewards.random_control.RandomControl"
    seed: int = 0
