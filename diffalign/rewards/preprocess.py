"""Input conversion and CLIP-style preprocessing shared by the model-based rewards.

Every model-based reward accepts the same inputs: a float tensor `(B, 3, H, W)` (or videos `(B, F, 3, H, W)`) in the
range the reward is configured for (``value_range``: ``[0, 1]``, diffalign's contract, or ``[-1, 1]``, the VAE output
convention), a uint8 tensor (0..255), or PIL images (one or a list). `to_pixels` maps all of them to float32 in
[0, 1]; `clip_preprocess` then applies the model's own transform with differentiable tensor ops: resize the shorter
side to ``size`` (bicubic, antialiased), centre-crop ``size × size``, normalise with the model's mean and std — the
order of OpenAI CLIP's, open_clip's and transformers' ``CLIPImageProcessor`` (never squash to a square, as a
transformers feature extractor once did; never normalise before mapping the range:
docs/guides/field_cases.md#reward-preprocessing-matches-the-reference-transform).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

ImageInput = torch.Tensor | Image.Image | Sequence[Image.Image]


def to_pixels(images: ImageInput, value_range: Sequence[float] = (0.0, 1.0), field: str = "reward.value_range"
              ) -> torch.Tensor | list[torch.Tensor]:
    """Converts reward inputs to float32 pixels in [0, 1], channels first.

    Args:
        images: a float tensor `(B, 3, H, W)` or `(B, F, 3, H, W)` with values in `value_range`; a uint8 tensor of the
            same shapes (0..255, `value_range` ignored); a PIL image; or a list of PIL images (converted to RGB).
        value_range (`Sequence[float]`, defaults to `(0.0, 1.0)`): `(low, high)` of float inputs; `(-1.0, 1.0)` for
            VAE-convention images. Values are mapped by ``(x - low) / (high - low)``.
        field (`str`): the config field named in errors.

    Returns:
        A float32 tensor of the input's shape in [0, 1] (on the input's device, gradients kept), or, for a list of
        PIL images of different sizes, a list of `(3, H_i, W_i)` tensors.

    Raises:
        ValueError: if `value_range` is not `(low, high)` with low < high, a float tensor holds non-finite values or
            values outside `value_range` (the message says which range to configure), or the shape is not
            `(B, 3, H, W)` / `(B, F, 3, H, W)`.
        TypeError: for any other input type.
    """
    if len(value_range) != 2 or not value_range[0] < value_range[1]:
        raise ValueError(f"{field}={list(value_range)} must be [low, high] with low < high, e.g. [0, 1] or [-1, 1]")
    if isinstance(images, Image.Image):
        images = [images]
    if isinstance(images, (list, tuple)):
        if not images or not all(isinstance(im, Image.Image) for im in images):
            raise TypeError("a list of images must hold PIL images; pass tensors as one (B, 3, H, W) tensor")
        arrays = [torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
                  for im in images]
        tensors = [a.float() / 255.0 for a in arrays]
        if len({tuple(t.shape) for t in tensors}) == 1:
            return torch.stack(tensors)
        return tensors
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"rewards take a tensor or PIL images, got {type(images).__name__}")
    if images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError(f"images must be (B, 3, H, W) or videos (B, F, 3, H, W), got shape {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    x = images.float()
    if not torch.isfinite(x.detach()).all():
        raise ValueError("images hold non-finite values; decode latents to finite images first")
    low, high = float(value_range[0]), float(value_range[1])
    lo, hi = float(x.detach().min()), float(x.detach().max())
    if lo < low or hi > high:
        hint = " (looks like VAE output: set it to [-1, 1])" if lo < 0 and low >= 0 else ""
        raise ValueError(f"images have values in [{lo:.4g}, {hi:.4g}] but {field}=[{low:g}, {high:g}]{hint}; "
                         "configure the range the images are in (clamp VAE overshoot first)")
    return (x - low) / (high - low)


def resize_shorter_side(x: torch.Tensor, size: int) -> torch.Tensor:
    """Resizes `(B, 3, H, W)` pixels in [0, 1] so the shorter side is `size` (longer side ``int(size · long /
    short)``, torchvision's rule), bicubic with antialiasing, clamped to [0, 1]; a no-op when the shorter side already
    is `size`."""
    h, w = x.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    if short == size:
        return x
    new_long = int(size * long / short)
    new_h, new_w = (size, new_long) if h <= w else (new_long, size)
    # clamped like PIL's uint8 resize (bicubic overshoots at edges by up to ~3/255); the gradient is kept inside
    return F.interpolate(x, size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False).clamp(0, 1)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """Centre-crops `(B, 3, H, W)` to `size × size` (torchvision's offsets: ``round((H - size) / 2)``)."""
    h, w = x.shape[-2:]
    if h < size or w < size:
        raise ValueError(f"cannot centre-crop {h}x{w} to {size}x{size}; resize first")
    top, left = round((h - size) / 2.0), round((w - size) / 2.0)
    return x[..., top:top + size, left:left + size]


def clip_preprocess(pixels: torch.Tensor | list[torch.Tensor], size: int, mean: Sequence[float],
                    std: Sequence[float]) -> torch.Tensor:
    """CLIP's image transform on pixels in [0, 1]: shorter side → `size`, centre crop, ``(x - mean) / std``.

    Args:
        pixels: `(B, 3, H, W)` float in [0, 1], or a list of `(3, H_i, W_i)` (PIL inputs of different sizes).
        size (`int`): the model's input resolution (224 for ViT-L/14 and ViT-H/14).
        mean, std (`Sequence[float]`): 3 per-channel values of the model's normalisation.

    Returns:
        `torch.Tensor` `(B, 3, size, size)` float32, differentiable w.r.t. `pixels`.
    """
    if isinstance(pixels, list):
        return torch.cat([clip_preprocess(p.unsqueeze(0), size, mean, std) for p in pixels])
    x = center_crop(resize_shorter_side(pixels.float(), size), size)
    mean_t = torch.tensor(list(mean), dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std_t = torch.tensor(list(std), dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean_t) / std_t
