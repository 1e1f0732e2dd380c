"""PickScore (Kirstain et al., *Pick-a-Pic*, arXiv:2305.01569): a CLIP-H/14 fine-tuned on human preferences.

The score is PickScore's own inference rule, ``logit_scale.exp() · cos(E_I, E_T)`` with the model's learned
``logit_scale`` (exp ≈ 100, so typical scores are about 18–23). The model is a transformers `CLIPModel`
(``yuvalkirstain/PickScore_v1``) and the tokenizer and image settings come from its processor
(``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``: shorter side → 224 bicubic, centre crop 224, OpenAI CLIP mean/std). The
image transform is re-done with tensor ops (`diffalign.rewards.preprocess.clip_preprocess`), reading the processor's
``size``/``crop_size``/``image_mean``/``image_std``, so it matches ``CLIPImageProcessor`` and can be differentiable.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from diffalign.config.schemas import config_schema
from diffalign.rewards.loading import looks_local, missing_weights_error
from diffalign.rewards.preprocess import ImageInput, center_crop, resize_shorter_side, to_pixels
from diffalign.runtime.text_context import TruncationWarner
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)
TEXT_CONTEXT = 77  # CLIP's text positions (PickScore_v1 is a CLIP-H)

WHERE = ("Save the model with transformers as a folder holding config.json and model.safetensors (e.g. "
         "CLIPModel.from_pretrained('yuvalkirstain/PickScore_v1').save_pretrained('/models/pickscore') on a machine "
         "with network) and the processor likewise (AutoProcessor.from_pretrained("
         "'laion/CLIP-ViT-H-14-laion2B-s32B-b79K').save_pretrained('/models/pickscore')), then pass "
         "reward.pickscore.model=/models/pickscore reward.pickscore.processor=/models/pickscore.")


@config_schema("reward", "pickscore")
@dataclass
class PickScoreConfig:
    """Config of `PickScore` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.pickscore.PickScore"
    model: str = "yuvalkirstain/PickScore_v1"
    processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    value_range: tuple[float, float] = (0.0, 1.0)
    differentiable: bool = False
    device: str = "cpu"
    dtype: str = "float32"


def _features(output) -> torch.Tensor:
    """`get_*_features` returns a tensor (transformers 4) or an output whose ``pooler_output`` is it (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


class PickScore:
    """PickScore of each (image, prompt) pair.

    Args:
        model (`str`, defaults to ``"yuvalkirstain/PickScore_v1"``): a local folder or hub id of the `CLIPModel`
            (read with safetensors only; ``HF_HUB_OFFLINE=1`` reads only the HF cache).
        processor (`str`, defaults to ``"laion/CLIP-ViT-H-14-laion2B-s32B-b79K"``): folder or hub id of its processor
            (tokenizer + image processor config).
        value_range (`tuple[float, float]`, defaults to `(0.0, 1.0)`): range of float inputs (`(-1, 1)` for VAE
            output).
        differentiable (`bool`, defaults to False): keep gradients to the pixels; otherwise runs under
            `torch.no_grad()`.
        device (`str`), dtype (`str`): where and in which precision the model runs.

    Call: images `(B, 3, H, W)` (float in `value_range`, uint8, or PIL images; videos `(B, F, 3, H, W)`: frame scores
    averaged), `B` prompts → `RewardOutput` with ``scores`` `(B,)` float32.

    Raises:
        FileNotFoundError: model or processor absent (the message says where to put them).
        ValueError: bad images, or image and prompt counts differ.
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "pickscore"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", value_range: tuple[float, float] = (0.0, 1.0),
                 differentiable: bool = False, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

        self.value_range, self.differentiable = list(value_range), differentiable
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        for field_name, path_or_id in (("model", model), ("processor", processor)):
            if looks_local(path_or_id) and not Path(path_or_id).expanduser().exists():
                raise missing_weights_error(f"reward.pickscore.{field_name}", path_or_id, WHERE)
        try:
            clip = CLIPModel.from_pretrained(model, use_safetensors=True)
        except OSError as err:
            raise missing_weights_error("reward.pickscore.model", model, WHERE, err) from err
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(processor)
            image_processor = CLIPImageProcessor.from_pretrained(processor)
        except OSError as err:
            raise missing_weights_error("reward.pickscore.processor", processor, WHERE, err) from err
        self.model = clip.eval().requires_grad_(False).to(self.device, self.dtype)
        size, crop = dict(image_processor.size), dict(image_processor.crop_size)  # (transformers 5: SizeDict)
        if size.get("shortest_edge") is None or crop.get("height") is None or crop["height"] != crop.get("width"):
            raise ValueError(f"reward.pickscore.processor={processor!r}: expected a CLIP processor with size."
                             f"shortest_edge and a square crop_size, got size={size}, crop_size={crop}")
        self.resize, self.crop = int(size["shortest_edge"]), int(crop["height"])
        self.mean, self.std = tuple(image_processor.image_mean), tuple(image_processor.image_std)
        self._truncation = TruncationWarner("reward.pickscore's text encoder", logger,
                                            "the rest is ignored (the score judges the truncated prompt)",
                                            key="truncated_prompts/pickscore")

    def __call__(self, images: ImageInput, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if isinstance(images, torch.Tensor) and images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1), [p for p in prompts for _ in range(f)])
            return RewardOutput(out.scores.view(b, f).mean(1))
        pixels = to_pixels(images, self.value_range, "reward.pickscore.value_range")
        if isinstance(pixels, list):
            x = torch.cat([self._transform(p.unsqueeze(0)) for p in pixels])
        else:
            x = self._transform(pixels.to(self.device))
        if len(prompts) != x.shape[0]:
            raise ValueError(f"got {x.shape[0]} images and {len(prompts)} prompts; pass one prompt per image")
        self._truncation.check(self.tokenizer, prompts, TEXT_CONTEXT)  # (CLIP reads 77 tokens; say when it cuts)
        text = self.tokenizer(list(prompts), padding=True, truncation=True, max_length=TEXT_CONTEXT,
                              return_tensors="pt")
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            image_embeds = _features(self.model.get_image_features(pixel_values=x.to(self.device, self.dtype)))
            text_embeds = _features(self.model.get_text_features(input_ids=text.input_ids.to(self.device),
                                                                attention_mask=text.attention_mask.to(self.device)))
            cosine = (F.normalize(image_embeds.float(), dim=-1) * F.normalize(text_embeds.float(), dim=-1)).sum(-1)
            scores = self.model.logit_scale.exp().float() * cosine
        return RewardOutput(scores.float())

    def _transform(self, pixels: torch.Tensor) -> torch.Tensor:
        """CLIPImageProcessor's steps: shorter side → ``resize``, centre crop ``crop``, mean/std."""
        x = center_crop(resize_shorter_side(pixels.float(), self.resize), self.crop)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std
