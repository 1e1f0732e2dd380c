"""Resumable data preparation: on-policy data written to the run folder in chunks as it is made.

A data set made by the policy before training (``prepare(policy, rewards)``: `FailurePairs`, `RankedPairs`) gets a
`Preparation` from the training loop (`prepare_dataset`) and stores what it samples through a `ChunkStore`:

    <output_dir>/prepared/<name>-<key>/
        manifest.json             # the settings and context the key was computed from, the number of chunks
        chunk-00000.safetensors   # one sampling batch: its images, scores, verdicts (written through a rename)
        ...

``<key>`` is a hash of everything that decides the data: the data set's own settings (prompts, samples per prompt,
sampler, batch size, seed), the judging reward's config, the model config without its LoRA fields, and the weights
the samples come from (the frozen base, `diffalign.evaluation.files.base_weights_hash`, and the policy's trainable
parameters as they are at preparation time). A chunk on disk is read back instead of sampled again, so

- a run killed during the preparation (even with SIGKILL) continues where it stopped when it is started again
  (``resume=latest``, or the same command), and its data equal an uninterrupted run's exactly;
- a finished preparation is reused by a resumed run, and by a new run with the same key in a sibling run folder
  (``<output_dir>/../*/prepared/<name>-<key>/``, hard-linked or copied into this run's folder);
- any other setting gives another key, so nothing made with other settings or weights is ever mixed in.

SIGTERM / SIGINT during the preparation stop it after the current chunk (every process agrees) with
`TrainingInterrupted`; the chunks made are kept. A full disk stops it with a one-line
`diffalign.runtime.storage.DiskFullError` (the folder, the space the missing chunks need); the half-written chunk is
removed and the chunks made are kept, so ``resume=latest`` continues once space is freed.

With several processes every process makes the chunks that are not on disk yet (as before: the same per-image seeds,
so the same data) and only the main process writes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffalign.runtime.console import write as console_write
from diffalign.runtime.files import save_safetensors
from diffalign.runtime.storage import disk_full_as_error

FORMAT = 1
MANIFEST = "manifest.json"


def settings_key(payload: dict) -> str:
    """16 hex digits of the SHA-256 of `payload` as sorted JSON."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def trainable_hash(policy) -> str:
    """16 hex digits of the SHA-256 of the policy's trainable parameters (what the LoRA adds to the base)."""
    digest = hashlib.sha256()
    for p in policy.trainable_parameters():
        # (hashed from a copy: .numpy() of the parameter's own storage marks it not resizable, and FSDP's
        # summon_full_params can then not free its gathered weights: "Trying to resize storage that is not resizable")
        digest.update(p.detach().float().cpu().contiguous().clone().numpy().tobytes())
    return digest.hexdigest()[:16]


class ChunkStore:
    """The chunks of one preparation (see the module docstring); made by `Preparation.store`.

    Args:
        folder (`Path`): ``<root>/<name>-<key>``.
        manifest (`dict`): written as ``manifest.json``.
        write (`bool`): this process writes (the main process).
    """

    def __init__(self, folder: Path, manifest: dict, *, write: bool, search: list[Path], log):
        self.folder, self.manifest, self.write, self.log = folder, manifest, write, log
        self.num_chunks = int(manifest["num_chunks"])
        if write:
            folder.mkdir(parents=True, exist_ok=True)
            for leftover in folder.glob(".tmp-*"):  # of a run killed while writing a chunk
                leftover.unlink(missing_ok=True)
            if not self.complete():
                with disk_full_as_error(folder, "the chunks of an identical finished preparation (copied)"):
                    self._adopt(search)
            with disk_full_as_error(folder, f"the on-policy data's {MANIFEST}"):
                _atomic(folder / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1, default=str)))

    def path(self, k: int) -> Path:
        return self.folder / f"chunk-{k:05d}.safetensors"

    def done(self) -> list[int]:
        """The chunk indices on disk."""
        return [k for k in range(self.num_chunks) if self.path(k).is_file()]

    def complete(self) -> bool:
        return len(self.done()) == self.num_chunks

    def load(self, k: int) -> dict[str, torch.Tensor] | None:
        """Chunk `k` as written, or None when it is not on disk."""
        path = self.path(k)
        return load_file(str(path)) if path.is_file() else None

    def save(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        """Writes chunk `k` (main process only; through a temporary file and a rename).

        Raises:
            DiskFullError: the disk filled up (naming the folder and the space the chunks not on disk yet need, from
                the size of those that are); the chunks written are kept, so ``resume=latest`` continues from them.
        """
        if self.write:
            with disk_full_as_error(self.folder, f"chunk {k + 1} of {self.num_chunks} of the on-policy data",
                                    needed=self._remaining_bytes):
                _atomic(self.path(k), lambda p: save_safetensors({n: t.contiguous() for n, t in tensors.items()}, p))

    def _remaining_bytes(self) -> int | None:
        """The bytes the chunks not on disk yet will take, at the mean size of those that are; None before any."""
        done = self.done()
        if not done:
            return None
        mean = sum(self.path(k).stat().st_size for k in done) / len(done)
        return round(mean * (self.num_chunks - len(done)))

    def _adopt(self, search: list[Path]) -> None:
        """Links (or copies) the chunks of a finished preparation with the same key from a sibling run folder."""
        for root in search:
            other = root / self.folder.name
            if other.resolve() == self.folder.resolve() or not (other / MANIFEST).is_file():
                continue
            try:
                same = json.loads((other / MANIFEST).read_text()).get("key") == self.manifest["key"]
            except (OSError, ValueError):
                continue
            if not same or not all((other / self.path(k).name).is_file() for k in range(self.num_chunks)):
                continue
            for k in range(self.num_chunks):
                if not self.path(k).is_file():
                    _link_or_copy(other / self.path(k).name, self.path(k))
            self.log(f"[diffalign] data: reusing the finished preparation in {other} (same settings and weights)")
            return


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_or_copy(source: Path, target: Path) -> None:
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    try:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


class Preparation:
    """What the training loop gives a data set's ``prepare`` (its ``preparation=`` argument): where the chunks go,
    what else decides them, and how to report and stop.

    Args:
        root (`Path`): ``<output_dir>/prepared``.
        context (`dict`): what decides the data besides the data set's own settings (model config, reward config,
            weights hashes); part of every key.
        write (`bool`, defaults to True): this process writes chunks (the main process).
        progress (`bool`, defaults to True): show a tqdm bar.
        log (*optional*): one-line messages (default `print`).
        should_stop (*optional*): called after every chunk on every process; True stops the preparation.
        stop_error (*optional*): builds the exception raised then, from a message.
        search (`list[Path]`): other ``prepared`` folders whose finished preparations may be reused.
        single_process (`bool`, defaults to True): one process (a data set that makes only the missing parts of
            its data may then call `after_chunk` for those alone; with several processes `should_stop` is a
            collective and every process must call it equally often).
    """

    def __init__(self, root: str | os.PathLike, context: dict | None = None, *, write: bool = True,
                 progress: bool = True, log=print, should_stop=None, stop_error=None, search: list[Path] = (),
                 single_process: bool = True):
        self.root, self.context = Path(root), dict(context or {})
        self.write, self.progress, self.log = write, progress, log
        self.should_stop, self.stop_error, self.search = should_stop, stop_error, list(search)
        self.single_process = single_process

    def store(self, name: str, settings: dict, num_chunks: int) -> ChunkStore:
        """The `ChunkStore` of a preparation `name` with these `settings` in `num_chunks` chunks; says how much of it
        is on disk already."""
        payload = {"format": FORMAT, "name": name, "settings": settings, "context": self.context,
                   "num_chunks": num_chunks}
        key = settings_key(payload)
        store = ChunkStore(self.root / f"{name}-{key}", {**payload, "key": key}, write=self.write, search=self.search,
                           log=self.log)
        done = len(store.done())
        if done == num_chunks:
            self.log(f"[diffalign] data: all {num_chunks} chunks of {store.folder} are made already; reusing them")
        elif done:
            self.log(f"[diffalign] data: continuing the preparation in {store.folder} at {done} of {num_chunks} "
                     "chunks")
        return store

    def after_chunk(self, done: int, total: int, folder: Path) -> None:
        """Stops the preparation (raises ``stop_error(done, total, folder)``) when `should_stop` says so; call on
        every process after every chunk (`folder` holds the chunks)."""
        if self.should_stop is not None and self.should_stop() and done < total:
            if self.stop_error is not None:
                raise self.stop_error(done, total, folder)
            raise KeyboardInterrupt(f"data preparation stopped after {done} of {total} chunks (kept in {folder})")


def run_context(cfg, policy) -> dict:
    """What decides a run's on-policy data besides the data set's settings: the model config without its LoRA fields,
    the judging reward's config (``reward.<data.reward>``), the frozen base weights and the policy's trainable
    parameters."""
    from omegaconf import OmegaConf

    from diffalign.evaluation.files import base_reuse_key, base_weights_hash

    judge = cfg.data.get("reward") if "reward" in cfg.data else None
    reward = (cfg.get("reward") or {}).get(judge) if isinstance(judge, str) else None
    return {"model": base_reuse_key(cfg.model, {})["model"],
            "reward": OmegaConf.to_container(reward, resolve=True) if OmegaConf.is_config(reward) else reward,
            "base_weights": base_weights_hash(policy), "trainable": trainable_hash(policy)}


def prepare_dataset(dataset, policy, rewards, *, cfg, accelerator, stop=None) -> None:
    """Runs ``dataset.prepare(policy, rewards)`` for the training loop, with a `Preparation` in
    ``<output_dir>/prepared`` when the data set's ``prepare`` takes a ``preparation`` argument (the built-in on-policy
    data sets do; a plugin's ``prepare(policy, rewards)`` is called as before).

    Raises:
        TrainingInterrupted: a SIGTERM / SIGINT arrived during the preparation (after the current chunk).
    """
    from diffalign.runtime.faults import TrainingInterrupted, resume_hint

    if "preparation" not in inspect.signature(dataset.prepare).parameters:
        dataset.prepare(policy, rewards)
        return
    output_dir = Path(cfg.output_dir)
    search = []
    if accelerator.is_main_process and output_dir.parent.is_dir():
        with contextlib.suppress(OSError):
            search = sorted(p for p in output_dir.parent.glob("*/prepared") if p.parent.resolve()
                            != output_dir.resolve())

    def stop_error(done: int, total: int, folder: Path) -> Exception:
        return TrainingInterrupted(f"stopped by {stop.name} during the data preparation after {done} of {total} "
                                   f"chunks (kept in {folder}); {resume_hint(output_dir)}", stop.signum)

    from diffalign.runtime.distributed import full_weights

    with full_weights(policy):  # (FSDP: every process hashes the full weights, as one process does)
        context = run_context(cfg, policy)
    if accelerator.num_processes > 1:  # the main process's context on every process: one key, one folder
        from accelerate.utils import broadcast_object_list

        context = broadcast_object_list([context], from_process=0)[0]
    preparation = Preparation(output_dir / "prepared", context, write=accelerator.is_main_process,
                              progress=accelerator.is_main_process, log=lambda message: console_write(message, accelerator),
                              should_stop=(lambda: stop.requested(accelerator)) if stop is not None else None,
                              stop_error=stop_error, search=search, single_process=accelerator.num_processes == 1)
    dataset.prepare(policy, rewards, preparation=preparation)

