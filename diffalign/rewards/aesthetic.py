"""LAION aesthetic predictor: an MLP over L2-normalised CLIP ViT-L/14 image embeddings.

The head is the "improved aesthetic predictor" of C. Schuhmann (github.com/christophschuhmann/improved-aesthetic-
predictor, ``sac+logos+ava1-l14-linearMSE.pth``; used as DDPO's aesthetic reward, arXiv:2305.13301 §6.1): linear
layers 768→1024→128→64→16→1 with dropout between the first four (identity at inference), state-dict keys
``layers.{0,2,4,6,7}.{weight,bias}``. The original single linear layer of LAION-AI/aesthetic-predictor
(``sa_0_4_vit_l_14_linear.pth``, keys ``weight``/``bias``) loads too. Both were trained on CLIP embeddings divided by
their L2 norm; feeding raw embeddings gives scores of 20–30 instead of 1–10 (LAION-AI/aesthetic-predictor#5,
docs/guides/field_cases.md#aesthetic-predictor-needs-normalised-embeddings), so the embedding is normalised here,
always.

Layer sizes are read from the weights, so a tiny head over a tiny CLIP runs through the same code as the real one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from diffalign.config.schemas import config_schema
from diffalign.rewards.loading import hub_file, load_open_clip
from diffalign.rewards.preprocess import ImageInput, clip_preprocess, to_pixels
from diffalign.types import RewardOutput

WHERE_HEAD = ("Download sac+logos+ava1-l14-linearMSE.pth from "
              "github.com/christophschuhmann/improved-aesthetic-predictor, convert it to safetensors (the error for a .pth path prints the one-line command) and pass "
              "reward.aesthetic.head=/path/aesthetic_mlp.safetensors (or a folder / hub repo holding "
              "aesthetic_mlp.safetensors).")
WHERE_CLIP = ("The head expects OpenAI CLIP ViT-L/14 embeddings: put open_clip's ViT-L-14 'openai' weights as "
              "<folder>/open_clip_model.safetensors and pass reward.aesthetic.clip_pretrained=<folder>, or keep "
              "clip_pretrained=openai with network access once (then HF_HUB_OFFLINE=1 reads the HF cache).")


@config_schema("reward", "aesthetic")
@dataclass
class AestheticConfig:
    """Config of `Aesthetic` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.aesthetic.Aesthetic"
    head: str | None = None
    clip_model_name: str = "ViT-L-14"
    clip_pretrained: str | None = "openai"
    value_range: tuple[float, float] = (0.0, 1.0)
    differentiable: bool = False
    device: str = "cpu"
    dtype: str = "float32"


class AestheticHead(torch.nn.Module):
    """The predictor: ``layers`` = Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear (the improved
    predictor) or one Linear (the original); sizes from `state_dict`, which is loaded strictly."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        super().__init__()
        if set(state_dict) == {"weight", "bias"}:
            self.layers = torch.nn.Sequential(torch.nn.Linear(*reversed(state_dict["weight"].shape)))
            self.load_state_dict({f"layers.0.{k}": v for k, v in state_dict.items()})
            return
        expected = {f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias")}
        if set(state_dict) != expected:
            raise ValueError(f"aesthetic head weights have keys {sorted(state_dict)[:6]}...; expected "
                             f"{sorted(expected)} (improved predictor) or weight/bias (linear predictor)")
        linear = {i: torch.nn.Linear(*reversed(state_dict[f"layers.{i}.weight"].shape)) for i in (0, 2, 4, 6, 7)}
        self.layers = torch.nn.Sequential(linear[0], torch.nn.Dropout(0.2), linear[2], torch.nn.Dropout(0.2),
                                          linear[4], torch.nn.Dropout(0.1), linear[6], linear[7])
        self.load_state_dict(state_dict)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """`(B, D)` unit-norm embeddings → `(B,)` scores."""
        return self.layers(embeddings).squeeze(-1)


class Aesthetic:
    """Aesthetic score (about 1–10 for natural images with the LAION weights) of each image; prompts are ignored.

    Args:
        head (`str`): the predictor's weights: a ``.safetensors`` file, or a local folder / hub repo holding
            ``aesthetic_mlp.safetensors``. Required (there is no tiny default).
        clip_model_name (`str`, defaults to ``"ViT-L-14"``): the open_clip image encoder the head was trained on.
        clip_pretrained (`str`, defaults to ``"openai"``): its weights (folder with ``open_clip_model.safetensors``,
            a ``.safetensors`` file, an open_clip tag or ``hf-hub:org/repo``; see
            `diffalign.rewards.loading.load_open_clip`).
        value_range (`tuple[float, float]`, defaults to `(0.0, 1.0)`): range of float inputs (`(-1, 1)` for VAE
            output).
        differentiable (`bool`, defaults to False): keep gradients to the pixels; otherwise runs under
            `torch.no_grad()`.
        device (`str`), dtype (`str`): where and in which precision CLIP and the head run.

    Call: images `(B, 3, H, W)` (float in `value_range`, uint8, or PIL images; videos `(B, F, 3, H, W)`: frame scores
    averaged) → `RewardOutput` with ``scores`` `(B,)` float32 and ``info["embedding_norm"]`` `(B,)`, the norm of the
    raw CLIP embeddings before normalisation.

    Raises:
        ValueError: `head` missing, a pickle, or with unexpected keys; the head's input size differs from the CLIP
            embedding size; bad images.
        FileNotFoundError: weights absent (the message says where to put them).
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "aesthetic"

    def __init__(self, head: str | None = None, clip_model_name: str = "ViT-L-14",
                 clip_pretrained: str | None = "openai", value_range: tuple[float, float] = (0.0, 1.0), differentiable: bool = False, device: str = "cpu",
                 dtype: str = "float32"):
        if head is None:
            raise ValueError(f"reward.aesthetic.head is required. {WHERE_HEAD}")
        self.value_range, self.differentiable = list(value_range), differentiable
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        head_file = hub_file(head, "aesthetic_mlp.safetensors", "reward.aesthetic.head", WHERE_HEAD)
        self.head = AestheticHead(load_file(str(head_file))).eval().requires_grad_(False).to(self.device, self.dtype)
        clip, _, (self.image_size, self.mean, self.std) = load_open_clip(
            clip_model_name, clip_pretrained, "reward.aesthetic.clip", WHERE_CLIP,
            weights_field="reward.aesthetic.clip_pretrained")
        self.clip = clip.to(self.device, self.dtype)
        in_features, embed_dim = self.head.layers[0].in_features, self.clip.visual.output_dim
        if in_features != embed_dim:
            raise ValueError(f"reward.aesthetic.head takes {in_features}-d embeddings but {clip_model_name} makes "
                             f"{embed_dim}-d ones; use the CLIP the head was trained on (ViT-L-14 for LAION's heads)")

    def __call__(self, images: ImageInput, prompts: list[str] | None = None, metadata: list[dict] | None = None
                 ) -> RewardOutput:
        if isinstance(images, torch.Tensor) and images.ndim == 5:
            b, f = images.shape[:2]
            out = self(images.flatten(0, 1))
            return RewardOutput(out.scores.view(b, f).mean(1),
                                {"embedding_norm": out.info["embedding_norm"].view(b, f)})
        pixels = to_pixels(images, self.value_range, "reward.aesthetic.value_range")
        x = clip_preprocess(pixels if isinstance(pixels, list) else pixels.to(self.device), self.image_size, self.mean,
                            self.std)
        with contextlib.nullcontext() if self.differentiable else torch.no_grad():
            raw = self.clip.encode_image(x.to(self.device, self.dtype)).float()
            scores = self.head(F.normalize(raw, dim=-1).to(self.dtype)).float()
        return RewardOutput(scores, {"embedding_norm": raw.detach().norm(dim=-1)})
