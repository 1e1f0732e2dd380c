"""Images and videos for the experiment trackers (``trainer.log_with``), through accelerate's trackers.

accelerate logs scalars to every tracker (``Accelerator.log``) and images to those whose tracker class has
``log_images``; it has no video call. Here the files a run already writes — the monitors' samples
(``logs/samples/step-<N>/``: PNG, or GIF / MP4 for video models) and the evaluation's overview grids and videos — are
logged to the two trackers diffalign supports with media:

- **TensorBoard** (the default): images with accelerate's ``TensorBoardTracker.log_images`` (``add_images``, one
  batch per key, or one image per key when their sizes differ); a video as an animated GIF image summary (what
  ``SummaryWriter.add_video`` writes, built here from the GIF without moviepy), shown in the Images tab;
- **Weights & Biases** (``trainer.log_with=wandb``, also offline with ``WANDB_MODE=offline``): images with
  ``WandBTracker.log_images`` (``wandb.Image``), videos as ``wandb.Video`` of the file (no re-encoding).

Other trackers get the scalars only. The wandb run folder is ``<output_dir>/logs/wandb/`` (`tracker_init_kwargs`).
docs/guides/evaluation.md#experiment-trackers.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

MEDIA_TRACKERS = ("tensorboard", "wandb")
"""The trackers that get images and videos (the others get the scalars only)."""


def tracker_init_kwargs(output_dir: str | Path) -> dict:
    """``init_kwargs`` of ``Accelerator.init_trackers`` for a run in `output_dir`: wandb writes its run folder under
    ``<output_dir>/logs/wandb/`` and names the run after the output folder (TensorBoard's folder comes from the
    accelerator's ``logging_dir``, ``<output_dir>/logs``)."""
    output_dir = Path(output_dir)
    return {"wandb": {"dir": str(output_dir / "logs"), "name": output_dir.name}}


def _media_trackers(accelerator) -> list:
    if accelerator is None or not accelerator.is_main_process:
        return []
    return [t for t in getattr(accelerator, "trackers", []) if t.name in MEDIA_TRACKERS]


def _rgb(path: Path) -> np.ndarray:
    """The (first frame of the) image file as `(H, W, 3)` uint8."""
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def log_images(accelerator, images: dict[str, Sequence[str | Path]], step: int,
               captions: dict[str, Sequence[str]] | None = None) -> None:
    """Logs image files to the run's media trackers (main process; nothing without one).

    Args:
        accelerator (`accelerate.Accelerator`): the run's, with its trackers started.
        images (`dict[str, Sequence[path]]`): per key (e.g. ``"monitor/samples"``), the PNG files to log there.
        step (`int`): the tracker step (the loop's own step axis: the optimizer step, or the epoch online).
        captions (`dict[str, Sequence[str]]`, *optional*): per key, one caption per file (wandb shows them).
    """
    for tracker in _media_trackers(accelerator):
        for key, paths in images.items():
            if not paths:
                continue
            if tracker.name == "wandb":
                import wandb

                texts = (captions or {}).get(key) or [None] * len(paths)
                tracker.tracker.log({key: [wandb.Image(str(p), caption=c) for p, c in zip(paths, texts)]}, step=step)
                continue
            arrays = [_rgb(Path(p)) for p in paths]
            if len({a.shape for a in arrays}) == 1:
                tracker.log_images({key: np.stack(arrays)}, step=step, dataformats="NHWC")
            else:  # add_images takes one size per batch
                tracker.log_images({f"{key}/{i}": a[None] for i, a in enumerate(arrays)}, step=step,
                                   dataformats="NHWC")


def gif_bytes(path: str | Path, fps: float = 8.0) -> bytes:
    """The video file (GIF or MP4) as GIF bytes: a GIF file as it is, an MP4 decoded (imageio) and written as a GIF of
    `fps` frames per second (`diffusers.utils.export_to_gif`, as `diffalign.runtime.media.save_video` writes GIFs)."""
    path = Path(path)
    if path.suffix.lower() == ".gif":
        return path.read_bytes()
    import tempfile

    import imageio.v3 as iio
    from diffusers.utils import export_to_gif

    frames = [Image.fromarray(f).convert("RGB") for f in iio.imread(path, index=None)]
    with tempfile.TemporaryDirectory() as folder:
        return Path(export_to_gif(frames, str(Path(folder) / "video.gif"), fps=fps)).read_bytes()


def log_videos(accelerator, videos: dict[str, Sequence[str | Path]], step: int, fps: float = 8.0,
               captions: dict[str, Sequence[str]] | None = None) -> None:
    """Logs video files (``.gif`` or ``.mp4``, as `diffalign.runtime.media.save_video` writes them) to the run's media
    trackers (main process).

    TensorBoard gets each as an animated GIF image summary ``<key>/<i>`` (the Images tab plays it), wandb the list
    under `key` as ``wandb.Video`` objects of the files.

    Args:
        accelerator (`accelerate.Accelerator`): the run's, with its trackers started.
        videos (`dict[str, Sequence[path]]`): per key, the video files.
        step (`int`): the tracker step.
        fps (`float`): frames per second of an MP4 re-encoded for TensorBoard.
        captions (`dict[str, Sequence[str]]`, *optional*): per key, one caption per file (wandb).
    """
    for tracker in _media_trackers(accelerator):
        for key, paths in videos.items():
            if not paths:
                continue
            if tracker.name == "wandb":
                import wandb

                texts = (captions or {}).get(key) or [None] * len(paths)
                tracker.tracker.log({key: [wandb.Video(str(p), caption=c, format=Path(p).suffix.lower().lstrip("."))
                                           for p, c in zip(paths, texts)]}, step=step)
                continue
            from tensorboard.compat.proto.summary_pb2 import Summary

            writer = tracker.tracker  # the SummaryWriter; add_video's own way to write a summary (without moviepy)
            for i, p in enumerate(paths):
                data = gif_bytes(p, fps)
                with Image.open(io.BytesIO(data)) as first:
                    width, height = first.size
                image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=data)
                writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=f"{key}/{i}", image=image)]),
                                                      step)
            writer.flush()
