"""The shared-machine default (issue 33 item 4; `diffalign.runtime.openmp`): ``OMP_WAIT_POLICY=PASSIVE`` is set at
start-up, before torch loads, when other processes keep the CPUs busy; the user's own OpenMP variables win. No
timing here: the figures behind the choice are in docs/guides/performance.md (``scripts/bench_shared_machine.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from diffalign.runtime import openmp
from diffalign.runtime.openmp import BUSY_CORES, _cpu_times, others_busy_cores, shared_machine_defaults

REPO = Path(__file__).resolve().parents[3]


def _never():
    raise AssertionError("the probe must not run when nothing is to be chosen")


def test_busy_cpus_set_the_passive_wait_policy():
    env, said = {}, []
    chosen = shared_machine_defaults(env, probe=lambda: 1.5, torch_loaded=False, announce=said.append)
    assert chosen == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert len(said) == 1 and "1.5" in said[0] and "OMP_WAIT_POLICY=PASSIVE" in said[0]


@pytest.mark.parametrize("busy", [0.0, BUSY_CORES - 0.01, None])
def test_an_idle_machine_or_an_unknown_load_changes_nothing(busy):
    env = {"PATH": "/bin"}
    assert shared_machine_defaults(env, probe=lambda: busy, torch_loaded=False, announce=_never) == {}
    assert env == {"PATH": "/bin"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"},
                                  {"OMP_NUM_THREADS": "1"}])
def test_the_users_own_variables_win(user):
    env = dict(user)
    assert shared_machine_defaults(env, probe=_never, torch_loaded=False) == {}
    assert env == user


def test_nothing_is_set_once_torch_is_loaded():
    env = {}
    assert shared_machine_defaults(env, probe=_never, torch_loaded=True) == {}
    assert env == {}


def test_more_than_one_thread_requested_still_adapts():
    env = {"OMP_NUM_THREADS": "2"}
    shared_machine_defaults(env, probe=lambda: 2.0, torch_loaded=False, announce=lambda _: None)
    assert env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_busy_cores_are_the_busy_share_of_the_probe_times_the_cpus(monkeypatch):
    monkeypatch.setattr(openmp, "_affinity", lambda: {0, 1, 2, 3})
    readings = iter([(1000.0, 4000.0), (1030.0, 4040.0)])  # 30 of 40 ticks busy over 4 CPUs: 0.75 x 4 = 3 cores
    waited = []
    assert others_busy_cores(0.2, read=lambda: next(readings), sleep=waited.append) == pytest.approx(3.0)
    assert waited == [0.2]
    assert others_busy_cores(read=lambda: None, sleep=_never) is None


STAT = """cpu  60 20 30 900 10 0 0 0 0 0
cpu0 10 5 10 400 5 0 0 0 0 0
cpu1 50 15 20 500 5 1 2 3 0 0
intr 12345
"""


def test_cpu_times_sum_the_allowed_cpus_and_leave_niced_time_idle(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    monkeypatch.setattr(openmp, "_niceness", lambda: 0)
    # cpu1 only: busy = user 50 + system 20 + irq 1 + softirq 2 + steal 3 = 76 (nice 15 not busy);
    # total = 50 + 15 + 20 + 500 + 5 + 1 + 2 + 3 = 596
    assert _cpu_times({1}, str(stat)) == (76.0, 596.0)
    # both CPUs (the aggregate "cpu" line is not counted twice): busy 20 + 76, total 430 + 596
    assert _cpu_times(None, str(stat)) == (96.0, 1026.0)
    monkeypatch.setattr(openmp, "_niceness", lambda: 19)  # a niced run competes with other niced processes
    assert _cpu_times({1}, str(stat)) == (91.0, 596.0)
    assert _cpu_times(None, str(tmp_path / "missing")) is None


CHILD = """
import json, os, sys
import diffalign.runtime.openmp as openmp
seen = []
def probe():
    seen.append("torch" in sys.modules)
    return 1.5
openmp.others_busy_cores = probe
import diffalign.cli as cli
class Stop(Exception):
    pass
def stop():
    raise Stop
cli.setup_hydra = stop
try:
    getattr(cli, sys.argv[1])()
except Stop:
    pass
print("RESULT " + json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "probed_with_torch": seen}))
"""


@pytest.mark.parametrize("entry", ["train", "evaluate"])
@pytest.mark.parametrize("user_policy", [None, "ACTIVE"])
def test_the_entry_points_choose_before_torch_loads_and_the_users_variable_wins(entry, user_policy):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    if user_policy:
        env["OMP_WAIT_POLICY"] = user_policy
    proc = subprocess.run([sys.executable, "-c", CHILD, entry], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    if user_policy:
        assert result == {"policy": user_policy, "probed_with_torch": []}
    else:
        assert result == {"policy": "PASSIVE", "probed_with_torch": [False]}
        assert "OMP_WAIT_POLICY=PASSIVE" in proc.stdout
