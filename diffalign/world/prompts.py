"""Prompts of the shapes world in GenEval's metadata format, split into train and held-out.

Each row is ``{"tag": ..., "include": [...], "prompt": ...}`` as in GenEval's ``evaluation_metadata.jsonl``; for
position prompts the subject entry carries ``"position": [relation, anchor_index]``.

Tags and templates:

=============  ==========================================  ======================
tag            example                                     split
=============  ==========================================  ======================
single_object  "a circle"                                  held-out only
colors         "a red circle"                              4 of 12 held-out
counting       "two circles", "three blue squares"         8 of 30 held-out
two_object     "a circle and a square"                     circle+triangle held-out
color_attr     "a red circle and a green triangle"         held-out object pairs
position       "a red circle left of a green triangle"     held-out object pairs
=============  ==========================================  ======================

`HELDOUT_PAIRS` lists 10 of the 66 unordered pairs of (colour, shape) object types; every color_attr and position
caption using one of them is held out entirely (compositional generalisation). No caption is in both splits.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path

import numpy as np

from diffalign.world.render import COLORS, RELATIONS, SHAPES, caption

TAGS = ("single_object", "colors", "counting", "two_object", "color_attr", "position")
TYPES = [(c, s) for c in COLORS for s in SHAPES]
_rng = np.random.default_rng(2024)
_ALL_PAIRS = list(itertools.combinations(TYPES, 2))
HELDOUT_PAIRS = frozenset(frozenset(_ALL_PAIRS[i]) for i in _rng.choice(len(_ALL_PAIRS), size=10, replace=False))
TRAIN_TAG_WEIGHTS = {"colors": 0.15, "counting": 0.2, "two_object": 0.1, "color_attr": 0.2, "position": 0.35}
PROMPT_DIR = Path(__file__).parent / "prompts"


def _obj(color: str | None, shape: str, count: int = 1) -> dict:
    e = {"class": shape, "count": count}
    if color:
        e["color"] = color
    return e


def _row(tag: str, include: list[dict]) -> dict:
    spec = {"tag": tag, "include": include}
    spec["prompt"] = caption(spec)
    return spec


def all_prompts() -> dict[str, list[dict]]:
    """Every prompt of the world, by split: ``{"train": [...], "heldout": [...]}`` (deterministic order)."""
    train: list[dict] = []
    held: list[dict] = []
    for s in SHAPES:
        held.append(_row("single_object", [_obj(None, s)]))
    for i, (c, s) in enumerate(TYPES):
        (held if i % 3 == list(COLORS).index(c) % 3 else train).append(_row("colors", [_obj(c, s)]))
    counting = [(n, c, s) for n in (2, 3) for c in [None, *COLORS] for s in SHAPES]
    for i, (n, c, s) in enumerate(counting):
        (held if i % 4 == 1 else train).append(_row("counting", [_obj(c, s, n)]))
    for s1, s2 in itertools.permutations(SHAPES, 2):
        (held if {s1, s2} == {"circle", "triangle"} else train).append(_row("two_object", [_obj(None, s1),
                                                                                            _obj(None, s2)]))
    for a, b in itertools.permutations(TYPES, 2):
        dest = held if frozenset((a, b)) in HELDOUT_PAIRS else train
        dest.append(_row("color_attr", [_obj(*a), _obj(*b)]))
        for rel in RELATIONS:
            subj = _obj(*a)
            subj["position"] = [rel, 0]
            dest.append(_row("position", [_obj(*b), subj]))
    return {"train": train, "heldout": held}


def load_prompts(split_or_path: str, field: str = "data.prompts") -> list[dict]:
    """Rows ``{"prompt": ..., ...}`` of a prompt file, or of the shipped split ``"train"`` / ``"heldout"``.

    Formats, by suffix:

    - ``.jsonl``: one JSON object per line with a ``prompt`` field; GenEval's ``evaluation_metadata.jsonl`` rows
      (``tag``, ``include``, ``exclude``) are kept whole, so rewards and the per-tag breakdown can use them;
    - ``.csv`` / ``.tsv``: a header row; the prompt column is the first named ``prompt``, ``prompts`` or ``text``
      (any case; DrawBench's ``Prompts``, PartiPrompts' ``Prompt``), a ``category`` column becomes the row's ``tag``
      (the per-tag breakdown), and every other column is kept under its lower-cased name;
    - anything else (``.txt``): one prompt per non-empty line.

    Blank lines (and CSV rows with an empty prompt cell) are skipped. Files are read as UTF-8 (a BOM is allowed).

    Raises:
        FileNotFoundError: when the path does not exist (the message says which splits ship with the package).
        ValueError: when the path is a folder (the message names a few prompt files in it), the file holds no
            prompts, is not UTF-8, a jsonl line is not JSON or lacks a ``prompt`` field, a jsonl prompt is not a
            string or is empty/whitespace, or a CSV/TSV has no prompt column; the message names the file and line.
    """
    shipped = ("train", "heldout", "video_train", "video_heldout")  # video_*: diffalign.world.video
    path = PROMPT_DIR / f"{split_or_path}.jsonl" if split_or_path in shipped else Path(split_or_path)
    if path.is_dir():
        inside = sorted(str(f) for f in path.iterdir() if f.suffix in (".jsonl", ".txt", ".csv", ".tsv"))[:3]
        raise ValueError(f"{field}={split_or_path!r} is a folder, not a prompt file; set {field} to one file "
                         f"(.jsonl/.csv/.tsv/.txt){', e.g. ' + ' or '.join(inside) if inside else ''}, or to a "
                         "shipped split ('train' / 'heldout'; video: 'video_train' / 'video_heldout')")
    if not path.is_file():
        raise FileNotFoundError(f"{field}={split_or_path!r}: prompt file {str(path)!r} does not exist; set {field} to a "
                                "jsonl/csv/tsv/txt file or to one of the shipped splits 'train' / 'heldout' (video: "
                                "'video_train' / 'video_heldout')")
    rows = []
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ValueError(f"{field}: {path}:{line} is not UTF-8 (byte {err.object[err.start:err.start + 1]!r} at offset "
                         f"{err.start}); re-save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path.name}`") from None
    if path.suffix.lower() in (".csv", ".tsv"):
        records = list(csv.DictReader(io.StringIO(text, newline=""),
                                      delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        fieldnames = list(records[0]) if records else []
        columns = {c.strip().lower(): c for c in fieldnames if c is not None}
        prompt_col = next((columns[c] for c in ("prompt", "prompts", "text") if c in columns), None)
        if records and prompt_col is None:
            raise ValueError(f"{field}: {path} has no prompt column (header {fieldnames}); name it 'prompt', "
                             "'prompts' or 'text'")
        for record in records:
            if not (record.get(prompt_col) or "").strip():
                continue
            row = {k.strip().lower(): v for k, v in record.items() if k is not None and k != prompt_col}
            if "category" in row:
                row["tag"] = row.pop("category")
            rows.append({"prompt": record[prompt_col].strip(), **row})
    else:
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line) if path.suffix == ".jsonl" else {"prompt": line.strip()}
            except json.JSONDecodeError as err:
                raise ValueError(f"{field}: {path}:{n}: not a JSON object ({err})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{field}: {path}:{n}: row has no 'prompt' field")
            if not isinstance(row["prompt"], str) or not row["prompt"].strip():
                raise ValueError(f"{field}: {path}:{n}: prompt {row['prompt']!r} is empty or not text; give it text "
                                 "or remove the line")
            rows.append(row)
    if not rows:
        raise ValueError(f"{field}={split_or_path!r}: prompt file {str(path)!r} holds no prompts; add at least one line")
    return rows


def sample_train_specs(n: int, seed: int, rows: list[dict] | None = None) -> list[dict]:
    """`n` train prompts drawn with `TRAIN_TAG_WEIGHTS` per tag, uniformly within a tag; deterministic in `seed`."""
    rows = rows if rows is not None else all_prompts()["train"]
    by_tag = {t: [r for r in rows if r["tag"] == t] for t in TAGS}
    tags = [t for t in TRAIN_TAG_WEIGHTS if by_tag[t]]
    p = np.array([TRAIN_TAG_WEIGHTS[t] for t in tags])
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(tags), size=n, p=p / p.sum())
    return [by_tag[tags[k]][rng.integers(len(by_tag[tags[k]]))] for k in picks]
