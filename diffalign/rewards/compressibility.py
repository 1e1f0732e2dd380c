"""JPEG (in)compressibility rewards of DDPO (Black et al., [arXiv:2305.13301](https://arxiv.org/abs/2305.13301) §6.1).

Each image is encoded as JPEG at quality 95 with PIL; the reward is the negative file size in kilobytes
(compressibility) or the positive size (incompressibility). 1 kB = 1000 bytes, as in the authors' code.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from diffalign.config.schemas import config_schema
from diffalign.types import RewardOutput


def jpeg_size_kb(images: torch.Tensor, quality: int) -> torch.Tensor:
    """JPEG file size of each image (arXiv:2305.13301 §6.1).

    Each image is quantised as ``round(255 · x)`` to uint8, converted with PIL (mode ``RGB`` for 3 channels, ``L``
    for 1) and saved as baseline JPEG at `quality`, no extra options. Images are encoded one at a time, so a score
    never depends on the rest of the batch. Videos are scored by the mean size of their frames.

    Args:
        images (`torch.Tensor`):
            `(B, C, H, W)` images or `(B, F, C, H, W)` videos, float in [0, 1], `C` in {1, 3}. Gradients are not
            propagated (JPEG encoding is not differentiable).
        quality (`int`): JPEG quality in [1, 100].

    Returns:
        `torch.Tensor` of shape `(B,)`, float32, on the input's device: sizes in kB (bytes / 1000), > 0.

    Raises:
        ValueError: if the shape is not 4-D/5-D with 1 or 3 channels, or a value is non-finite or outside [0, 1].
    """
    if images.ndim not in (4, 5) or images.shape[-3] not in (1, 3):
        raise ValueError(
            f"JPEG reward expects (B, C, H, W) images or (B, F, C, H, W) videos with C in {{1, 3}}; got shape "
            f"{tuple(images.shape)}. Pass RGB images in channels-first layout."
        )
    pixels = images.detach().float()
    if not torch.isfinite(pixels).all():
        raise ValueError("JPEG reward got non-finite pixel values; decode latents to finite images in [0, 1] first.")
    low, high = pixels.min().item(), pixels.max().item()
    if low < 0.0 or high > 1.0:
        raise ValueError(
            f"JPEG reward expects pixels in [0, 1]; got range [{low:.4g}, {high:.4g}]. Map [-1, 1] outputs with "
            "(x + 1) / 2 and clamp before scoring."
        )
    frames = pixels.reshape(-1, *pixels.shape[-3:])  # (B·F, C, H, W)
    array = (frames * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()  # (B·F, H, W, C)
    sizes = []
    for frame in array:
        buffer = io.BytesIO()
        Image.fromarray(frame[..., 0] if frame.shape[-1] == 1 else frame).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    per_frame = torch.tensor(np.asarray(sizes, dtype=np.float32))
    return per_frame.reshape(images.shape[0], -1).mean(dim=1).to(images.device)


class _JpegSizeReward:
    """What both JPEG rewards share: ``sign · size_kB`` of each image saved as JPEG at `quality` (`jpeg_size_kb`).

    Raises:
        ValueError: if `quality` is not an integer in [1, 100].
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    differentiable = False
    name: str
    sign: float

    def __init__(self, quality: int = 95):
        if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
            raise ValueError(f"reward.{self.name}.quality={quality!r} must be an integer JPEG quality in [1, 100] (DDPO "
                             "uses 95).")
        self.quality = quality

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        """Scores `(B, C, H, W)` images or `(B, F, C, H, W)` videos in [0, 1]; see `jpeg_size_kb`.

        Returns:
            `RewardOutput`: ``scores`` `(B,)` float32 = ``sign · size_kB``; ``info["size_kb"]`` the sizes.
        """
        size_kb = jpeg_size_kb(images, self.quality)
        return RewardOutput(scores=self.sign * size_kb, info={"size_kb": size_kb})


class JpegCompressibility(_JpegSizeReward):
    """DDPO's compressibility reward: ``-size_kB`` of the image saved as JPEG (arXiv:2305.13301 §6.1), < 0.

    Higher is better, so training makes images easier to compress (flatter, less detail).

    Args:
        quality (`int`, defaults to 95): JPEG quality in [1, 100].

    Raises:
        ValueError: if `quality` is outside [1, 100].
    """

    name = "jpeg_compressibility"
    sign = -1.0


@config_schema("reward", "jpeg_compressibility")
@dataclass
class JpegCompressibilityConfig:
    """Config of `JpegCompressibility`; the fields mirror its `__init__` arguments."""

    _target_: str = "diffalign.rewards.compressibility.JpegCompressibility"
    quality: int = 95


class JpegIncompressibility(_JpegSizeReward):
    """DDPO's incompressibility reward: ``+size_kB`` of the image saved as JPEG (arXiv:2305.13301 §6.1), > 0.

    Higher is better, so training adds detail and high-frequency texture.

    Args:
        quality (`int`, defaults to 95): JPEG quality in [1, 100].

    Raises:
        ValueError: if `quality` is outside [1, 100].
    """

    name = "jpeg_incompressibility"
    sign = 1.0


@config_schema("reward", "jpeg_incompressibility")
@dataclass
class JpegIncompressibilityConfig:
    """Config of `JpegIncompressibility`; the fields mirror its `__init__` arguments."""

    _target_: str = "diffalign.rewards.compressibility.JpegIncompressibility"
    quality: int = 95
