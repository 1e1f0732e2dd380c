"""One run folder for every process of a launch (in Hydra and Lightning, each process once resolved its own
timestamped folder: docs/guides/field_cases.md#one-run-folder-for-all-processes).

The default ``output_dir`` of ``diffalign-train`` / ``diffalign-eval`` is ``runs/train-${launch_time:%Y%m%d-%H%M%S}``.
Hydra's ``${now:...}`` is resolved by each process on its own, so the processes of ``accelerate launch
--num_processes N`` (or ``torchrun``) started a second apart would write to different folders. ``launch_time``
instead resolves, under a multi-process launch (``WORLD_SIZE`` > 1), to the start time of the launcher process, the
parent that all local processes share; a single process uses the current time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import datetime

ENV_LAUNCH_TIME = "DIFFALIGN_LAUNCH_TIME"  # seconds since the epoch; set it to pin the timestamp yourself


def process_start_time(pid: int) -> float | None:
    """Start time of process `pid` in seconds since the epoch (Linux ``/proc``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after the "pid (comm)" prefix
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def launch_time(fmt: str, env: Mapping[str, str] | None = None, now: Callable[[], datetime] = datetime.now,
                launcher_start: Callable[[], float | None] | None = None) -> str:
    """The run folder's timestamp, formatted with `fmt` (``strftime``); the same on every process of one launch.

    Args:
        fmt (`str`): ``strftime`` format, e.g. ``"%Y%m%d-%H%M%S"``.
        env (`Mapping`, *optional*): environment (defaults to ``os.environ``); ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
            ``DIFFALIGN_LAUNCH_TIME`` are read.
        now (`Callable`): the clock, for one process.
        launcher_start (`Callable`, *optional*): start time of the launcher in epoch seconds (defaults to the parent
            process's, from ``/proc``).

    Returns:
        `str`: ``now()`` formatted for a single process; under a multi-process launch ``DIFFALIGN_LAUNCH_TIME`` when
        set, else the launcher's start time.

    Raises:
        ValueError: under a multi-node launch (processes on other machines have other parents) or where the launcher's
            start time cannot be read, asking for an explicit ``output_dir``.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return now().strftime(fmt)
    if env.get(ENV_LAUNCH_TIME):
        return datetime.fromtimestamp(float(env[ENV_LAUNCH_TIME])).strftime(fmt)
    if int(env.get("LOCAL_WORLD_SIZE", world) or world) != world:
        raise ValueError(f"a {world}-process launch over several machines cannot agree on a default run folder; pass "
                         "output_dir=<folder every machine can reach> (or set DIFFALIGN_LAUNCH_TIME=<epoch seconds>)")
    start = (launcher_start or (lambda: process_start_time(os.getppid())))()
    if start is None:
        raise ValueError(f"a {world}-process launch cannot read its launcher's start time (no /proc); pass "
                         "output_dir=<folder> so that every process writes to the same run folder")
    return datetime.fromtimestamp(start).strftime(fmt)
