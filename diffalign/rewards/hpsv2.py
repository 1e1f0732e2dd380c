"""HPSv2 (Wu et al., *Human Preference Score v2*, arXiv:2306.09341): an open_clip ViT-H/14 fine-tuned on human
preferences.

The score follows HPSv2's ``score.py``: ``cos(E_I, E_T)`` of the L2-normalised open_clip image and text embeddings,
without the logit scale (typical values about 0.2–0.35; papers often quote it ×100, which ``scale=100`` gives). The
weights (``HPS_v2_compressed.pt`` / ``HPS_v2.1_compressed.pt`` in the hub repo ``xswu/HPSv2``) are a pickle whose
``state_dict`` holds open_clip ``ViT-H-14`` keys; convert them once to safetensors (the error for a ``.pt`` path prints
the command). Images go through open_clip's transform for ViT-H-14 (shorter side → 224 bicubic, centre crop, OpenAI
CLIP mean/std), written with tensor ops; text is tokenised with open_clip's ``ViT-H-14`` tokenizer (77 tokens).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from diffalign.config.schemas import config_schema
from diffalign.rewards.loading import load_open_clip
from diffalign.rewards.preprocess import ImageInput, clip_preprocess, to_pixels
from diffalign.types import RewardOutput

WHERE = ("Download HPS_v2.1_compressed.pt from the hub repo xswu/HPSv2, convert it to safetensors (the error for a .pt "
         "path prints the one-line command) and pass reward.hpsv2.weights=/path/hps_v2.1.safetensors (or a folder "
         "holding open_clip_model.safetensors).")


@config_schema("reward", "hpsv2")
@dataclass
class Hpsv2Config:
    """Config of `Hpsv2` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.hpsv2.Hpsv2"
    weights: str | None = None
    model_name: str = "ViT-H-14"
    scale: float = 1.0
    value_range: tuple[float, float] = (0.0, 1.0)
    differentiable: bool = False
    device: str = "cpu"
    dtype: str = "float32"


class Hpsv2:
    """HPSv2 score of each (image, prompt) pair.

    Args:
        weights (`str`): the HPSv2 weights as a ``.safetensors`` file or a folder holding
            ``open_clip_model.safetensors``. Required.
        model_name (`str`, defaults to ``"ViT-H-14"``): the open_clip architecture of the weights.
        scale (`float`, defaults to 1.0): multiplies the cosine (100 gives the percentage papers quote).
        value_range (`tuple[float, float]`, defaults to `(0.0, 1.0)`): range of float inputs (`(-1, 1)` for VAE
            output).
        differentiable (`bool`, defaults to False): keep gradients to the pixels; otherwise runs under
            `torch.no_grad()`.
        device (`str`), dtype (`str`): where and in which precision the model runs.

    Call: images `(B, 3, H, W)` (float in `value_range`, uint8, or PIL images; videos `(B, F, 3, H, W)`: frame scores
    averaged), `B` prompts → `RewardOutput` with ``scores`` `(B,)` float32 in [-scale, scale].

    Raises:
        ValueError: `weights` missing or a pickle; bad images; image and prompt counts differ.
        FileNotFoundError: weights absent (the message says where to put them).
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "hpsv2"

    def __init__(self, weights: str | None = None, model_name: str = "ViT-H-14", scale: float = 1.0,
                 value_range: tuple[float, float] = (0.0, 1.0), differentiable: bool = False, device: str = "cpu",
                 dtype: str = "float32"):
        if weights is None:
            raise ValueError(f"reward.hpsv2.weights is required. {WHERE}")
        self.scale, self.value_range, self.differentiable = scale, list(value_range), differentiable
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        model, self.tokenize, (self.image_size, self.mean, self.std) = load_open_clip(
            model_name, weights, "reward.hpsv2", WHERE, weights_field="reward.hpsv2.weights")
        self.model = model.to(self.device, self.dtype)

    def __call__(self, images: ImageInput, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if isinstance(images, torch.Tensor) and images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return RewardOutput(out.scores.view(b, f).mean(1))
        pixels = to_pixels(images, self.value_range, "reward.hpsv2.value_range")
        x = clip_preprocess(pixels if isinstance(pixels, list) else pixels.to(self.device), self.image_size, self.mean,
                            self.std)
        if len(prompts) != x.shape[0]:
            raise ValueError(f"got {x.shape[0]} images and {len(prompts)} prompts; pass one prompt per image")
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            image_features = self.model.encode_image(x.to(self.device, self.dtype), normalize=True).float()
            text_features = self.model.encode_text(self.tokenize(list(prompts)).to(self.device), normalize=True).float()
            scores = self.scale * (image_features * text_features).sum(-1)
        return RewardOutput(scores.float())
