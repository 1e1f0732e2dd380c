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


class RunLockCallback(Callback):
    """Hydra callback (``hydra.callbacks.run_lock`` in ``train.yaml`` / ``evaluate.yaml``) that locks ``output_dir``
    when a run starts, before Hydra writes ``.hydra/`` and its log file there, and unlocks it at the end. A refusal
    exits with ``diffalign: error: …`` and code 1."""

    def __init__(self, program: str = "diffalign"):
        self.program = program
        self.dirs: list[str] = []

    def _take(self, config) -> None:
        output_dir = str(config.output_dir)
        try:
            taken = acquire(output_dir, self.program)
        except (RunLockedError, PermissionError) as err:
            raise SystemExit(f"diffalign: error: {err}") from None
        if taken:
            self.dirs.append(str(Path(output_dir).resolve()))  # (before Hydra may change the working directory)

    def _drop(self) -> None:
        if self.dirs:
            release(self.dirs.pop())

    def on_run_start(self, config, **kwargs) -> None:
        self._take(config)

    def on_run_end(self, config, **kwargs) -> None:
        self._drop()

    def on_job_start(self, config, **kwargs) -> None:  # (multirun: one job after another into its output_dir)
        self._take(config)

    def on_job_end(self, config, **kwargs) -> None:
        self._drop()

