"""Atomic, pickle-free training checkpoints.

Layout of ``<output_dir>/checkpoint-<step>/``:

- ``pytorch_lora_weights.safetensors`` (and anything else) written by the caller's `lora_dir_writer`;
- ``optimizer.safetensors`` + ``optimizer.json``: the optimizer's ``state_dict()``, tensors flattened into
  safetensors and everything else (param groups, non-tensor state) in JSON with ``{"__tensor__": key}`` placeholders;
- ``scheduler.json`` (+ ``scheduler.safetensors`` if the LR scheduler state holds tensors);
- ``rng_state.safetensors`` (torch CPU, and CUDA per device when available) + ``rng_state.json`` (numpy, `random`);
- ``trainer_state.json``: the caller's `state` (global step, epoch, sampler position, ...).

A checkpoint is first written to ``<output_dir>/.tmp-checkpoint-<step>-<pid>``, fsynced and then renamed with
`os.replace`, so a crash never leaves a partial ``checkpoint-*`` directory. Nothing is pickled and nothing is read
with `torch.load`. Call these functions from the main process only.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from diffalign.runtime.files import save_safetensors
from diffalign.runtime.storage import DiskFullError, folder_bytes, is_disk_full

logger = logging.getLogger(__name__)

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_MARKERS = ("__tensor__", "__tuple__", "__items__")


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replaces tensors by ``{"__tensor__": key}`` (storing them in `tensors`) so the rest is JSON."""
    if isinstance(obj, torch.Tensor):
        key = path if path not in tensors else f"{path}#{len(tensors)}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _MARKERS for k in obj):
            return {k: _flatten(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise TypeError(f"cannot checkpoint {path}: dict key {k!r} of type {type(k).__name__} is not JSON.")
        return {"__items__": [[k, _flatten(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot checkpoint {path}: value of type {type(obj).__name__} is neither a tensor nor JSON.")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"}:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        if set(obj) == {"__items__"}:
            return {k: _unflatten(v, tensors) for k, v in obj["__items__"]}
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def _write_state(state: dict[str, Any], directory: Path, stem: str, *, always_tensors: bool) -> None:
    tensors: dict[str, torch.Tensor] = {}
    flat = _flatten(state, stem, tensors)
    (directory / f"{stem}.json").write_text(json.dumps(flat, indent=1))
    if tensors or always_tensors:
        save_safetensors(tensors, directory / f"{stem}.safetensors")


def _read_state(directory: Path, stem: str) -> dict[str, Any]:
    tensor_file = directory / f"{stem}.safetensors"
    tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
    return _unflatten(json.loads((directory / f"{stem}.json").read_text()), tensors)


def write_state(state: dict[str, Any], directory: str | os.PathLike, stem: str) -> None:
    """Writes a nested state (tensors, JSON values, dicts, lists, tuples) as ``<stem>.json`` plus
    ``<stem>.safetensors`` (always written, possibly empty) in `directory`; used for extra state inside a checkpoint
    folder, e.g. the reference pool (``reference_state.*``) from a `save_checkpoint` `lora_dir_writer`.

    Raises:
        TypeError: if a value is neither a tensor nor JSON-serialisable.
    """
    _write_state(state, Path(directory), stem, always_tensors=True)


def read_state(directory: str | os.PathLike, stem: str) -> dict[str, Any]:
    """Reads back a `write_state` state (tensors on CPU, read with safetensors; nothing is unpickled).

    Raises:
        FileNotFoundError: if ``<stem>.json`` is missing in `directory`.
    """
    directory = Path(directory)
    if not (directory / f"{stem}.json").is_file():
        raise FileNotFoundError(f"{directory} has no {stem}.json; was it written by a run with this state?")
    return _read_state(directory, stem)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _numbered_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """``checkpoint-<int>`` directories in ascending numeric step order; other names are ignored."""
    if not output_dir.is_dir():
        return []
    found = []
    for child in output_dir.iterdir():
        match = _CHECKPOINT_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def check_resume_target(output_dir: str | os.PathLike, resume: str | os.PathLike) -> None:
    """Refuses to resume from the checkpoint folder `resume` (at step s, its ``trainer_state.json``) into an
    `output_dir` that holds checkpoints after s (of any run): the resumed run would reach their steps and could not
    write its own checkpoints there (they are never overwritten). The later checkpoints are kept; the message says
    how to branch instead (a new ``output_dir`` with the same ``resume``, which carries the checkpoint's lineage on).

    Raises:
        FileNotFoundError: `resume` has no ``trainer_state.json``.
        ValueError: it cannot be read, or naming `resume`, `output_dir`, the later checkpoints and the fix.
    """
    state_file = Path(resume) / "trainer_state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"resume={str(resume)!r} is not a checkpoint folder (no trainer_state.json); use "
                                "resume=latest or a path to a checkpoint-<step> folder")
    try:
        step = int(json.loads(state_file.read_text())["global_step"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"resume={str(resume)!r}: {state_file} cannot be read ({err}); resume from another "
                         "checkpoint") from None
    later = [path.name for s, path in _numbered_checkpoints(Path(output_dir)) if s > step]
    if later:
        raise ValueError(
            f"resume={str(resume)!r} continues from step {step}, but output_dir={str(output_dir)!r} already holds "
            f"later checkpoints ({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}), which this run would run "
            f"into (checkpoint folders are never overwritten). To branch from step {step}, pass a new "
            "output_dir=<folder> with the same resume=...; to continue the newest, pass resume=latest; or move the "
            f"later checkpoints out of {output_dir}")


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The ``checkpoint-<step>`` directory with the largest integer step, or `None` if there is none.

    Steps compare as integers (``checkpoint-1000`` is newer than ``checkpoint-900``); names whose suffix is not an
    integer (``checkpoint-tmp``) and temporary ``.tmp-checkpoint-*`` directories are ignored (a string sort once
    picked step 9000 over 10000 in open-instruct: docs/guides/field_cases.md#picking-the-latest-checkpoint).
    """
    found = _numbered_checkpoints(Path(output_dir))
    return found[-1][1] if found else None


def new_lineage() -> str:
    """A fresh lineage id for a run started from scratch (32 hex digits)."""
    return uuid.uuid4().hex


def checkpoint_lineage(path: str | os.PathLike) -> str | None:
    """The lineage id in a checkpoint's ``trainer_state.json``; None when it has none (or cannot be read)."""
    try:
        lineage = json.loads((Path(path) / "trainer_state.json").read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None
    return lineage if isinstance(lineage, str) else None


def remove_temporaries(output_dir: str | os.PathLike) -> list[Path]:
    """Removes the ``.tmp-checkpoint-*`` / ``.tmp-delete-*`` folders that a run killed while saving or pruning left in
    `output_dir` (they are never picked by `latest_checkpoint`). Call it from the main process when a run starts in
    `output_dir`, never while another run writes there.

    Returns:
        `list[Path]`: the removed folders.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    removed = []
    for child in sorted(output_dir.iterdir()):
        if child.is_dir() and child.name.startswith((".tmp-checkpoint-", ".tmp-delete-")):
            shutil.rmtree(child)
            logger.warning("removed %s, left by a run that was killed while writing a checkpoint", child)
            removed.append(child)
    return removed


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    lora_dir_writer: Callable[[Path], None],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any | None,
    state: dict[str, Any],
    keep_last: int = -1,
    lineage: str | None = None,
) -> Path:
    """Atomically writes ``<output_dir>/checkpoint-<step>/`` and prunes old checkpoints.

    Args:
        output_dir (`str` or `os.PathLike`): run directory; created if missing.
        step (`int`): global optimizer step, ≥ 0; names the directory.
        lora_dir_writer (`Callable[[Path], None]`):
            Writes the trainable weights into the directory it is given, e.g.
            ``lambda d: policy.save_lora_weights(d)`` producing ``pytorch_lora_weights.safetensors``.
        optimizer (`torch.optim.Optimizer`): optimizer (or accelerate wrapper) whose ``state_dict()`` is saved.
        lr_scheduler (*optional*): object with ``state_dict()``/``load_state_dict()`` (e.g. a `LambdaLR`), or `None`.
        state (`dict`): JSON-serialisable trainer state saved as ``trainer_state.json`` (global step, epoch, sampler
            ``state_dict()``, reference-pool state, ...). Resume logic must read the epoch from here, not from the
            directory name.
        keep_last (`int`, defaults to -1): after saving, keep only the `keep_last` highest-step checkpoints (the one
            just written is always kept); -1 keeps all. With `lineage`, only checkpoints of that lineage count and are
            deleted: others in `output_dir` (another run's, copied in, or written before lineages existed) are left
            alone.
        lineage (`str`, *optional*): the run's lineage id (`new_lineage`; a resumed run carries on the lineage of the
            checkpoint it resumed from, `checkpoint_lineage`), stored as ``trainer_state.json["lineage"]``.

    Returns:
        `Path`: the final checkpoint directory.

    Raises:
        ValueError: if `step` < 0 or `keep_last` is 0 or below -1.
        FileExistsError: if ``checkpoint-<step>`` already exists.
        TypeError: if `state` or a state dict holds a value that is neither a tensor nor JSON-serialisable.
        DiskFullError: the disk filled up (an `OSError`, naming `output_dir` and the size of the newest earlier
            checkpoint); the temporary directory is removed, so ``resume=latest`` continues from the last checkpoint.
        Any exception of `lora_dir_writer` is re-raised after the temporary directory is removed.
    """
    if step < 0:
        raise ValueError(f"step={step} must be ≥ 0.")
    if keep_last == 0 or keep_last < -1:
        raise ValueError(f"keep_last={keep_last} must be -1 (keep all) or ≥ 1.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint-{step}"
    if final.exists():
        raise FileExistsError(
            f"{final} already exists; delete it or resume from it instead of saving step {step} again."
        )
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        lora_dir_writer(tmp)
        _write_state(optimizer.state_dict(), tmp, "optimizer", always_tensors=True)
        if lr_scheduler is not None:
            _write_state(lr_scheduler.state_dict(), tmp, "scheduler", always_tensors=False)
        rng_tensors = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng_tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_safetensors(rng_tensors, tmp / "rng_state.safetensors")
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
        py_version, py_internal, py_gauss = random.getstate()
        rng_json = {
            "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
            "python": [py_version, list(py_internal), py_gauss],
        }
        (tmp / "rng_state.json").write_text(json.dumps(rng_json))
        try:
            trainer_state = json.dumps(state if lineage is None else {**state, "lineage": lineage}, indent=1)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"trainer state is not JSON-serialisable ({err}); store plain numbers/strings/lists."
            ) from err
        (tmp / "trainer_state.json").write_text(trainer_state)
        _fsync_tree(tmp)
        os.replace(tmp, final)
        _fsync_dir(output_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(err):  # one line naming the folder and the size of a checkpoint; the run resumes from the last
            from diffalign.runtime.faults import resume_hint

            earlier = _numbered_checkpoints(output_dir)
            raise DiskFullError(output_dir, f"checkpoint-{step}", hint=resume_hint(output_dir),
                                needed=folder_bytes(earlier[-1][1]) if earlier else None) from None
        raise
    logger.info("saved checkpoint %s", final)

    if keep_last > 0:
        ours = [(step, path) for step, path in _numbered_checkpoints(output_dir)
                if lineage is None or checkpoint_lineage(path) == lineage]
        for _, old in ours[:-keep_last]:
            if old == final:
                continue
            doomed = output_dir / f".tmp-delete-{old.name}-{os.getpid()}"
            os.replace(old, doomed)  # rename first: a crash mid-delete leaves no partial checkpoint-* dir
            shutil.rmtree(doomed)
            logger.info("removed old checkpoint %s (keep_last=%d)", old, keep_last)
    return final


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Checks that `path` is a complete checkpoint whose files all read back: the state files exist, every
    ``*.json`` parses and every ``*.safetensors`` has a valid header and its full length (a truncated copy fails).

    Raises:
        FileNotFoundError: if `path` or one of ``trainer_state.json``, ``optimizer.json``, ``rng_state.json``,
            ``rng_state.safetensors`` is missing.
        ValueError: naming the damaged file and the earlier checkpoints to resume from instead.
    """
    path = Path(path)
    for name in ("trainer_state.json", "optimizer.json", "rng_state.json", "rng_state.safetensors"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint directory (no {name}); pass a "
                                    "checkpoint-<step> folder written by diffalign-train")
    for file in sorted(path.iterdir()):
        try:
            if file.suffix == ".json":
                json.loads(file.read_text())
            elif file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as handle:
                    handle.keys()
        except (SafetensorError, OSError, ValueError) as err:
            step = _CHECKPOINT_RE.match(path.name)
            earlier = [p.name for s, p in _numbered_checkpoints(path.parent) if step and s < int(step.group(1))]
            then = f"resume=latest then continues from {earlier[-1]}" if earlier else "then start again"
            raise ValueError(f"{file} is truncated or damaged ({err}); delete {path} ({then}), or branch from an earlier "
                             f"checkpoint into a new folder (output_dir=<new folder> resume=<checkpoint>; in "
                             f"{path.parent}: {earlier[-3:] or 'none'})") from None


def load_checkpoint(
    path: str | os.PathLike, *, optimizer: torch.optim.Optimizer, lr_scheduler: Any | None
) -> dict[str, Any]:
    """Restores optimizer, LR-scheduler and RNG states from a `save_checkpoint` directory.

    The LoRA weights are not loaded here: load ``pytorch_lora_weights.safetensors`` from `path` with the policy.
    Tensors are read with safetensors (no pickle). Optimizer state is moved to its parameters' devices by
    ``optimizer.load_state_dict``. CUDA RNG states are restored when CUDA is available (a warning is logged when
    the checkpoint has them but this machine has no CUDA).

    Args:
        path (`str` or `os.PathLike`): a ``checkpoint-<step>`` directory.
        optimizer (`torch.optim.Optimizer`): built exactly as when saving (same parameter order and groups).
        lr_scheduler (*optional*): the scheduler to restore, or `None` when none was saved.

    Returns:
        `dict`: the ``trainer_state.json`` written by `save_checkpoint`.

    Raises:
        FileNotFoundError: if `path` or one of its state files is missing (e.g. a scheduler is passed but none was
            saved).
        ValueError: if a file of the checkpoint is truncated or damaged (see `verify_checkpoint`), or the checkpoint
            holds CUDA RNG states for a different number of devices.
    """
    path = Path(path)
    verify_checkpoint(path)
    optimizer.load_state_dict(_read_state(path, "optimizer"))
    if lr_scheduler is not None:
        if not (path / "scheduler.json").is_file():
            raise FileNotFoundError(f"{path} has no scheduler.json; pass lr_scheduler=None or use a matching run.")
        lr_scheduler.load_state_dict(_read_state(path, "scheduler"))

    rng_tensors = load_file(str(path / "rng_state.safetensors"))
    torch.set_rng_state(rng_tensors["torch_cpu"])
    cuda_states = [rng_tensors[f"cuda.{i}"] for i in range(len(rng_tensors) - 1)]
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) != torch.cuda.device_count():
            raise ValueError(
                f"{path} holds CUDA RNG states of {len(cuda_states)} devices but {torch.cuda.device_count()} are "
                "visible; resume with the same CUDA_VISIBLE_DEVICES."
            )
        torch.cuda.set_rng_state_all(cuda_states)
    elif cuda_states:
        logger.warning("%s holds CUDA RNG states but CUDA is not available; they are not restored.", path)
    rng_json = json.loads((path / "rng_state.json").read_text())
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = rng_json["numpy"]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    py_version, py_internal, py_gauss = rng_json["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    return json.loads((path / "trainer_state.json").read_text())
