"""Locating reward weights: a local file or folder, or a Hugging Face hub id, with ``HF_HUB_OFFLINE`` respected.

Weights are read with safetensors only (no ``torch.load`` of untrusted pickles). Several reward models
are published as pickled ``.pt``/``.pth``/``.bin`` files; `missing_weights_error` and `require_safetensors` tell the
user where the weights go and give the one-line conversion to run once on a file they trust. docs/guides/rewards.md
lists every built-in reward's weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")

logger = logging.getLogger(__name__)


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def looks_local(path_or_id: str) -> bool:
    """A path (absolute, ``./``, ``../``, ``~``, or existing) rather than a hub id ``org/name``."""
    return os.path.exists(os.path.expanduser(path_or_id)) or path_or_id.startswith(("/", "./", "../", "~", "\\")) \
        or path_or_id.count("/") != 1


def require_safetensors(path: str | os.PathLike, field: str) -> Path:
    """Returns `path` as a `Path` if it is a ``.safetensors`` file.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is a pickle (``.pt``, ``.pth``, ``.bin``, ...): the message gives the conversion command.
    """
    path = Path(os.path.expanduser(str(path)))
    if path.suffix in PICKLE_SUFFIXES:
        target = path.with_suffix(".safetensors")
        raise ValueError(
            f"{field}={str(path)!r} is a pickle; diffalign reads weights with safetensors only. Convert it once (on a "
            f"file you trust): python -c \"import torch; from safetensors.torch import save_file; "
            f"sd = torch.load('{path}', map_location='cpu', weights_only=True); sd = sd.get('state_dict', sd); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{target}')\" and pass {field}={target}")
    if not path.is_file():
        raise FileNotFoundError(f"{field}={str(path)!r} does not exist")
    return path


def hub_file(path_or_id: str, filename: str, field: str, where: str) -> Path:
    """A local ``.safetensors`` file, a folder holding `filename`, or `filename` of the hub repo `path_or_id`
    (downloaded once into the HF cache; only the cache is read when ``HF_HUB_OFFLINE=1``).

    Args:
        path_or_id (`str`): local file, local folder or hub id ``org/name``.
        filename (`str`): the file to use inside a folder or hub repo, e.g. ``"model.safetensors"``.
        field (`str`): the config field named in errors, e.g. ``"reward.aesthetic.head"``.
        where (`str`): where to get the weights (named in the error when they are absent).

    Raises:
        FileNotFoundError: the weights are not there (the message says where to put them).
        ValueError: the weights are a pickle (see `require_safetensors`).
    """
    local = Path(os.path.expanduser(path_or_id))
    if local.is_dir():
        return require_safetensors(local / filename, f"{field} (file {filename} in folder)")
    if looks_local(path_or_id):
        if local.exists() or local.suffix in PICKLE_SUFFIXES:
            return require_safetensors(local, field)
        raise missing_weights_error(field, path_or_id, where)
    from huggingface_hub import hf_hub_download

    try:
        return require_safetensors(hf_hub_download(path_or_id, filename), field)
    except (OSError, ValueError) as err:  # huggingface_hub's not-found / offline errors derive from these
        if isinstance(err, ValueError) and "safetensors" in str(err):
            raise
        raise missing_weights_error(field, path_or_id, where, err) from err


def missing_weights_error(field: str, path_or_id: str, where: str, err: Exception | None = None) -> FileNotFoundError:
    """The error for absent weights: what was looked for, whether the hub was reachable, and where to put them."""
    mode = ("HF_HUB_OFFLINE=1, so only the local HF cache was searched" if offline() else
            "the hub was not reachable or has no such file")
    cause = f" ({type(err).__name__}: {str(err).splitlines()[0][:200]})" if err is not None else ""
    kind = "no such local file or folder" if looks_local(path_or_id) else f"hub id not found: {mode}"
    return FileNotFoundError(f"{field}={path_or_id!r}: weights not found — {kind}{cause}. {where}")


def load_open_clip(model_name: str, pretrained: str | None, field: str, where: str,
                   weights_field: str | None = None):
    """Builds an open_clip model with its tokenizer and image transform settings.

    Args:
        model_name (`str`): an open_clip model name (``"ViT-L-14"``, ``"ViT-H-14"``, a config registered with
            ``open_clip.add_model_config``, or ``"diffalign-tiny-clip"``, the tiny world's CLIP).
        pretrained (`str`, *optional*): a local ``.safetensors`` checkpoint, a folder holding
            ``open_clip_model.safetensors``, or an open_clip tag such as ``"openai"`` (fetched by open_clip into the
            HF cache; only the cache is read when ``HF_HUB_OFFLINE=1``). `None` loads the shipped weights of the tiny
            world's CLIP and is an error for any other model (a random CLIP would score noise).
        field (`str`): config prefix for errors, e.g. ``"reward.clip_score"``.
        where (`str`): where to get the weights (named in the error when they are absent).
        weights_field (`str`, *optional*): the config field of `pretrained` (defaults to ``<field>.pretrained``).

    Returns:
        `(model, tokenize, (size, mean, std))`: the model in eval mode without gradients, on CPU in float32;
        ``tokenize(prompts) -> (B, L) int64``; the input resolution and normalisation.

    Raises:
        FileNotFoundError: the weights are absent (the message says where to put them).
        ValueError: the weights are a pickle, `pretrained` is missing for a model other than the tiny CLIP, or the
            model name or tag is unknown to open_clip.
    """
    import open_clip

    from diffalign.rewards import tiny_clip

    weights_field = weights_field or f"{field}.pretrained"
    if model_name == tiny_clip.MODEL_NAME:
        path = pretrained or str(tiny_clip.ASSET_DIR / "open_clip_model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"tiny CLIP weights not found at {path}; rebuild them with "
                                    "`python scripts/pretrain_tiny_world.py clip`")
        model = tiny_clip.build_tiny_clip(str(require_safetensors(path, weights_field)))
        from diffalign.world.tokenizer import build_tokenizer

        word_tokenizer = build_tokenizer()
        tokenize = _warning_tokenize(lambda prompts: tiny_clip.tokenize(word_tokenizer, prompts), word_tokenizer,
                                     word_tokenizer.model_max_length, field)
        size, mean, std = tiny_clip.MODEL_CONFIG["vision_cfg"]["image_size"], tiny_clip.IMAGE_MEAN, tiny_clip.IMAGE_STD
        return model.eval().requires_grad_(False), tokenize, (int(size), mean, std)
    if model_name not in open_clip.list_models():
        raise ValueError(f"{field}.model_name={model_name!r} is not an open_clip model; e.g. ViT-L-14, ViT-H-14 "
                         "(open_clip.list_models() lists them)")
    if pretrained is None:
        raise ValueError(f"{weights_field} is required for model_name={model_name!r}. {where}")
    local = Path(os.path.expanduser(pretrained))
    if local.exists() or local.suffix or "/" in pretrained:  # a local file or folder
        if local.is_dir():
            checkpoint = require_safetensors(local / "open_clip_model.safetensors", weights_field)
        elif local.exists() or local.suffix in PICKLE_SUFFIXES:
            checkpoint = require_safetensors(local, weights_field)
        else:
            raise missing_weights_error(weights_field, pretrained, where)
        model = open_clip.create_model(model_name, pretrained=str(checkpoint), device="cpu")
    else:  # an open_clip tag: check the download (or the HF cache when offline) before building the model
        tag_cfg = open_clip.get_pretrained_cfg(model_name, pretrained)
        if not tag_cfg:
            raise ValueError(f"{weights_field}={pretrained!r} is neither a local path nor an open_clip tag of "
                             f"{model_name} ({open_clip.list_pretrained_tags_by_model(model_name)})")
        try:
            open_clip.download_pretrained(tag_cfg)
        except Exception as err:  # hub errors (offline, not found, no network) come in several types
            raise missing_weights_error(weights_field, f"{model_name}/{pretrained} (open_clip tag)", where, err) from err
        model = open_clip.create_model(model_name, pretrained=pretrained, device="cpu")
    cfg = model.visual.preprocess_cfg
    size = cfg["size"] if isinstance(cfg["size"], int) else cfg["size"][0]
    tokenizer = open_clip.get_tokenizer(model_name)
    tokenize = _warning_tokenize(tokenizer, tokenizer, tokenizer.context_length, field)
    return model.eval().requires_grad_(False), tokenize, (int(size), tuple(cfg["mean"]), tuple(cfg["std"]))


def _warning_tokenize(tokenize, tokenizer, context: int, field: str):
    """`tokenize` that first warns once per prompt longer than the text encoder's `context` tokens
    (`diffalign.runtime.text_context.TruncationWarner`; the encoder reads the truncated prompt)."""
    from diffalign.runtime.text_context import TruncationWarner

    warner = TruncationWarner(f"{field}'s text encoder", logger,
                              "the rest is ignored (the score judges the truncated prompt)",
                              key=f"truncated_prompts/{field.removeprefix('reward.')}")

    def warned(prompts):
        warner.check(tokenizer, list(prompts), context)
        return tokenize(prompts)

    return warned
