"""Writing images and videos to files (PNG, GIF, MP4).

Pixel tensors follow the project layout: an image is `(C, H, W)` and a video `(F, C, H, W)`, float in [0, 1]
(values outside are clamped), `C` = 3 (RGB) or 1 (grey). GIF is written with `diffusers.utils.export_to_gif` (Pillow;
plays in every browser, loops forever, 1000 // fps ms per frame); MP4 (H.264, yuv420p) with imageio's ffmpeg plugin
(`imageio-ffmpeg`, whose wheel ships an ffmpeg binary), called directly rather than through
`diffusers.utils.export_to_video` to keep the codec, pixel format and even-size padding explicit. Every file goes
through a temporary name and a rename (`diffalign.runtime.storage.atomic_file`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from diffalign.runtime.storage import atomic_file

VIDEO_FORMATS = ("gif", "mp4")


def to_uint8(pixels: torch.Tensor) -> np.ndarray:
    """`(..., C, H, W)` float in [0, 1] → `(..., H, W, C)` uint8 (rounded, as `torchvision.utils.save_image`)."""
    return pixels.detach().float().cpu().clamp(0, 1).mul(255).add(0.5).to(torch.uint8).movedim(-3, -1).numpy()


def save_png(image: torch.Tensor, path: str | Path) -> None:
    """Writes one image `(C, H, W)` in [0, 1] as a PNG (parent folders are made), through a temporary file and a
    rename (`diffalign.runtime.storage.atomic_file`): a full disk leaves no empty or truncated PNG.

    Raises:
        DiskFullError: the disk filled up (naming the file; nothing is left at `path`).
    """
    array = to_uint8(image)
    picture = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    atomic_file(path, lambda tmp: picture.save(tmp, format="PNG"), what=str(path))


def save_video(frames: torch.Tensor, path: str | Path, fps: float = 8.0) -> Path:
    """Writes a video `(F, C, H, W)` in [0, 1] to `path`; the suffix chooses the format (``.gif`` or ``.mp4``).

    MP4 frames are padded at the bottom/right to even sizes (H.264 with yuv420p needs them); GIF loops forever.

    Args:
        frames: `(F, C, H, W)` float tensor, F ≥ 1, C in {1, 3}.
        path: the output file; parent folders are made.
        fps: frames per second (> 0).

    Returns:
        `path` as a `Path`.

    Raises:
        ValueError: for a tensor of another shape, a non-positive `fps`, or a suffix other than .gif / .mp4.
        ImportError: for .mp4 without `imageio-ffmpeg` installed (a dependency of diffalign).
        DiskFullError: the disk filled up (written through a temporary file: nothing is left at `path`).
    """
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if frames.ndim != 4 or frames.shape[0] < 1 or frames.shape[1] not in (1, 3):
        raise ValueError(f"save_video needs frames (F, C, H, W) with C in (1, 3), got shape {tuple(frames.shape)}")
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    if suffix not in VIDEO_FORMATS:
        raise ValueError(f"save_video writes {VIDEO_FORMATS}, got {path.name!r}; use a .gif or .mp4 path")
    array = to_uint8(frames)
    if array.shape[-1] == 1:
        array = np.repeat(array, 3, axis=-1)
    if suffix == "gif":
        from diffusers.utils import export_to_gif

        images = [Image.fromarray(a) for a in array]
        return atomic_file(path, lambda tmp: export_to_gif(images, str(tmp), fps=fps), what=str(path))
    import imageio.v2 as imageio

    h, w = array.shape[1:3]
    array = np.pad(array, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)))

    def write_mp4(tmp: Path) -> None:
        with imageio.get_writer(tmp, format="FFMPEG", mode="I", fps=fps, codec="libx264", pixelformat="yuv420p",
                                macro_block_size=1) as writer:
            for frame in array:
                writer.append_data(frame)

    return atomic_file(path, write_mp4, what=str(path))
