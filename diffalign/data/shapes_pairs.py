"""Offline preference pairs from the shapes world (the embedded default data set).

Pair ``i`` is deterministic in ``(seed, i)``: a train prompt drawn with the world's tag weights, a winning image that
is a ground-truth render of the prompt, and a losing image that renders a corrupted spec (another colour, a count off
by one, another shape, or the two objects of a position prompt swapped; see `diffalign.world.render.corrupt_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffalign.config.schemas import config_schema
from diffalign.world.prompts import load_prompts, sample_train_specs
from diffalign.world.render import corrupt_spec, render_spec, to_tensor


@config_schema("data", "shapes_pairs")
@dataclass
class ShapesPairsConfig:
    """Config of `ShapesPairs` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.data.shapes_pairs.ShapesPairs"
    prompts: str = "train"
    num_pairs: int = 4096
    seed: int = 0


class ShapesPairs:
    """`num_pairs` winner/loser pairs for the prompts of `prompts` (a shipped split name or a GenEval jsonl path).

    ``pairs[i]`` is a dict with ``id`` (int), ``prompt`` (str), ``metadata`` (the prompt's GenEval row),
    ``image_w`` and ``image_l`` float32 `(3, 32, 32)` in [0, 1], and ``loser_kind`` (how the loser was corrupted).

    Raises:
        ValueError: if `num_pairs` < 1 (set ``data.num_pairs``), or the prompt file has no shapes-world metadata.
        FileNotFoundError: if `prompts` is neither a shipped split nor an existing file.
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): the prompt file, and a batch
        no larger than the data.

        Raises:
            ValueError, FileNotFoundError: naming the field and the fix.
        """
        from diffalign.config.checks import integer, seed

        integer(cfg.data, "num_pairs", "data", ge=1)
        seed(cfg.data, "seed", "data")
        load_prompts(cfg.data.prompts, field="data.prompts")
        if cfg.data.num_pairs is not None and cfg.trainer.batch_size > cfg.data.num_pairs:
            raise ValueError(f"trainer.batch_size={cfg.trainer.batch_size} is larger than data.num_pairs="
                             f"{cfg.data.num_pairs}; lower trainer.batch_size or raise data.num_pairs")


    def __init__(self, prompts: str = "train", num_pairs: int = 4096, seed: int = 0):
        if num_pairs < 1:
            raise ValueError(f"data.num_pairs must be >= 1, got {num_pairs}")
        rows = load_prompts(prompts)
        if any("include" not in r for r in rows):
            raise ValueError(f"data.prompts={prompts!r}: ShapesPairs needs GenEval-style rows with 'include' metadata")
        self.rows, self.num_pairs, self.seed = rows, num_pairs, seed
        self.specs = sample_train_specs(num_pairs, seed=seed, rows=rows)

    @property
    def stats(self) -> dict:
        """What `prepare` made: nothing (the preference loop's data contract)."""
        return {}

    def prepare(self, policy, rewards) -> None:
        """Nothing to make before training: the data is static (the preference loop's data contract)."""

    def __len__(self) -> int:
        return self.num_pairs

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_pairs:
            raise IndexError(i)
        spec = self.specs[i]
        pair_seed = int(np.random.default_rng([self.seed, i]).integers(2**31))
        bad, kind = corrupt_spec(spec, pair_seed)
        return {
            "id": i,
            "prompt": spec["prompt"],
            "metadata": spec,
            "image_w": to_tensor(render_spec(spec, pair_seed)),
            "image_l": to_tensor(render_spec(bad, pair_seed + 1)),
            "loser_kind": kind,
        }

    def collate(self, indices: list[int]) -> dict:
        """Stacks pairs `indices` into ``{"ids" (B,), "prompts", "metadata", "images_w" (B,3,H,W), "images_l"}``."""
        items = [self[i] for i in indices]
        return {
            "ids": torch.tensor([it["id"] for it in items], dtype=torch.long),
            "prompts": [it["prompt"] for it in items],
            "metadata": [it["metadata"] for it in items],
            "images_w": torch.stack([it["image_w"] for it in items]),
            "images_l": torch.stack([it["image_l"] for it in items]),
        }
