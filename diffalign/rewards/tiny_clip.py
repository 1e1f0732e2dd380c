"""The tiny world's CLIP: an open_clip model with a custom tiny config, trained by ``scripts/pretrain_tiny_world.py``.

It is built with ``open_clip.create_model`` from a config registered with ``open_clip.add_model_config`` and loads
its weights from the shipped safetensors file, so the CLIP-score reward runs through exactly the same open_clip code
as a real ViT-L/14. Text is tokenised with the world's word-level tokenizer (context length 12, EOS id 2, pooled at
the EOS token: ``text_cfg.pool_type = "eos"``).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

MODEL_NAME = "diffalign-tiny-clip"
ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny_clip"
MODEL_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 3, "width": 96, "head_width": 32, "patch_size": 4},
    "text_cfg": {
        "context_length": 12,
        "vocab_size": 23,
        "width": 64,
        "heads": 4,
        "layers": 2,
        "pool_type": "eos",
        "eos_id": 2,
        "pad_id": 0,
    },
}
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def register_model_config() -> None:
    """Registers `MODEL_NAME` with open_clip (idempotent)."""
    import open_clip

    if MODEL_NAME in open_clip.list_models():
        return
    # open_clip reads model configs from json files; write ours to a private temp dir (never into the package)
    path = Path(tempfile.mkdtemp(prefix="diffalign-open-clip-")) / f"{MODEL_NAME}.json"
    path.write_text(json.dumps(MODEL_CONFIG, indent=2))
    open_clip.add_model_config(path)


def build_tiny_clip(pretrained: str | None = None) -> torch.nn.Module:
    """The tiny open_clip model, randomly initialised (`pretrained` None) or loaded from a safetensors file."""
    import open_clip

    register_model_config()
    return open_clip.create_model(MODEL_NAME, pretrained=pretrained, device="cpu")


def tokenize(tokenizer, prompts: list[str]) -> torch.Tensor:
    """`(B, 12)` int64 token ids of `prompts`, padded with [PAD] (id 0)."""
    return tokenizer(
        list(prompts),
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def normalize(images: torch.Tensor) -> torch.Tensor:
    """Images `(B, 3, 32, 32)` in [0, 1] → the model's input normalisation."""
    mean = torch.tensor(IMAGE_MEAN, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images - mean) / std
