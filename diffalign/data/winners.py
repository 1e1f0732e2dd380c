"""Winning images only (SePPO's off-policy data; plain fine-tuning on winners): a folder of images with a captions
jsonl, and the shapes world's renders.

Both yield batches ``{"ids" (B,), "prompts", "images_w" (B, 3, R, R) float32 in [0, 1]}`` (plus ``"metadata"`` for the
shapes world), the ``winners`` data flow of `diffalign.train.preference`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffalign.config.schemas import config_schema
from diffalign.data.images import load_image, require_path
from diffalign.world.prompts import load_prompts, sample_train_specs
from diffalign.world.render import render_spec, to_tensor


@config_schema("data", "winner_folder")
@dataclass
class WinnerFolderConfig:
    """Config of `WinnerFolder`; the fields mirror its `__init__`."""

    _target_: str = "diffalign.data.winners.WinnerFolder"
    captions: str = "???"
    image_root: str | None = None  # default: the jsonl's folder
    resolution: int | None = None  # null: the model's pixel size
    file_field: str = "file_name"
    caption_field: str = "caption"


class WinnerFolder:
    """Winning images listed in a captions jsonl: one row ``{"file_name": "img/0001.png", "caption": "..."}`` per
    image (the Hugging Face ``imagefolder`` ``metadata.jsonl`` convention; field names configurable).

    Args:
        captions (`str`): the jsonl file.
        image_root (`str`, *optional*): folder of the relative file names; default the jsonl's folder.
        resolution (`int`, *optional*): side after resize + center crop (`diffalign.data.images`); the training
            loop fills in the model's pixel size when `None`.
        file_field (`str`, defaults to "file_name"), caption_field (`str`, defaults to "caption"): the fields.

    Raises:
        ValueError: naming the file and line, if the jsonl is missing or empty, a line is not JSON or lacks a field; on
            read, naming the image, if it is missing or corrupt.
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): ``data.captions`` is given
        and exists.

        Raises:
            ValueError, FileNotFoundError: naming ``data.captions``.
        """
        from diffalign.config.checks import integer

        integer(cfg.data, "resolution", "data", ge=8, nullable=True, hint="null: the model's pixel size")
        require_path(cfg.data, "captions")


    def __init__(
        self,
        captions: str,
        image_root: str | None = None,
        resolution: int | None = None,
        file_field: str = "file_name",
        caption_field: str = "caption",
    ):
        path = Path(captions)
        if not path.is_file():
            raise ValueError(f"data.captions={captions!r} does not exist; point it at a jsonl with one "
                             f'{{"{file_field}": ..., "{caption_field}": ...}} row per winning image.')
        self.image_root = image_root if image_root is not None else str(path.parent)
        self.resolution = resolution
        self.rows: list[tuple[str, str, str]] = []
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            where = f"{path.name} line {line_no + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err}).") from err
            missing = [k for k in (file_field, caption_field) if k not in row]
            if missing:
                raise ValueError(f"{where} lacks {missing}; set data.file_field / data.caption_field to its fields.")
            self.rows.append((where, row[file_field], row[caption_field]))
        if not self.rows:
            raise ValueError(f"data.captions={captions!r} holds no rows.")

    @property
    def stats(self) -> dict:
        """What `prepare` made: nothing (the preference loop's data contract)."""
        return {}

    def prepare(self, policy, rewards) -> None:
        """Nothing to make before training: the data is static (the preference loop's data contract)."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]:
        """``(caption, image (3, R, R) in [0, 1])``."""
        where, file_name, caption = self.rows[index]
        return caption, load_image(file_name, f"{where} {file_name!r}", self.resolution, self.image_root)

    def collate(self, indices: list[int]) -> dict:
        """``{"ids" (B,), "prompts", "images_w" (B, 3, R, R)}``.

        Raises:
            ValueError: if the images differ in size (set data.resolution).
        """
        items = [self[i] for i in indices]
        shapes = {tuple(image.shape) for _, image in items}
        if len(shapes) != 1:
            raise ValueError(f"winners {list(indices)} have image shapes {sorted(shapes)}; set data.resolution.")
        return {"ids": torch.tensor(list(indices), dtype=torch.long), "prompts": [c for c, _ in items],
                "images_w": torch.stack([image for _, image in items])}


@config_schema("data", "shapes_winners")
@dataclass
class ShapesWinnersConfig:
    """Config of `ShapesWinners` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.data.winners.ShapesWinners"
    prompts: str = "train"
    num_samples: int = 4096
    seed: int = 0


class ShapesWinners:
    """Ground-truth renders of the shapes world's train prompts as off-policy winners (32×32 px).

    Winner ``i`` is exactly the winner of `diffalign.data.shapes_pairs.ShapesPairs` pair ``i`` for the same
    `prompts` and `seed` (same prompt draw, same render seed), so SePPO on these winners and Diffusion-DPO on the
    renderer pairs see the same winning images.

    Raises:
        ValueError: if `num_samples` < 1 (set ``data.num_samples``) or the prompt file has no shapes-world metadata.
        FileNotFoundError: if `prompts` is neither a shipped split nor an existing file.
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): the prompt file.

        Raises:
            ValueError, FileNotFoundError: naming ``data.prompts``.
        """
        from diffalign.config.checks import integer, seed

        integer(cfg.data, "num_samples", "data", ge=1)
        seed(cfg.data, "seed", "data")
        load_prompts(cfg.data.prompts, field="data.prompts")


    def __init__(self, prompts: str = "train", num_samples: int = 4096, seed: int = 0):
        if num_samples < 1:
            raise ValueError(f"data.num_samples must be >= 1, got {num_samples}")
        rows = load_prompts(prompts)
        if any("include" not in r for r in rows):
            raise ValueError(f"data.prompts={prompts!r}: ShapesWinners needs GenEval-style rows with 'include' metadata")
        self.num_samples, self.seed = num_samples, seed
        self.specs = sample_train_specs(num_samples, seed=seed, rows=rows)

    @property
    def stats(self) -> dict:
        """What `prepare` made: nothing (the preference loop's data contract)."""
        return {}

    def prepare(self, policy, rewards) -> None:
        """Nothing to make before training: the data is static (the preference loop's data contract)."""

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        spec = self.specs[i]
        render_seed = int(np.random.default_rng([self.seed, i]).integers(2**31))
        return {"id": i, "prompt": spec["prompt"], "metadata": spec, "image_w": to_tensor(render_spec(spec, render_seed))}

    def collate(self, indices: list[int]) -> dict:
        """``{"ids" (B,), "prompts", "metadata", "images_w" (B, 3, 32, 32)}``."""
        items = [self[i] for i in indices]
        return {"ids": torch.tensor([it["id"] for it in items], dtype=torch.long),
                "prompts": [it["prompt"] for it in items], "metadata": [it["metadata"] for it in items],
                "images_w": torch.stack([it["image_w"] for it in items])}
