"""Frozen vision backbones for ViPO's Perceptual Structuring Module (docs/methods/algorithms.md#vipo-perceptual-maps,
step 1).

A backbone is any object with ``patch_tokens(images) -> (N, gh, gw, d)``: images `(N, 3, H, W)` in [0, 1] in, the
patch tokens (class/register tokens dropped) on the patch grid out. Two are provided:

- `Dinov2Backbone` — DINOv2 through `transformers.AutoModel.from_pretrained(<local folder or hub id>)` (the paper's
  default, DINOv2-large, patch 14). As in the released code the image is not center-cropped: it is resized to the
  nearest multiple of the patch size of its own size (at least one patch) and normalised with the ImageNet statistics;
  DINOv2 interpolates its position embeddings to that grid.
- `TinyClipBackbone` — the tiny world's CLIP vision tower (`diffalign.rewards.tiny_clip`, open_clip ViT, 32×32 input,
  patch 4 → an 8×8 grid of 96-d tokens), so the whole module runs on CPU without downloads.

Any other backbone (ResNet feature maps, SAM) plugs in as ``method.backbone=python:<module>:<factory>``, the factory
returning such an object.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@runtime_checkable
class VisionBackbone(Protocol):
    """A frozen feature extractor: images `(N, 3, H, W)` in [0, 1] → patch tokens `(N, gh, gw, d)` float32."""

    def patch_tokens(self, images: torch.Tensor) -> torch.Tensor: ...


class TinyClipBackbone:
    """The tiny CLIP's vision transformer (patch tokens after the last block, before pooling).

    Args:
        weights (`str`, *optional*): an open_clip safetensors file; defaults to the shipped
            `diffalign/assets/tiny_clip/open_clip_model.safetensors`.
        device (`str`): where the tower runs.
    """

    def __init__(self, weights: str | None = None, device: str | torch.device = "cpu"):
        from diffalign.rewards.tiny_clip import ASSET_DIR, build_tiny_clip

        weights = weights or str(ASSET_DIR / "open_clip_model.safetensors")
        self.visual = build_tiny_clip(weights).visual.to(device).eval().requires_grad_(False)
        self.visual.output_tokens = True
        self.image_size = int(self.visual.image_size[0] if isinstance(self.visual.image_size, tuple)
                              else self.visual.image_size)
        self.device = torch.device(device)

    @torch.no_grad()
    def patch_tokens(self, images: torch.Tensor) -> torch.Tensor:
        from diffalign.rewards.tiny_clip import normalize

        x = images.float().to(self.device)
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True,
                              align_corners=False)
        _, tokens = self.visual(normalize(x))
        side = round(tokens.shape[1] ** 0.5)
        return tokens.float().reshape(len(x), side, side, -1)


class Dinov2Backbone:
    """DINOv2 (`transformers` `Dinov2Model`, with or without registers) from a local folder or a hub id.

    Args:
        pretrained_model_name_or_path (`str`): e.g. a local copy of ``facebook/dinov2-large`` (nothing is downloaded
            when it is a folder; `HF_HUB_OFFLINE=1` is honoured for hub ids).
        device (`str`), dtype (`torch.dtype`): where and in what precision the backbone runs.
    """

    def __init__(self, pretrained_model_name_or_path: str, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(pretrained_model_name_or_path, torch_dtype=dtype).to(device).eval()
        self.model.requires_grad_(False)
        cfg = self.model.config
        self.patch_size = int(cfg.patch_size)
        self.num_prefix = 1 + int(getattr(cfg, "num_register_tokens", 0) or 0)
        self.device, self.dtype = torch.device(device), dtype

    @torch.no_grad()
    def patch_tokens(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().to(self.device)
        h, w = x.shape[-2:]
        p = self.patch_size
        gh, gw = max(1, round(h / p)), max(1, round(w / p))
        if (gh * p, gw * p) != (h, w):
            x = F.interpolate(x, size=(gh * p, gw * p), mode="bicubic", antialias=True, align_corners=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        out = self.model(pixel_values=((x.clamp(0, 1) - mean) / std).to(self.dtype)).last_hidden_state
        return out[:, self.num_prefix:].float().reshape(len(x), gh, gw, -1)


def check_backbone_spec(spec: str | None) -> None:
    """Checks a backbone spec without loading anything (`build_backbone` does it first; ViPO's constructor too, so a
    bad ``method.backbone`` fails before any model loads).

    Raises:
        ValueError: for an unknown form, a local DINOv2 folder that does not exist, or a ``python:`` spec without
            ``<module>:<factory>``.
    """
    spec = spec or "tiny_clip"
    if spec == "tiny_clip":
        return
    if spec.startswith("dinov2:"):
        path = spec.split(":", 1)[1]
        if path.startswith((".", "/")) and not Path(path).is_dir():
            raise ValueError(f"method.backbone={spec!r}: {path} is not a folder; point it at a local DINOv2 folder "
                             "(config.json + model.safetensors)")
        return
    if spec.startswith("python:") and len(spec.split(":")) == 3 and all(spec.split(":")[1:]):
        return
    raise ValueError(f"method.backbone={spec!r} must be 'tiny_clip', 'dinov2:<folder>' or 'python:<module>:<factory>'")


def build_backbone(spec: str | None, device: str | torch.device = "cpu") -> VisionBackbone:
    """The backbone named by `spec`: "tiny_clip" (default), "dinov2:<folder or hub id>", or
    "python:<module>:<factory>" (called with ``device=``).

    Raises:
        ValueError: for another spec, or a DINOv2 folder that does not exist (`check_backbone_spec`).
    """
    check_backbone_spec(spec)
    spec = spec or "tiny_clip"
    if spec == "tiny_clip":
        return TinyClipBackbone(device=device)
    if spec.startswith("dinov2:"):
        return Dinov2Backbone(spec.split(":", 1)[1], device=device)
    _, module, factory = spec.split(":", 2)
    return getattr(importlib.import_module(module), factory)(device=device)
