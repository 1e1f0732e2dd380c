"""GenEval-style verifier reward for the shapes world.

For each image it detects the objects (colour segmentation + connected components + shape from fill ratio, see
`diffalign.world.verifier`) and checks every constraint of the prompt's GenEval metadata (class counts, colours,
relative positions, no extra objects). The score is either the dense fraction of constraints met (in [0, 1]) or the
binary GenEval correctness, as GenEval (Ghosh et al., arXiv:2310.11513) defines it for its six tags.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffalign.config.schemas import config_schema
from diffalign.types import RewardOutput
from diffalign.world.verifier import parse_caption, verify


@config_schema("reward", "geneval_shapes")
@dataclass
class GenevalShapesConfig:
    """Config of `GenevalShapes` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.geneval_shapes.GenevalShapes"
    score: str = "dense"


class GenevalShapes:
    """Verifier reward of the shapes world.

    Args:
        score: ``"dense"`` — the fraction of the prompt's constraints met, in [0, 1]; ``"binary"`` — 1.0 when all of
            them are met (GenEval correctness), else 0.0.

    Call: ``reward(images, prompts, metadata=None)`` with images `(B, 3, H, W)` float in [0, 1] (or videos
    `(B, F, 3, H, W)`, scored per frame and averaged), the `B` prompts, and optional GenEval metadata rows (a row
    without ``include`` is rebuilt from its caption with `parse_caption`). Returns a `RewardOutput` with ``scores``
    `(B,)` float32 and ``info``: ``correct`` `(B,)` bool, ``tag`` (list of GenEval tags), ``failed`` (per image, the
    names of the failed constraints) and ``detections`` (per image, the detected objects).

    Raises:
        ValueError: for an unknown `score` mode, a batch whose sizes disagree, or a prompt that is not a shapes-world
            caption and comes without metadata.
    """

    modality = "image"  # what it makes (policies) or scores (rewards); validation pairs the two on it
    judges_correctness = True  # its info["correct"]: per-sample pass/fail (data=failure_pairs reads it)

    name = "geneval_shapes"
    differentiable = False

    @classmethod
    def check_prompts(cls, rows: list[dict], where: str) -> None:
        """Refuses prompt rows it cannot score (before any model loads; `diffalign.config.validation`): a row needs
        GenEval ``include`` metadata or a shapes-world caption.

        Args:
            rows (`list[dict]`): prompt rows (``prompt`` and optional metadata).
            where (`str`): the prompt setting named in the error, e.g. ``eval.prompts='heldout'``.

        Raises:
            ValueError: naming `where`, the caption's problem and the fix.
        """
        for row in rows:
            if "include" not in row:
                try:
                    parse_caption(row["prompt"])
                except ValueError as err:
                    raise ValueError(f"{where}: {err}. reward=[geneval_shapes] scores shapes-world prompts only (or "
                                     "rows with GenEval 'include' metadata); drop that reward or use such a prompt "
                                     "file") from None

    def __init__(self, score: str = "dense"):
        if score not in ("dense", "binary"):
            raise ValueError(f"reward.geneval_shapes.score must be 'dense' or 'binary', got {score!r}")
        self.score = score

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        if images.ndim == 5:  # videos: score each frame, average
            b, f = images.shape[:2]
            out = self(
                images.flatten(0, 1),
                [p for p in prompts for _ in range(f)],
                None if metadata is None else [m for m in metadata for _ in range(f)],
            )
            correct = out.info["correct"].view(b, f).all(dim=1)
            return RewardOutput(
                out.scores.view(b, f).mean(1),
                {
                    "correct": correct,
                    "tag": out.info["tag"][::f],
                    "failed": out.info["failed"][::f],
                    "detections": out.info["detections"][::f],
                },
            )
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (B, 3, H, W) in [0, 1], got shape {tuple(images.shape)}")
        if len(prompts) != images.shape[0] or (metadata is not None and len(metadata) != images.shape[0]):
            raise ValueError(
                f"got {images.shape[0]} images, {len(prompts)} prompts and "
                f"{None if metadata is None else len(metadata)} metadata rows; pass one per image"
            )
        pixels = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255 + 0.5).astype(np.uint8)
        specs = [
            m if m is not None and "include" in m else parse_caption(p)
            for p, m in zip(prompts, metadata or [None] * len(prompts))
        ]
        verdicts = [verify(img, spec) for img, spec in zip(pixels, specs)]
        correct = torch.tensor([v.correct for v in verdicts], dtype=torch.bool)
        dense = torch.tensor([v.score for v in verdicts], dtype=torch.float32)
        return RewardOutput(
            scores=dense if self.score == "dense" else correct.float(),
            info={
                "correct": correct,
                "tag": [s["tag"] for s in specs],
                "failed": [v.failed for v in verdicts],
                "detections": [v.detections for v in verdicts],
            },
        )
