"""CLIP score reward: cosine similarity of open_clip image and text embeddings.

CLIPScore (Hessel et al., arXiv:2104.08718, Eq. 1) is ``w · max(cos(E_I, E_T), 0)`` with ``w = 2.5``; this reward
returns ``scale · cos(E_I, E_T)`` (``scale`` defaults to 1, no clipping at 0, so it stays informative for poor
samples). Any open_clip model works through the same code: by default the tiny world's CLIP shipped with diffalign
(`diffalign.rewards.tiny_clip`), or e.g. ``model_name="ViT-L-14", pretrained="/models/clip-vit-l-14"`` (a folder
holding ``open_clip_model.safetensors``, a ``.safetensors`` file, or an open_clip tag such as ``"openai"``, which
open_clip fetches into the HF cache — only the cache is read when ``HF_HUB_OFFLINE=1``).

Images go through open_clip's own transform for the model (shorter side → input size, centre crop, its mean/std;
`diffalign.rewards.preprocess`), written with tensor ops so the reward can be differentiable.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from diffalign.config.schemas import config_schema
from diffalign.rewards.loading import load_open_clip
from diffalign.rewards.preprocess import ImageInput, clip_preprocess, to_pixels
from diffalign.types import RewardOutput

WHERE = ("Put an open_clip checkpoint as <folder>/open_clip_model.safetensors (e.g. from the hub repo "
         "laion/CLIP-ViT-L-14-laion2B-s32B-b82K) and pass reward.clip_score.pretrained=<folder>, or use an open_clip "
         "tag such as pretrained=openai with network access once (then HF_HUB_OFFLINE=1 reads the HF cache).")


@config_schema("reward", "clip_score")
@dataclass
class ClipScoreConfig:
    """Config of `ClipScore` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.clip_score.ClipScore"
    model_name: str = "diffalign-tiny-clip"
    pretrained: str | None = None
    scale: float = 1.0
    value_range: tuple[float, float] = (0.0, 1.0)
    differentiable: bool = False
    device: str = "cpu"
    dtype: str = "float32"


class ClipScore:
    """CLIP image–text cosine similarity.

    Args:
        model_name (`str`, defaults to ``"diffalign-tiny-clip"``): an open_clip model name; the default is the tiny
            world's model.
        pretrained (`str`, *optional*): a folder holding ``open_clip_model.safetensors``, a ``.safetensors`` file, or
            an open_clip tag / ``hf-hub:org/repo``; `None` loads the shipped tiny weights (tiny model only).
        scale (`float`, defaults to 1.0): multiplies the cosine (2.5 with clipping at 0 gives Hessel et al.'s
            CLIPScore).
        value_range (`tuple[float, float]`, defaults to `(0.0, 1.0)`): the range of float image inputs; `[-1.0, 1.0]` for
            VAE-convention images.
        differentiable (`bool`, defaults to False): keep the autograd graph to the input pixels; otherwise scoring
            runs under `torch.no_grad()`.
        device (`str`, defaults to ``"cpu"``), dtype (`str`, defaults to ``"float32"``): where and in which precision
            the CLIP model runs (scores are returned as float32 on `device`).

    Call: images `(B, 3, H, W)` (float in `value_range`, uint8, or PIL images; videos `(B, F, 3, H, W)`: frame scores
    averaged), `B` prompts → `RewardOutput` with ``scores`` `(B,)` float32 in [-scale, scale].

    Raises:
        FileNotFoundError: the weights are absent (the message says where to put them).
        ValueError: `pretrained` missing for a non-tiny model or a pickle; images of the wrong shape or outside
            `value_range`; image and prompt counts differ.
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "clip_score"

    def __init__(self, model_name: str = "diffalign-tiny-clip", pretrained: str | None = None, scale: float = 1.0,
                 value_range: tuple[float, float] = (0.0, 1.0), differentiable: bool = False, device: str = "cpu",
                 dtype: str = "float32"):
        self.scale, self.value_range, self.differentiable = scale, list(value_range), differentiable
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        model, self.tokenize, (self.image_size, self.mean, self.std) = load_open_clip(
            model_name, pretrained, "reward.clip_score", WHERE)
        self.model = model.to(self.device, self.dtype)

    def embed_images(self, images: ImageInput) -> torch.Tensor:
        """L2-normalised image embeddings `(B, D)` float32 of images `(B, 3, H, W)` (any accepted input form)."""
        pixels = to_pixels(images, self.value_range, "reward.clip_score.value_range")
        x = clip_preprocess(pixels if isinstance(pixels, list) else pixels.to(self.device), self.image_size,
                            self.mean, self.std)
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            return self.model.encode_image(x.to(self.device, self.dtype), normalize=True).float()

    def __call__(self, images: ImageInput, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if isinstance(images, torch.Tensor) and images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return RewardOutput(out.scores.view(b, f).mean(1))
        image_features = self.embed_images(images)
        if len(prompts) != image_features.shape[0]:
            raise ValueError(f"got {image_features.shape[0]} images and {len(prompts)} prompts; pass one prompt per "
                             "image")
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            tokens = self.tokenize(list(prompts)).to(self.device)
            text_features = self.model.encode_text(tokens, normalize=True).float()
            scores = self.scale * (image_features * text_features).sum(-1)
        return RewardOutput(scores.float())
