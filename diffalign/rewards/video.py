"""Video rewards: any image reward applied per frame, temporal consistency, and the tiny world's motion verifier.

Layout: videos are `(B, F, 3, H, W)` in [0, 1] (`policy.decode` of a video model,
docs/methods/algorithms.md#latent-layouts: pixels are always frames-first); ``layout="BCFHW"`` accepts channels-first
`(B, 3, F, H, W)` tensors instead. Prompt i (and metadata row i) always belongs to video i: per-frame rewards see
prompt i repeated F times for the F frames of video i (frames taken along the time axis, in time order), and the
per-frame scores are folded back as `(B, F)`.

- `per_frame` — ``reward.per_frame.image_reward=<registered image reward>`` (e.g. ``clip_score``, ``aesthetic``,
  ``geneval_shapes``), aggregated over frames by ``mean`` or ``min``; ``info["per_frame"]`` keeps the `(B, F)` scores.
- `temporal_consistency` — VBench-style subject consistency: the mean over t ≥ 1 of
  ½(cos(f_t, f_{t−1}) + cos(f_t, f_0)) of per-frame features f (the tiny CLIP's image embeddings by default, or raw
  pixels with ``features=pixels``); 1 for a still video.
- `video_motion` — the tiny world's motion verifier (`diffalign.world.video.verify_video`): dense fraction of the
  prompt's constraints met (identity kept across frames, direction of motion, no extra objects) or binary correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from diffalign.config.schemas import config_schema
from diffalign.types import RewardOutput

LAYOUTS = ("BFCHW", "BCFHW")


def frames_first(videos: torch.Tensor, layout: str = "BFCHW") -> torch.Tensor:
    """`videos` as `(B, F, 3, H, W)`.

    Raises:
        ValueError: for an unknown layout or a tensor that is not 5-D with 3 channels where the layout says.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    if videos.ndim != 5:
        raise ValueError(f"videos must be 5-D {layout}, got shape {tuple(videos.shape)}")
    out = videos if layout == "BFCHW" else videos.transpose(1, 2)
    if out.shape[2] != 3:
        raise ValueError(f"videos in layout {layout} must have 3 channels, got shape {tuple(videos.shape)}")
    return out


@config_schema("reward", "per_frame")
@dataclass
class PerFrameConfig:
    """Config of `PerFrame` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.video.PerFrame"
    image_reward: str = "clip_score"
    image_reward_kwargs: Optional[dict[str, Any]] = None  # noqa: UP045 — OmegaConf needs Optional
    aggregate: str = "mean"
    layout: str = "BFCHW"


class PerFrame:
    """An image reward applied to every frame of every video, aggregated over time.

    Args:
        image_reward (`str` or reward object): a registered image reward name (built with its config defaults
            overridden by `image_reward_kwargs`) or an object ``(images, prompts, metadata) -> RewardOutput``.
        aggregate (`str`): "mean" or "min" over frames.
        layout (`str`): "BFCHW" (default) or "BCFHW".

    Raises:
        ValueError: for an unknown aggregate or layout.
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    judges_correctness = True  # info["correct"] when its image reward reports it (every frame correct)

    name = "per_frame"
    differentiable = False

    def __init__(self, image_reward: Any = "clip_score", image_reward_kwargs: dict | None = None,
                 aggregate: str = "mean", layout: str = "BFCHW"):
        if aggregate not in ("mean", "min"):
            raise ValueError(f"reward.per_frame.aggregate={aggregate!r} must be 'mean' or 'min'")
        if layout not in LAYOUTS:
            raise ValueError(f"reward.per_frame.layout={layout!r} must be one of {LAYOUTS}")
        if isinstance(image_reward, str):
            from diffalign.rewards.reward_set import build_reward

            image_reward = build_reward(image_reward, **dict(image_reward_kwargs or {}))
        self.image_reward, self.aggregate, self.layout = image_reward, aggregate, layout

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        v = frames_first(videos, self.layout)
        b, f = v.shape[:2]
        if len(prompts) != b or (metadata is not None and len(metadata) != b):
            raise ValueError(f"got {b} videos, {len(prompts)} prompts and "
                             f"{None if metadata is None else len(metadata)} metadata rows; pass one per video")
        out = self.image_reward(v.reshape(b * f, *v.shape[2:]), [p for p in prompts for _ in range(f)],
                                None if metadata is None else [m for m in metadata for _ in range(f)])
        per_frame = out.scores.float().reshape(b, f)
        scores = per_frame.mean(dim=1) if self.aggregate == "mean" else per_frame.amin(dim=1)
        info = {"per_frame": per_frame}
        if "correct" in out.info:
            info["correct"] = torch.as_tensor(out.info["correct"]).reshape(b, f).all(dim=1)
        return RewardOutput(scores, info)


@config_schema("reward", "temporal_consistency")
@dataclass
class TemporalConsistencyConfig:
    """Config of `TemporalConsistency` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.video.TemporalConsistency"
    features: str = "tiny_clip"
    layout: str = "BFCHW"


class TemporalConsistency:
    """VBench-style subject consistency of each video (see the module docstring); in [−1, 1], 1 when still.

    Args:
        features (`str`): "tiny_clip" (the tiny world's CLIP image embeddings), "pixels", or any callable
            `(N, 3, H, W) -> (N, d)`.
        layout (`str`): "BFCHW" or "BCFHW".
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "temporal_consistency"
    differentiable = False

    def __init__(self, features: Any = "tiny_clip", layout: str = "BFCHW"):
        if layout not in LAYOUTS:
            raise ValueError(f"reward.temporal_consistency.layout={layout!r} must be one of {LAYOUTS}")
        if features == "tiny_clip":
            from diffalign.rewards.clip_score import ClipScore

            clip = ClipScore()
            features = clip.embed_images
        elif features == "pixels":
            features = lambda x: x.reshape(len(x), -1) - 0.5
        elif not callable(features):
            raise ValueError(f"reward.temporal_consistency.features={features!r} must be 'tiny_clip' or 'pixels'")
        self.features, self.layout = features, layout

    @torch.no_grad()
    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        v = frames_first(videos, self.layout).float()
        b, f = v.shape[:2]
        if len(prompts) != b:
            raise ValueError(f"got {b} videos and {len(prompts)} prompts; pass one per video")
        if f < 2:
            return RewardOutput(torch.ones(b), {"per_frame": torch.ones(b, f)})
        feats = F.normalize(torch.as_tensor(self.features(v.reshape(b * f, *v.shape[2:]))).float().reshape(b, f, -1),
                            dim=-1)
        prev = (feats[:, 1:] * feats[:, :-1]).sum(-1)
        first = (feats[:, 1:] * feats[:, :1]).sum(-1)
        per = 0.5 * (prev + first)
        return RewardOutput(per.mean(dim=1), {"per_frame": per})


@config_schema("reward", "video_motion")
@dataclass
class VideoMotionConfig:
    """Config of `VideoMotion` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.video.VideoMotion"
    score: str = "dense"
    layout: str = "BFCHW"


class VideoMotion:
    """The tiny world's motion verifier as a reward (`diffalign.world.video.verify_video`).

    Call with videos `(B, F, 3, H, W)` in [0, 1], `B` video captions (or metadata rows with ``include`` entries that
    carry a ``motion``). Returns ``scores`` (dense fraction of constraints met, or binary) and ``info``:
    ``correct`` `(B,)` bool, ``tag``, ``failed`` (names of the failed constraints), ``tracks``.

    Raises:
        ValueError: for an unknown score mode, mismatched batch sizes, or a prompt that is not a video caption and
            comes without metadata.
    """

    modality = "video"  # what it makes (policies) or scores (rewards); validation pairs the two on it

    name = "video_motion"
    differentiable = False

    def __init__(self, score: str = "dense", layout: str = "BFCHW"):
        if score not in ("dense", "binary"):
            raise ValueError(f"reward.video_motion.score must be 'dense' or 'binary', got {score!r}")
        self.score, self.layout = score, layout

    def __call__(self, videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        from diffalign.world.video import parse_video_caption, verify_video

        v = frames_first(videos, self.layout)
        if len(prompts) != len(v) or (metadata is not None and len(metadata) != len(v)):
            raise ValueError(f"got {len(v)} videos, {len(prompts)} prompts and "
                             f"{None if metadata is None else len(metadata)} metadata rows; pass one per video")
        pixels = (v.detach().float().clamp(0, 1).permute(0, 1, 3, 4, 2).cpu().numpy() * 255 + 0.5).astype(np.uint8)
        specs = [m if m is not None and "include" in m and all("motion" in e for e in m["include"])
                 else parse_video_caption(p) for p, m in zip(prompts, metadata or [None] * len(prompts))]
        verdicts = [verify_video(x, s) for x, s in zip(pixels, specs)]
        correct = torch.tensor([d.correct for d in verdicts], dtype=torch.bool)
        dense = torch.tensor([d.score for d in verdicts], dtype=torch.float32)
        return RewardOutput(dense if self.score == "dense" else correct.float(),
                            {"correct": correct, "tag": [s["tag"] for s in specs],
                             "failed": [[k for k, ok in d.constraints.items() if not ok] for d in verdicts],
                             "tracks": [d.tracks for d in verdicts]})
