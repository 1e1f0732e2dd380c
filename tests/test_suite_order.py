"""The suite starts its longest test files first (tests/conftest.py `pytest_collection_modifyitems`, from the record in
tests/durations.txt), and pytest-xdist's ``worksteal`` runs the collection in that order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import CHILD_ENV, DURATIONS, longest_files_first, recorded_seconds_per_file

REPO = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_files_are_ordered_by_recorded_seconds_and_keep_their_tests_together_in_order():
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2", "tests/c.py::t1", "tests/d.py::t1",
                   "tests/b.py::t2[x]")
    ordered = longest_files_first(items, {"tests/b.py": 5.0, "tests/c.py": 9.0})
    # by hand: c (9 s), b (5 s, its two tests in collection order), then the unrecorded a and d in collection order
    assert [i.nodeid for i in ordered] == ["tests/c.py::t1", "tests/b.py::t1", "tests/b.py::t2[x]", "tests/a.py::t1",
                                           "tests/a.py::t2", "tests/d.py::t1"]


def test_the_record_sums_each_files_phases(tmp_path):
    record = tmp_path / "durations.txt"
    record.write_text("# comment\n\n79.54s setup    tests/x.py::test_a\n18.19s call     tests/x.py::test_b\n"
                      "2.00s call     tests/y.py::test_c[p-1]\n")
    assert recorded_seconds_per_file(record) == {"tests/x.py": pytest.approx(97.73), "tests/y.py": 2.0}
    record.write_text("1768 passed in 1099.36s\n")
    with pytest.raises(ValueError, match=r"durations.txt:1: .* is not a pytest --durations line"):
        recorded_seconds_per_file(record)


def test_every_recorded_file_exists():
    """A renamed or removed test file would silently lose its place at the front: refresh tests/durations.txt."""
    missing = sorted(f for f in recorded_seconds_per_file(DURATIONS) if not (REPO / f).is_file())
    assert not missing, f"tests/durations.txt names missing files {missing}; refresh it from a full run's --durations"


def test_worksteal_runs_each_workers_share_in_collection_order(tmp_path):
    """The claim the order rests on: with ``-n 2 --dist worksteal`` the first worker starts with the first collected
    test and the second with the first test of the second half (pytest-xdist's `WorkStealingScheduling`)."""
    pytest.importorskip("xdist")
    log = tmp_path / "order.log"
    (tmp_path / "test_order.py").write_text(
        "import os, pytest\n"
        "@pytest.mark.parametrize('k', range(8))\n"
        "def test_k(k):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(f\"{os.environ['PYTEST_XDIST_WORKER']} {k}\\n\")\n")
    (tmp_path / "conftest.py").write_text("")
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "worksteal", "-p", "no:cacheprovider",
               "--rootdir", str(tmp_path), str(tmp_path / "test_order.py")]
    done = subprocess.run(command, cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    firsts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        worker, k = line.split()
        firsts.setdefault(worker, int(k))
    assert sorted(firsts.values()) == [0, 4], firsts
