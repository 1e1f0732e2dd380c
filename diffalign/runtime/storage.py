"""A full disk, reported in one line: what was being written, in which folder, how much space is free there and
(where it is known) how much is needed; nothing half-written is left behind.

Every file a run writes in its phases (checkpoints, the on-policy data's chunks, the evaluation's images and metrics,
the final LoRA) goes through a temporary file or folder that is renamed into place (`atomic_file`) or removed when the
write fails, so a full disk leaves no 0-byte image and no partial folder: ``resume=latest`` (training) or the same
command again (``diffalign-eval``) continues once space is freed.

A full disk shows up as ``OSError`` with ``errno`` ``ENOSPC`` (or ``EDQUOT``, a quota) from Python's and Pillow's
writers, and as ``SafetensorError("... No space left on device (os error 28)")`` from safetensors' Rust writer;
`is_disk_full` recognises both (also when chained as the cause of another error).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", f"os error {errno.ENOSPC}",
                   f"os error {errno.EDQUOT}")


class DiskFullError(OSError):
    """The disk of `folder` filled up while writing `what`; ``str(err)`` is the one-line message.

    Attributes:
        folder (`Path`): the folder being written to.
        what (`str`): what was being written, e.g. ``"checkpoint-20"``.
        needed (`int` or `None`): bytes the write needs in all, when known.
        free (`int` or `None`): bytes free on that disk after the failed write was cleaned up.
        hint (`str`): how to continue once space is freed (the CLI sets the command's own).
    """

    def __init__(self, folder: str | os.PathLike, what: str, *, needed: int | None = None,
                 hint: str = "continue with resume=latest"):
        self.folder, self.what, self.needed, self.hint = Path(folder), what, needed, hint
        self.free = free_bytes(self.folder)
        super().__init__(errno.ENOSPC, self.message)

    @property
    def message(self) -> str:
        space = [f"{format_bytes(self.free)} free" if self.free is not None else None,
                 f"about {format_bytes(self.needed)} needed" if self.needed else None]
        space = ", ".join(s for s in space if s)
        return (f"no space left on the disk of {self.folder} while writing {self.what}"
                f"{f' ({space})' if space else ''}; nothing partial was kept. Free space there (or choose a folder on "
                f"a larger disk), then {self.hint}")

    def __str__(self) -> str:
        return self.message


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or an exception it was raised from) is a full disk or an exceeded quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, DiskFullError):
            return True
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        if not isinstance(err, OSError) and any(text in str(err) for text in _DISK_FULL_TEXT):
            return True  # safetensors' SafetensorError (not an OSError) names the OS error in its text
        err = err.__cause__ or err.__context__
    return False


def free_bytes(folder: str | os.PathLike) -> int | None:
    """Free bytes on the disk of `folder` (or of its nearest existing parent); None when it cannot be read."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def folder_bytes(path: str | os.PathLike) -> int:
    """The summed size of the files under `path` (a file: its size; missing: 0)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, name))
    return total


def format_bytes(n: int | None) -> str:
    """``1.5 MB``-style sizes (powers of 1024, one decimal)."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GB"


def remove_path(path: str | os.PathLike) -> None:
    """Removes a file or a folder tree if it exists (errors ignored)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def disk_full_as_error(folder: str | os.PathLike, what: str, *, needed: int | Callable[[], int | None] | None = None,
                       remove: Sequence[str | os.PathLike] = ()) -> Iterator[None]:
    """Turns a full disk inside the block into `DiskFullError(folder, what, needed)` after removing the paths in
    `remove` (the block's half-written files or folders); any other exception passes unchanged. A `DiskFullError`
    raised inside (a more precise one, from a nested writer) passes unchanged too, after the removal.

    Args:
        needed: the bytes the whole write needs, or a callable computing them after the failure (e.g. from files
            already on disk); None when unknown.
    """
    try:
        yield
    except BaseException as err:
        if not is_disk_full(err):
            raise
        for path in remove:
            remove_path(path)
        if isinstance(err, DiskFullError):
            raise
        raise DiskFullError(folder, what, needed=needed() if callable(needed) else needed) from None


def temporary_name(path: Path) -> Path:
    """The temporary sibling a file is written to before its rename: ``.tmp-<pid>-<name>`` (the suffix is kept, so
    writers that choose the format by the file name, such as Pillow and matplotlib, still do)."""
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def atomic_file(path: str | os.PathLike, write: Callable[[Path], object], *, what: str | None = None,
                fsync: bool = False) -> Path:
    """Writes a file through a temporary sibling that `write(tmp)` fills and that is renamed onto `path`, so `path`
    is either the old file, the new one or absent, never half-written; the temporary file is removed on any failure.

    Args:
        path: the final file (its folder is made).
        write: writes the whole file to the path it is given.
        what: named in the `DiskFullError` (default: the file's name).
        fsync: flush the file to the disk before the rename.

    Returns:
        `path` as a `Path`.

    Raises:
        DiskFullError: the disk filled up (the temporary file removed; `path` unchanged).
    """
    path = Path(path)
    tmp = temporary_name(path)
    with disk_full_as_error(path.parent, what or path.name, remove=[tmp]):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write(tmp)
            if fsync:
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        finally:
            remove_path(tmp)
    return path


def write_text(path: str | os.PathLike, text: str, *, what: str | None = None) -> Path:
    """`atomic_file` for a UTF-8 text file."""
    return atomic_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), what=what)


def write_folder(folder: str | os.PathLike, write: Callable[[Path], object], *, what: str | None = None,
                 needed: int | None = None) -> Path:
    """Writes the files `write(tmp_folder)` makes into `folder`: first into a temporary sibling folder
    (``.tmp-<pid>-<name>``), then each file is renamed into `folder` (made if missing; other files there are kept).
    On a failure the temporary folder is removed and `folder` keeps its old files.

    Raises:
        DiskFullError: the disk filled up.
    """
    folder = Path(folder)
    tmp = temporary_name(folder)
    remove_path(tmp)
    with disk_full_as_error(folder.parent, what or f"{folder.name}/", needed=needed, remove=[tmp]):
        try:
            tmp.mkdir(parents=True)
            write(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            for child in sorted(tmp.iterdir()):
                os.replace(child, folder / child.name)
        finally:
            remove_path(tmp)
    return folder
