"""Pick-a-Pic v2 preference pairs (Kirstain et al., arXiv:2305.01569; ``yuvalkirstain/pickapic_v2``), from parquet or
jsonl.

Rows hold a caption, two images and their labels: ``caption``, ``jpg_0``, ``jpg_1``, ``label_0``, ``label_1`` in the
released parquet shards (field names are configurable). ``label_0`` is the preference for image 0: 1 → image 0 wins,
0 → image 1 wins, 0.5 → tie (dropped and counted); anything else raises, naming the row
(docs/guides/field_cases.md#preference-ties-and-winner-order; the tie and ordering rules are `PreferencePairs`').
Images are bytes (parquet binary, or a Hugging Face ``Image`` struct ``{"bytes", "path"}``) or paths; in jsonl, a path
string (relative to `image_root`, default the jsonl's folder) or ``{"bytes": <base64>}``. They are decoded only when a
pair is read, converted to RGB, resized and center-cropped to `resolution` (`diffalign.data.images`); a corrupt image
raises an error naming the file, row and field.

Parquet needs ``pyarrow`` (imported only for parquet input). Each shard is read with ``memory_map=True``; for the full
data set (~850k pairs with image bytes) point `path` at a subset of shards or use `max_rows`.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffalign.config.schemas import config_schema
from diffalign.data.images import load_image, require_path
from diffalign.data.preference import PreferencePairs


@config_schema("data", "pickapic")
@dataclass
class PickAPicPairsConfig:
    """Config of `PickAPicPairs`; the fields mirror its `__init__`."""


    _target_: str = "diffalign.data.pickapic.PickAPicPairs"
    path: str = "???"
    resolution: int | None = None  # null: the model's pixel size; shorter side + center crop
    caption_field: str = "caption"
    image_fields: list[str] = field(default_factory=lambda: ["jpg_0", "jpg_1"])
    image_root: str | None = None  # relative image paths' folder; default the jsonl's
    keep_ties: bool = False
    winners_only: bool = False  # read only the winners (SePPO)
    max_rows: int | None = None


@dataclass(frozen=True)
class _ParquetCell:
    """An image value left in its parquet shard until read."""

    shard: int
    column: str
    row: int


def _import_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            "reading Pick-a-Pic parquet shards needs pyarrow: `pip install pyarrow`, or convert the rows to jsonl "
            "(data.path=<file>.jsonl)."
        ) from err
    return pq


class PickAPicPairs:
    """Pick-a-Pic-layout preference pairs, winner first, ties dropped and counted.

    Args:
        path (`str`): a ``.jsonl`` file, a ``.parquet`` file, or a folder whose ``*.parquet`` files (searched
            recursively, sorted by name) are the shards.
        resolution (`int`, *optional*): image side in pixels after resize + center crop (the model's pixel size,
            e.g. 512 for SD1.5). The training loop fills in the model's size when it is `None`.
        caption_field (`str`, defaults to "caption"): the prompt column.
        image_fields (`list[str]`, defaults to ``["jpg_0", "jpg_1"]``): the columns of image 0 and image 1.
        image_root (`str`, *optional*): folder of relative image paths; default the jsonl's folder.
        keep_ties (`bool`, defaults to False): see `PreferencePairs`.
        winners_only (`bool`, defaults to False): `collate` returns (and reads) only the winners (SePPO).
        max_rows (`int`, *optional*): read at most this many rows (ties included), in file order.

    Attributes:
        num_ties (`int`): tied rows found; `num_ties_dropped` those dropped.
        source (`str`): `path`, used in error messages.

    Raises:
        ValueError: naming the file and row, for a missing field, a label other than 0, 0.5 or 1, or ``label_1``
            inconsistent with ``label_0``; for a missing `path`, no parquet shard, or `max_rows` < 1.
        ImportError: for parquet input without pyarrow (the message says what to install).
    """

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): ``data.path`` is given and
        exists.

        Raises:
            ValueError, FileNotFoundError: naming ``data.path``.
        """
        from diffalign.config.checks import boolean, integer

        integer(cfg.data, "resolution", "data", ge=8, nullable=True, hint="null: the model's pixel size")
        integer(cfg.data, "max_rows", "data", ge=1, nullable=True)
        boolean(cfg.data, "keep_ties", "data")
        boolean(cfg.data, "winners_only", "data")
        require_path(cfg.data, "path")


    def __init__(
        self,
        path: str,
        resolution: int | None = None,
        caption_field: str = "caption",
        image_fields: list[str] | tuple[str, str] = ("jpg_0", "jpg_1"),
        image_root: str | None = None,
        keep_ties: bool = False,
        winners_only: bool = False,
        max_rows: int | None = None,
    ):
        if len(image_fields) != 2:
            raise ValueError(f"data.image_fields={list(image_fields)} must name two columns (image 0, image 1).")
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"data.max_rows={max_rows} must be >= 1 or null.")
        source = Path(path)
        if not source.exists():
            raise ValueError(f"data.path={path!r} does not exist; point it at a Pick-a-Pic .parquet/.jsonl file or a "
                             "folder of parquet shards.")
        self.source, self.resolution, self.winners_only = str(path), resolution, winners_only
        self.caption_field, self.image_fields = caption_field, tuple(image_fields)
        self._tables: list[Any] = []
        self._shard_names: list[str] = []
        if source.suffix == ".jsonl":
            self.image_root = image_root if image_root is not None else str(source.parent)
            records = self._read_jsonl(source, max_rows)
        else:
            self.image_root = image_root
            records = self._read_parquet(source, max_rows)
        rows = []
        for where, record in records:
            missing = [k for k in (caption_field, *self.image_fields, "label_0") if k not in record]
            if missing:
                raise ValueError(f"{where} lacks fields {missing}; Pick-a-Pic rows need {caption_field!r}, "
                                 f"{list(self.image_fields)} and 'label_0' (set data.caption_field/image_fields).")
            label_0, label_1 = record["label_0"], record.get("label_1")
            if (label_1 is not None and isinstance(label_0, numbers.Real) and isinstance(label_1, numbers.Real)
                    and abs(float(label_0) + float(label_1) - 1.0) > 1e-6):
                raise ValueError(f"{where} has label_0={label_0!r} and label_1={label_1!r}, which do not sum to 1; fix "
                                 "or drop the row.")
            if isinstance(label_0, numbers.Real) and not isinstance(label_0, bool) and float(label_0) not in (0, .5, 1):
                raise ValueError(f"{where} has label_0={label_0!r}; expected 1 (image 0 wins), 0 (image 1 wins) or "
                                 "0.5 (tie). Fix or filter the row.")
            rows.append({"prompt": record[caption_field], "image_0": (where, self.image_fields[0],
                                                                       record[self.image_fields[0]]),
                         "image_1": (where, self.image_fields[1], record[self.image_fields[1]]), "label_0": label_0})
        self.pairs = PreferencePairs(rows, keep_ties=keep_ties, load_image=self._load)

    def _read_jsonl(self, path: Path, max_rows: int | None) -> list[tuple[str, dict]]:
        records = []
        with open(path, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle):
                if max_rows is not None and len(records) >= max_rows:
                    break
                if not line.strip():
                    continue
                where = f"{path.name} row {len(records)} (line {line_no + 1})"
                try:
                    records.append((where, json.loads(line)))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{where}: not valid JSON ({err}).") from err
        return records

    def _read_parquet(self, path: Path, max_rows: int | None) -> list[tuple[str, dict]]:
        pq = _import_pyarrow_parquet()
        shards = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
        if not shards:
            raise ValueError(f"data.path={str(path)!r} holds no *.parquet shard.")
        records = []
        for shard_index, shard in enumerate(shards):
            table = pq.read_table(shard, memory_map=True)
            self._tables.append(table)
            self._shard_names.append(shard.name)
            names = set(table.column_names)
            scalar_columns = [c for c in (self.caption_field, "label_0", "label_1") if c in names]
            scalars = {c: table.column(c).to_pylist() for c in scalar_columns}
            for row in range(table.num_rows):
                if max_rows is not None and len(records) >= max_rows:
                    return records
                record = {c: scalars[c][row] for c in scalar_columns}
                record.update({c: _ParquetCell(shard_index, c, row) for c in self.image_fields if c in names})
                records.append((f"{shard.name} row {row}", record))
        return records

    def _load(self, value: tuple[str, str, Any], role: str) -> torch.Tensor:
        where, column, cell = value
        if isinstance(cell, _ParquetCell):
            cell = self._tables[cell.shard].column(cell.column)[cell.row].as_py()
        return load_image(cell, f"{where} {column} ({role.split()[-1]})", self.resolution, self.image_root)

    @property
    def num_ties(self) -> int:
        return self.pairs.num_ties

    @property
    def num_ties_dropped(self) -> int:
        return self.pairs.num_ties_dropped

    @property
    def stats(self) -> dict:
        """What `prepare` made: nothing (the preference loop's data contract)."""
        return {}

    def prepare(self, policy, rewards) -> None:
        """Nothing to make before training: the data is static (the preference loop's data contract)."""

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor, torch.Tensor, int]:
        """``(prompt, image_w, image_l, row id)``, images float32 `(3, R, R)` in [0, 1]."""
        return self.pairs[index]

    def collate(self, indices: list[int]) -> dict[str, Any]:
        """``{"prompts", "images_w" (B,3,R,R), "images_l" (unless winners_only), "ids" (B,)}``; see
        `PreferencePairs.collate`."""
        return self.pairs.collate(indices, winners_only=self.winners_only)
