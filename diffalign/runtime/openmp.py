"""OpenMP's wait policy for a machine shared with other CPU-bound processes, chosen once at start-up, before torch
loads (docs/guides/performance.md#shared-machines).

PyTorch's Linux wheels run their CPU kernels on libgomp. A libgomp thread that finished its share of a parallel region
keeps spinning on its core (``GOMP_SPINCOUNT``: 300,000 iterations by default) waiting for the next one, which makes
an idle machine fast and a shared one slow: beside another CPU-bound process, the spinning threads take time slices
from the working ones (issue 33: the main job at 8x its idle time on a 2-core machine). With
``OMP_WAIT_POLICY=PASSIVE`` a waiting thread sleeps instead, which costs the idle machine and saves the shared one:
measured in one run beside one competing process (``scripts/bench_shared_machine.py``, docs/results/performance.md),
the shortened main job and a ``tiny_flow_grpo`` epoch took 2.94x and 3.50x their idle time by default and 1.57x and
1.37x with this module's choice, whose idle runs took 0.87x and 1.01x the default's; PASSIVE always would cost the
idle runs 1.56x and 1.71x.

So ``diffalign-train`` and ``diffalign-eval`` look, before anything imports torch, at how busy the CPUs they may run
on are (`others_busy_cores`: the busy time of those CPUs over 0.2 s, from ``/proc/stat``), and set
``OMP_WAIT_POLICY=PASSIVE`` for the run when other processes keep at least `BUSY_CORES` of them busy. libgomp reads
the variable once, when torch loads it, so the choice holds for the whole run (a process that starts later beside it
makes its own choice). Nothing is changed when the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` (theirs wins),
when ``OMP_NUM_THREADS=1`` (one thread never waits for another), when torch is already imported (too late), or where
``/proc/stat`` cannot be read (not Linux).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, MutableMapping

# The user's own choice of how OpenMP threads wait: any of these set leaves the wait policy alone.
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Other processes' busy cores (averaged over the probe) from which the machine counts as shared.
BUSY_CORES = 0.5
PROBE_SECONDS = 0.2


def _cpu_times(cpus: set[int] | None, stat_path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) jiffies summed over `cpus` (None: every CPU) since boot; None where ``/proc/stat`` is unreadable.

    Busy time is user + system + irq + softirq + steal; time of processes at a positive niceness (``nice``) counts
    as idle when this process runs at niceness 0, since the scheduler gives those processes almost no time beside
    ours (a ``nice -n 19`` background job does not make the machine shared).
    """
    try:
        with open(stat_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    niced_is_busy = _niceness() > 0
    busy = total = 0.0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            index = int(name[3:])
            values = [float(v) for v in fields[:8]]
        except ValueError:
            continue
        if cpus is not None and index not in cpus:
            continue
        values += [0.0] * (8 - len(values))
        user, nice, system, idle, iowait, irq, softirq, steal = values
        busy += user + system + irq + softirq + steal + (nice if niced_is_busy else 0.0)
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return (busy, total) if total > 0 else None


def _niceness() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (AttributeError, OSError):
        return 0


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def others_busy_cores(seconds: float = PROBE_SECONDS, read: Callable[[], tuple[float, float] | None] | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> float | None:
    """How many of the CPUs this process may run on (``os.sched_getaffinity``) other processes keep busy: their busy
    share over `seconds` (this process sleeps meanwhile) times the number of those CPUs.

    Args:
        seconds (`float`): length of the probe; ``/proc/stat`` counts in 10 ms ticks, so 0.2 s on 2 CPUs is 40 ticks.
        read (`Callable`, *optional*): returns (busy, total) CPU time; defaults to ``/proc/stat`` over the affinity
            CPUs (`_cpu_times`).
        sleep (`Callable`): the wait between the two readings.

    Returns:
        `float` in [0, number of CPUs], or None where the CPU times cannot be read.
    """
    cpus = _affinity()
    if read is None:
        def read():
            return _cpu_times(cpus)
    first = read()
    if first is None:
        return None
    sleep(seconds)
    second = read()
    if second is None:
        return None
    busy, total = second[0] - first[0], second[1] - first[1]
    if total <= 0:
        return 0.0
    n = len(cpus) if cpus else (os.cpu_count() or 1)
    return max(0.0, min(1.0, busy / total)) * n


def shared_machine_defaults(env: MutableMapping[str, str] | None = None,
                            probe: Callable[[], float | None] | None = None,
                            torch_loaded: bool | None = None, announce: Callable[[str], None] | None = None,
                            ) -> dict[str, str]:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` in `env` when other processes keep the CPUs busy (see the module's docstring
    for when nothing is changed). Call it before torch is imported: the entry points of ``diffalign-train`` and
    ``diffalign-eval`` do, first thing.

    Args:
        env (`MutableMapping`, *optional*): the environment to read and change; defaults to ``os.environ`` (so that
            libgomp, loaded later with torch, and child processes see the setting).
        probe (`Callable`, *optional*): returns other processes' busy cores, or None when unknown (defaults to
            `others_busy_cores`).
        torch_loaded (`bool`, *optional*): whether torch is imported already (defaults to ``"torch" in sys.modules``).
        announce (`Callable`, *optional*): receives one line saying what was set and why (defaults to a print).

    Returns:
        `dict`: the variables set (empty when nothing changed).
    """
    env = os.environ if env is None else env
    if torch_loaded is None:
        torch_loaded = "torch" in sys.modules
    if torch_loaded or any(env.get(key) for key in USER_KEYS) or env.get("OMP_NUM_THREADS", "").strip() == "1":
        return {}
    busy = (probe or others_busy_cores)()
    if busy is None or busy < BUSY_CORES:
        return {}
    chosen = {"OMP_WAIT_POLICY": "PASSIVE"}
    env.update(chosen)
    line = (f"[diffalign] other processes keep {busy:.1f} of the CPUs busy: OpenMP threads wait passively "
            "(OMP_WAIT_POLICY=PASSIVE) in this run; set OMP_WAIT_POLICY yourself to choose")
    (announce or print)(line)
    return chosen
