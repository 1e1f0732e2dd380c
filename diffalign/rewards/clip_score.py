"""CLIP score reward: cosine similarity of open_clip image and text embeddings.

CLIPScore (Hessel et al., arXiv:2104.08718, Eq. 1) is ``w · max(cos(E_I, E_T), 0)`` with ``w = 2.5``; this reward
returns ``scale · cos(E_I, E_T)`` (``scale`` defaults to 1, no clipping at 0, so it stays informative for poor
samples). Any open_clip model works through the same code: by default the tiny world's CLIP shipped with diffalign
(`diffalign.rewards.tiny_clip`), or e.g. ``model_name="ViT-L-14", pretrained="/path/open_clip_pytorch_model.bin"``
(a local file; a tag such as ``"openai"`` makes open_clip download the weights, which needs network access).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from diffalign.types import RewardOutput


@dataclass
class ClipScoreConfig:
    """Config of `ClipScore` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.clip_score.ClipScore"
    model_name: str = "diffalign-tiny-clip"
    pretrained: str | None = None
    scale: float = 1.0
    device: str = "cpu"


class ClipScore:
    """CLIP image–text cosine similarity.

    Args:
        model_name: an open_clip model name; ``"diffalign-tiny-clip"`` is the tiny world's model.
        pretrained: open_clip ``pretrained`` (a local checkpoint path or a tag); None loads the shipped tiny weights
            for the tiny model.
        scale: multiplies the cosine (2.5 with clipping at 0 gives Hessel et al.'s CLIPScore).
        device: where the CLIP model runs.

    Call: images `(B, 3, H, W)` float in [0, 1] (videos `(B, F, 3, H, W)`: frame scores averaged), `B` prompts →
    `RewardOutput` with ``scores`` `(B,)` float32 in [-scale, scale].

    Raises:
        FileNotFoundError: the tiny model's shipped weights are missing.
        ValueError: images are not `(B, 3, H, W)` in [0, 1], or their count differs from the prompts'.
    """

    name = "clip_score"
    differentiable = True

    def __init__(self, model_name: str = "diffalign-tiny-clip", pretrained: str | None = None, scale: float = 1.0,
                 device: str = "cpu"):
        import open_clip

        from diffalign.rewards import tiny_clip

        self.scale, self.device = scale, torch.device(device)
        if model_name == tiny_clip.MODEL_NAME:
            path = pretrained or str(tiny_clip.ASSET_DIR / "open_clip_model.safetensors")
            if not os.path.exists(path):
                raise FileNotFoundError(f"tiny CLIP weights not found at {path}; rebuild them with "
                                        "`python scripts/pretrain_tiny_world.py clip`")
            self.model = tiny_clip.build_tiny_clip(path)
            from diffalign.world.tokenizer import build_tokenizer

            word_tokenizer = build_tokenizer()
            self.tokenize = lambda prompts: tiny_clip.tokenize(word_tokenizer, prompts)
            self.mean, self.std = tiny_clip.IMAGE_MEAN, tiny_clip.IMAGE_STD
        else:
            self.model = open_clip.create_model(model_name, pretrained=pretrained, device="cpu")
            self.tokenize = open_clip.get_tokenizer(model_name)
            cfg = self.model.visual.preprocess_cfg
            self.mean, self.std = tuple(cfg["mean"]), tuple(cfg["std"])
        self.model = self.model.to(self.device).eval().requires_grad_(False)
        size = self.model.visual.image_size
        self.image_size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` in [0, 1] → resized (bicubic, antialiased) and normalised model input; differentiable."""
        x = images.float().to(self.device)
        if tuple(x.shape[-2:]) != self.image_size:
            x = F.interpolate(x, size=self.image_size, mode="bicubic", antialias=True, align_corners=False)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return RewardOutput(out.scores.view(b, f).mean(1))
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W) in [0, 1], got shape {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"got {images.shape[0]} images and {len(prompts)} prompts; pass one prompt per image")
        image_features = self.model.encode_image(self.preprocess(images), normalize=True)
        text_features = self.model.encode_text(self.tokenize(list(prompts)).to(self.device), normalize=True)
        scores = self.scale * (image_features * text_features).sum(-1)
        return RewardOutput(scores.float())
