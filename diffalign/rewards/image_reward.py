"""ImageReward (Xu et al., arXiv:2304.05977): a BLIP-based reward model trained on human preferences, run through its
own package (``image-reward``, import name ``ImageReward``).

The package is optional and **does not install beside diffalign's pins**: ``image-reward==1.5`` pins
``timm==0.6.13`` while ``open_clip_torch>=3`` needs ``timm>=1.0.17``, and it imports OpenAI's ``clip`` package. Until
that changes this reward raises an `ImportError` naming the extra (``pip install "diffalign[imagereward]"``) and the
conflict. With the package importable, scoring uses ``ImageReward.load(model, device=...)`` and its ``score`` method
per image (its own preprocessing: uint8 PIL → resize 224 bicubic, centre crop, BLIP normalisation); the package reads
its weights and BERT tokenizer through ``huggingface_hub`` (``HF_HUB_OFFLINE=1`` reads only the HF cache) and loads
its ``.pt`` weights itself with ``torch.load``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from diffalign.config.schemas import config_schema
from diffalign.rewards.preprocess import ImageInput, to_pixels
from diffalign.runtime.text_context import TruncationWarner
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)
BLIP_CONTEXT = 35  # ImageReward.score tokenises with max_length=35, truncation=True

EXTRA = ('reward \'image_reward\' needs the ImageReward package: pip install "diffalign[imagereward]". Note: '
         "image-reward 1.5 pins timm==0.6.13, which conflicts with open_clip_torch>=3 (timm>=1.0.17) used by "
         "diffalign's CLIP rewards, and it imports OpenAI's `clip` package; install it in an environment without "
         "those pins, or pick reward=[pickscore] / reward=[hpsv2]")


@config_schema("reward", "image_reward")
@dataclass
class ImageRewardConfig:
    """Config of `ImageRewardScore` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.image_reward.ImageRewardScore"
    model: str = "ImageReward-v1.0"
    value_range: tuple[float, float] = (0.0, 1.0)
    device: str = "cpu"


class ImageRewardScore:
    """ImageReward score of each (image, prompt) pair (about −2…2; not differentiable here).

    Args:
        model (`str`, defaults to ``"ImageReward-v1.0"``): a name known to ``ImageReward.load`` or a local path to
            its ``ImageReward.pt``.
        value_range (`tuple[float, float]`, defaults to `(0.0, 1.0)`): range of float inputs.
        device (`str`, defaults to ``"cpu"``): where the model runs.

    Raises:
        ImportError: the ``ImageReward`` package is not importable (the message names the extra).
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "image_reward"
    differentiable = False

    def __init__(self, model: str = "ImageReward-v1.0", value_range: tuple[float, float] = (0.0, 1.0),
                 device: str = "cpu"):
        try:
            import ImageReward as RM
        except ImportError as err:
            raise ImportError(f"{EXTRA} ({type(err).__name__}: {err})") from err
        self.value_range = list(value_range)
        self.model = RM.load(model, device=device)
        self._truncation = TruncationWarner("reward.image_reward's text encoder (BLIP)", logger,
                                            "the rest is ignored (the score judges the truncated prompt)",
                                            key="truncated_prompts/image_reward")

    @torch.no_grad()
    def __call__(self, images: ImageInput, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if isinstance(images, torch.Tensor) and images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return RewardOutput(out.scores.view(b, f).mean(1))
        pixels = to_pixels(images, self.value_range, "reward.image_reward.value_range")
        pil = [Image.fromarray((p.permute(1, 2, 0).cpu().numpy() * 255 + 0.5).astype(np.uint8)) for p in pixels]
        if len(prompts) != len(pil):
            raise ValueError(f"got {len(pil)} images and {len(prompts)} prompts; pass one prompt per image")
        tokenizer = getattr(getattr(self.model, "blip", None), "tokenizer", None)  # ImageReward pads/cuts to 35
        if tokenizer is not None:
            self._truncation.check(tokenizer, prompts, BLIP_CONTEXT)
        scores = [float(self.model.score(prompt, [image])) for prompt, image in zip(prompts, pil)]
        return RewardOutput(torch.tensor(scores, dtype=torch.float32))
