"""Reading training images from bytes or files: decode, convert to RGB, resize the shorter side and center-crop.

The transform is the deterministic part of the Diffusion-DPO data pipeline (``Resize(resolution, BILINEAR)`` then
``CenterCrop(resolution)``; arXiv:2311.12908, its ``train.py``); random flips are not applied.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError


def open_image(value: Any, where: str, root: str | os.PathLike | None = None) -> Image.Image:
    """Decodes one image value.

    Args:
        value: encoded bytes (PNG/JPEG/...), a file path (`str` or `os.PathLike`, relative paths are taken from
            `root`), a dict as the Hugging Face ``Image`` feature stores it (``{"bytes": bytes | base64 str | None,
            "path": str | None}``), or a PIL image.
        where (`str`): what the image is, for error messages (e.g. ``"train.parquet row 4 jpg_1"``).
        root (`str` or `os.PathLike`, *optional*): folder of relative paths.

    Returns:
        `PIL.Image.Image`, fully loaded.

    Raises:
        TypeError: naming `where`, if the value has another type.
        ValueError: naming `where` (and the file), if the file is missing or the data cannot be decoded (a corrupt or
            truncated image).
    """
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            data = value["bytes"]
            value = base64.b64decode(data) if isinstance(data, str) else data
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise ValueError(f"{where}: image dict has neither 'bytes' nor 'path'.")
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        source, name = io.BytesIO(bytes(value)), f"{where} (embedded bytes)"
    elif isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_absolute() and root is not None:
            path = Path(root) / path
        if not path.is_file():
            raise ValueError(f"{where}: image file {str(path)!r} does not exist; fix the path or the image root.")
        source, name = path, f"{where} ({path})"
    else:
        raise TypeError(f"{where}: unsupported image value of type {type(value).__name__}; give bytes or a path.")
    try:
        image = Image.open(source)
        image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"{name}: cannot decode the image ({err}); the file is corrupt or not an image.") from err
    return image


def prepare_image(image: Image.Image, resolution: int | None) -> torch.Tensor:
    """RGB, shorter side resized to `resolution` (bilinear), center crop to `resolution` × `resolution`.

    Args:
        image (`PIL.Image.Image`): any 8-bit mode (palette, grey, RGBA, CMYK, ...; alpha is dropped) or 16-bit grey
            (modes ``I;16*`` / ``I``, scaled by 255/65535: PIL's own conversion would clip everything above 255).
        resolution (`int`, *optional*): side in pixels; `None` keeps the size (RGB conversion only).

    Returns:
        `torch.Tensor` float32 `(3, resolution, resolution)` (or `(3, H, W)`) in [0, 1].

    Raises:
        ValueError: for floating-point images (mode ``F``), whose value range is unknown.
    """
    if image.mode.startswith("I"):  # 16-bit grey PNG/TIFF
        grey = np.clip(np.round(np.asarray(image, dtype=np.float64) / 257.0), 0, 255).astype(np.uint8)
        image = Image.fromarray(grey, mode="L")
    elif image.mode == "F":
        raise ValueError("floating-point (mode F) images are not supported: their value range is unknown; save them "
                         "as 8- or 16-bit PNG")
    image = image.convert("RGB")
    if resolution is not None:
        width, height = image.size
        scale = resolution / min(width, height)
        size = (max(resolution, round(width * scale)), max(resolution, round(height * scale)))
        if size != image.size:
            image = image.resize(size, Image.BILINEAR)
        left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
        image = image.crop((left, top, left + resolution, top + resolution))
    array = np.asarray(image, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float() / 255.0


def load_image(value: Any, where: str, resolution: int | None, root: str | os.PathLike | None = None) -> torch.Tensor:
    """`open_image` then `prepare_image`: a float32 `(3, resolution, resolution)` tensor in [0, 1]."""
    image = open_image(value, where, root)
    try:
        return prepare_image(image, resolution)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def require_path(data_cfg, key: str) -> None:
    """Refuses a data config (``cfg.data``) whose file or folder field `key` is unset (``???``) or does not exist.

    Raises:
        ValueError: when it is unset, naming ``data.<key>`` and the data set.
        FileNotFoundError: when the path does not exist.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_missing(data_cfg, key):
        raise ValueError(f"data.{key} is required for data={data_cfg._target_.rsplit('.', 1)[-1]}; pass "
                         f"data.{key}=<file or folder>")
    if not Path(data_cfg[key]).exists():
        raise FileNotFoundError(f"data.{key}={data_cfg[key]!r} does not exist")
