"""One run per output folder: an advisory lock file ``<output_dir>/.diffalign.lock``.

``diffalign-train`` and ``diffalign-eval`` take the lock before anything is written to their ``output_dir`` (a Hydra
callback, `RunLockCallback`, runs before Hydra saves ``.hydra/`` and its log there); the training loops take it only
when this process does not hold it (``diffalign.train.*.train(cfg)`` called from Python,
`diffalign.train.prepare.run_lock_once`), so a run takes it once.

- The lock is a kernel ``flock`` on the file, held for the life of the run; the file holds the holder's pid, host,
  start time, command and, under a multi-process launch, the launcher's pid (JSON). The kernel drops the ``flock``
  when the holder dies, however it dies, so a run killed with SIGKILL never blocks the folder; the file it leaves
  behind names a dead process, and the next run takes it over with a one-line message.
- A second run into a locked folder is refused at once with `RunLockedError`, naming the holder and the fix (wait for
  it, or pass another ``output_dir``). So is a run into a folder *inside* a live run's folder (``diffalign-eval
  output_dir=runs/x/eval`` while ``diffalign-train`` runs in ``runs/x``), and a run into a folder whose direct
  subfolder a live run holds (`check_nested`).
- Multi-process launches (``accelerate launch``, ``torchrun``): rank 0 (``RANK``) takes the lock; the other ranks take
  none and are refused only when the lock belongs to another launch on this host (a holder whose launcher pid is not
  their parent).
- Where the file system has no ``flock`` (some network mounts), the holder's pid is checked instead: a live holder on
  this host refuses, a dead one is taken over. A holder on another host is never taken over automatically (this host
  cannot tell whether it runs): the message says to delete the file once that run has ended.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

try:
    import fcntl
except ImportError:  # (Windows: the pid check alone)
    fcntl = None

from diffalign.runtime.launch import process_start_time

LOCK_NAME = ".diffalign.lock"
RUN_SUBFOLDERS = ("eval", "logs", "prepared", "final")
"""Subfolders a training run writes into (besides ``checkpoint-*``): a live run holding one of them blocks a run into
their parent (`check_nested`)."""


class RunLockedError(RuntimeError):
    """Another live run holds the output folder; the message names it and the fix."""


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def holder_record(program: str) -> dict:
    """What this process writes into the lock file."""
    now = time.time()
    return {"pid": os.getpid(), "host": socket.gethostname(), "start_time": now,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(now)),
            "process_start": process_start_time(os.getpid()),
            "launcher_pid": os.getppid() if _world_size() > 1 else None,
            "program": program, "command": " ".join(sys.argv)[:300]}


def describe(holder: dict | None) -> str:
    """``pid 123 on host h, started 2026-12-01 19:05:03 UTC (diffalign-train)`` for a lock file's record."""
    if not holder:
        return "a process that has not written its details yet"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
            f"({holder.get('program') or 'diffalign'})")


def process_alive(pid: int, process_start: float | None = None) -> bool:
    """Whether process `pid` runs on this host (not a zombie) and, when `process_start` is given, is the process that
    started then (a reused pid has another start time). On Windows, where ``os.kill`` would end the process, it
    cannot tell and says True."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):  # exited, not yet reaped
                return False
    except (OSError, IndexError):
        pass
    if process_start is not None:
        actual = process_start_time(pid)
        if actual is not None and abs(actual - process_start) > 2.0:
            return False
    return True


def read_holder(path: Path) -> dict | None:
    """The record in a lock file; None when it is missing, empty or not ours."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        holder = json.loads(text) if text.strip() else None
    except json.JSONDecodeError:
        return None
    return holder if isinstance(holder, dict) else None


def _refusal(output_dir: Path, holder: dict | None, *, other_host: bool = False) -> RunLockedError:
    lock = output_dir / LOCK_NAME
    tail = (f" This host cannot tell whether a process on {holder.get('host')} still runs: once that run has ended, "
            f"delete {lock}." if other_host else f" (Lock file: {lock}.)")
    return RunLockedError(f"output_dir={str(output_dir)!r} is in use by another run: {describe(holder)}. Wait for it "
                          f"to finish, or pass another output_dir=<folder>.{tail}")


@dataclass
class _Held:
    fd: int
    path: Path
    count: int = 1
    holder: dict = field(default_factory=dict)


_HELD: dict[Path, _Held] = {}


def _live_here(holder: dict) -> bool:
    """Whether a record names a live process of this host."""
    pid = holder.get("pid")
    return (holder.get("host") == socket.gethostname() and isinstance(pid, int)
            and process_alive(pid, holder.get("process_start")))


def _check_holder(output_dir: Path, holder: dict | None, log) -> None:
    """Refuses a live (or unknowable) holder; reports the takeover of a dead one on this host."""
    if not holder or (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
        return
    if holder.get("host") != socket.gethostname():
        raise _refusal(output_dir, holder, other_host=True)
    if _live_here(holder):
        raise _refusal(output_dir, holder)
    log(f"diffalign: taking over the stale lock of {output_dir} left by {describe(holder)}, which is no longer "
        "running")


def _held_by_another(folder: Path) -> dict | None:
    """The record of a live run, other than this process, that holds the lock of `folder`; None when the folder has
    no lock file, its holder is gone, or this process holds it. The kernel ``flock`` decides (a shared, non-blocking
    attempt fails while the holder lives); without ``flock`` the record does."""
    path = folder / LOCK_NAME
    if folder.resolve() in _HELD or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None  # nobody holds it: a stale file
            except BlockingIOError:
                return read_holder(path) or {}
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        holder = read_holder(path)
        if holder and (holder.get("host") != socket.gethostname() or _live_here(holder)) \
                and holder.get("pid") != os.getpid():
            return holder
        return None
    finally:
        os.close(fd)


def check_nested(output_dir: str | os.PathLike) -> None:
    """Refuses an `output_dir` inside the folder of a live run (e.g. ``diffalign-eval output_dir=runs/x/eval`` while
    ``diffalign-train`` runs in ``runs/x`` and will write its own evaluation there), or one whose run subfolder
    (`RUN_SUBFOLDERS`, ``checkpoint-*``) a live run holds (a training run started into ``runs/x`` while
    ``diffalign-eval`` writes ``runs/x/eval``).

    Raises:
        RunLockedError: naming the other run's folder, its holder and the fix.
    """
    output_dir = Path(output_dir)
    here = output_dir.resolve()
    for parent in here.parents:
        holder = _held_by_another(parent)
        if holder is not None:
            raise RunLockedError(f"output_dir={str(output_dir)!r} is inside {str(parent)!r}, which is in use by "
                                 f"another run: {describe(holder)}. That run writes there (its evaluation goes to "
                                 f"{parent / 'eval'}); wait for it to finish, or pass an output_dir=<folder> outside "
                                 f"it. (Lock file: {parent / LOCK_NAME}.)")
    if here.is_dir():
        for child in sorted(c for c in here.iterdir() if c.is_dir() and (c.name in RUN_SUBFOLDERS
                                                                          or c.name.startswith("checkpoint-"))):
            holder = _held_by_another(child)
            if holder is not None:
                raise RunLockedError(f"output_dir={str(output_dir)!r} holds {str(child)!r}, which is in use by "
                                     f"another run: {describe(holder)}; this run would write into it. Wait for it "
                                     f"to finish, or pass another output_dir=<folder>. (Lock file: "
                                     f"{child / LOCK_NAME}.)")


def acquire(output_dir: str | os.PathLike, program: str = "diffalign", *, log=None) -> bool:
    """Takes the run lock of `output_dir` for this process (creating the folder), or counts one more user when this
    process holds it already. Ranks other than 0 of a multi-process launch take no lock (see the module docstring).

    Args:
        output_dir: the run folder.
        program (`str`): recorded in the lock file and shown to a refused run, e.g. "diffalign-train".
        log (*optional*): where the one-line takeover message goes (default: stderr).

    Returns:
        `bool`: True when a lock (or one more reference to it) was taken; `release` it then.

    Raises:
        RunLockedError: another live run holds the folder (the message names it and the fix).
        PermissionError: the folder cannot be created or written (the message names ``output_dir``).
    """
    log = log or (lambda message: print(message, file=sys.stderr))
    output_dir = Path(output_dir)
    key = output_dir.resolve()
    if key in _HELD:
        _HELD[key].count += 1
        return True
    path = output_dir / LOCK_NAME
    if _world_size() > 1 and _rank() != 0:
        holder = read_holder(path)
        if holder and holder.get("launcher_pid") != os.getppid() and _live_here(holder):
            raise _refusal(output_dir, holder)
        return False
    check_nested(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise PermissionError(f"output_dir={str(output_dir)!r} cannot be written ({err.strerror}: {err.filename}); "
                              "pass an output_dir=<folder> on a writable disk") from None
    try:
        for _ in range(50):
            try:
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = read_holder(path)
                for _ in range(10):  # the holder may not have written its record yet
                    if holder:
                        break
                    time.sleep(0.02)
                    holder = read_holder(path)
                raise _refusal(output_dir, holder) from None
            except OSError as err:  # no flock on this file system (some network mounts): the pid check alone
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
            # a run that released the lock removed the file: if that happened after our open, lock the new file
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _check_holder(output_dir, read_holder(path), log)
        record = holder_record(program)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record, indent=1) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _HELD[key] = _Held(fd, path, holder=record)
    return True


def holds(output_dir: str | os.PathLike) -> bool:
    """Whether this process holds the lock of `output_dir` (`acquire` took it and it is not yet released)."""
    return Path(output_dir).resolve() in _HELD


def release(output_dir: str | os.PathLike) -> None:
    """Drops one reference to this process's lock of `output_dir`; the last one removes the file and unlocks it."""
    key = Path(output_dir).resolve()
    held = _HELD.get(key)
    if held is None:
        return
    held.count -= 1
    if held.count > 0:
        return
    del _HELD[key]
    with contextlib.suppress(OSError):
        if os.fstat(held.fd).st_ino == os.stat(held.path).st_ino:
            os.unlink(held.path)  # (unlinked while still locked: a waiting opener sees a new inode and retries)
    os.close(held.fd)


@atexit.register
def _release_all() -> None:
    for key in list(_HELD):
        _HELD[key].count = 1
        release(key)


@contextlib.contextmanager
def run_lock(output_dir: str | os.PathLike, program: str = "diffalign") -> Iterator[None]:
    """`acquire` … `release` as a context manager."""
    taken = acquire(output_dir, program)
    try:
        yield
    finally:
        if taken:
            release(output_dir)


HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
"""What Hydra writes into a run's output folder before the run's own checks (with ``<hydra.job.name>.log``)."""

SWEEP_FILE = "multirun.yaml"
"""What Hydra writes into a sweep's folder (``-m``: ``hydra.sweep.dir``) before its first job starts."""


@dataclass
class _Started:
    """What `RunLockCallback` found in an output folder before Hydra wrote there: the topmost folder this process
    created for it (None when the folder existed), Hydra's files as they were (`HYDRA_FILES`: their bytes, None when
    absent) and the job log's name and size (None when absent)."""

    created: Path | None
    files: dict[str, bytes | None]
    log_name: str | None
    log_size: int | None


_STARTED: dict[Path, _Started] = {}


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _job_log_name(config) -> str | None:
    """``<hydra.job.name>.log``, the job log Hydra writes into the run folder; None for a config without a
    ``hydra`` node (a callback driven by hand)."""
    name = OmegaConf.select(config, "hydra.job.name", default=None) if isinstance(config, DictConfig) else None
    return f"{name}.log" if isinstance(name, str) and name else None


def record_run_start(output_dir: str | os.PathLike, log_name: str | None = None) -> None:
    """Records, before anything is written to `output_dir`, what `undo_run_start` needs to leave the folder as it was:
    whether this process creates it (and which missing parents with it), else Hydra's files there (`HYDRA_FILES`)
    and the size of the job log `log_name`. The first record of a folder wins (Hydra starts a run and then its job)."""
    key = Path(output_dir).resolve()
    if key in _STARTED:
        return
    created, probe = None, key
    while not probe.exists() and probe != probe.parent:
        created, probe = probe, probe.parent
    if created is None and any(_STARTED[p].created is not None for p in key.parents if p in _STARTED):
        created = key  # (a sweep's job folder, inside the sweep folder this process made: Hydra makes it first)
    files = {} if created is not None else {name: _read_bytes(key / name) for name in HYDRA_FILES}
    log_size = None
    if created is None and log_name and (key / log_name).is_file():
        log_size = (key / log_name).stat().st_size
    _STARTED[key] = _Started(created, files, log_name, log_size)


def _holds_only_run_start_files(folder: Path, log_name: str | None) -> bool:
    allowed = {LOCK_NAME, ".hydra", SWEEP_FILE, *([log_name] if log_name else [])}
    if not folder.is_dir() or any(p.name not in allowed for p in folder.iterdir()):
        return False
    hydra = folder / ".hydra"
    return not hydra.exists() or all(f".hydra/{p.name}" in HYDRA_FILES for p in hydra.iterdir())


def undo_run_start(*, existing: bool = True) -> list[Path]:
    """Leaves the output folders of this process's run as they were before Hydra wrote into them, for a run that was
    refused (a config error found after Hydra made the folder) or stopped before it wrote anything of its own: a
    folder this process created that holds only its lock, Hydra's ``.hydra/`` files and the job log is removed, with
    the empty parents created with it; in a folder that existed (`existing`), Hydra's files are put back as they were
    (a refused ``resume=latest`` must not replace the run's ``.hydra/config.yaml``, which ``diffalign-eval`` reads)
    and the job log is cut back to its size. The locks of these folders are released. Folders not recorded by
    `record_run_start` are left alone.

    Args:
        existing (`bool`): also restore folders that existed before the run (only for a refused run: a run that
            stopped after it started may have written there).

    Returns:
        `list[Path]`: the folders removed or restored.
    """
    undone = []
    for key, started in reversed(list(_STARTED.items())):  # (a sweep's job folders before the sweep's folder)
        if started.created is None and not existing:
            continue
        del _STARTED[key]
        if started.created is not None and not _holds_only_run_start_files(key, started.log_name):
            continue
        if key in _HELD:
            _HELD[key].count = 1
            release(key)
        with contextlib.suppress(OSError):  # (a file still open elsewhere on Windows: left as it is)
            if started.created is not None:
                for name in (*HYDRA_FILES, SWEEP_FILE, *([started.log_name] if started.log_name else [])):
                    (key / name).unlink(missing_ok=True)
                if (key / ".hydra").exists():
                    (key / ".hydra").rmdir()
                folder = key
                while True:
                    folder.rmdir()
                    if folder == started.created:
                        break
                    folder = folder.parent
            else:
                for name, content in started.files.items():
                    if content is None:
                        (key / name).unlink(missing_ok=True)
                    else:
                        (key / name).write_bytes(content)
                if all(content is None for content in started.files.values()) and (key / ".hydra").is_dir():
                    (key / ".hydra").rmdir()
                log = key / started.log_name if started.log_name else None
                if log is not None and log.is_file():
                    if started.log_size is None:
                        log.unlink()
                    else:
                        os.truncate(log, started.log_size)
        undone.append(key)
    return undone


def forget_run_start() -> None:
    """Drops what `record_run_start` recorded, once the run it was for has ended however it ended (what it wrote
    there is the run's own now): a later `undo_run_start` in this process (a second run started from Python) leaves
    those folders alone."""
    _STARTED.clear()


def job_output_dir(config) -> str:
    """The folder a run writes to: ``output_dir``; under ``-m`` (a Hydra sweep, ``hydra.mode=MULTIRUN``) each job's
    own folder, ``hydra.runtime.output_dir`` (``<hydra.sweep.dir>/<hydra.sweep.subdir>``: ``<output_dir>/<job
    number>`` in ``train.yaml`` and ``evaluate.yaml``), so that the jobs of a sweep do not write into one folder."""
    from hydra.types import RunMode

    if isinstance(config, DictConfig) and OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:
        job_dir = OmegaConf.select(config, "hydra.runtime.output_dir")
        if job_dir:
            return str(job_dir)
    return str(config.output_dir)


class RunLockCallback(Callback):
    """Hydra callback (``hydra.callbacks.run_lock`` in ``train.yaml`` / ``evaluate.yaml``) that locks ``output_dir``
    when a run starts, before Hydra writes ``.hydra/`` and its log file there, and unlocks it at the end. A refusal
    exits with ``diffalign: error: …`` and code 1."""

    def __init__(self, program: str = "diffalign"):
        self.program = program
        self.dirs: list[str] = []

    def _take(self, config) -> None:
        output_dir = str(job_output_dir(config))
        key = Path(output_dir).resolve()  # (before Hydra may change the working directory)
        if key not in _HELD:  # what the folder holds before the lock (and Hydra) write there: `undo_run_start`
            record_run_start(key, _job_log_name(config))
        try:
            taken = acquire(output_dir, self.program)
        except (RunLockedError, PermissionError) as err:
            _STARTED.pop(key, None)  # (another run's folder, or one that cannot be made: nothing of ours there)
            raise SystemExit(f"diffalign: error: {err}") from None
        if taken:
            self.dirs.append(str(key))
        else:  # (a non-zero rank: rank 0 owns the folder)
            _STARTED.pop(key, None)

    def _drop(self) -> None:
        if self.dirs:
            key = self.dirs.pop()
            release(key)
            if key not in self.dirs:  # (the run ended as it should: nothing to undo there)
                _STARTED.pop(Path(key), None)

    def on_run_start(self, config, **kwargs) -> None:
        self._take(config)

    def on_multirun_start(self, config, **kwargs) -> None:  # (``-m``: Hydra makes the sweep's folder next)
        record_run_start(OmegaConf.select(config, "hydra.sweep.dir"))

    def on_run_end(self, config, **kwargs) -> None:
        self._drop()

    def on_job_start(self, config, **kwargs) -> None:  # (multirun: one job after another into its output_dir)
        self._take(config)

    def on_job_end(self, config, **kwargs) -> None:
        self._drop()

