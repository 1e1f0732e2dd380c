"""`diffalign.runtime.runlock` in one process, found by mutation testing (docs/contributing.md#mutation-testing): the
nesting checks (a run inside a live run's folder, or over a live run subfolder), the Hydra callback and the context
manager, the records and their descriptions, and when a process counts as alive.

A live holder is simulated in this process: a second open file description of the lock file holding an exclusive
``flock`` conflicts with a ``flock`` through another description (flock(2)), so `_held_by_another` sees it held, as it
would see another process's; its record names the parent process (alive, on this host)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from diffalign.runtime import runlock
from diffalign.runtime.launch import process_start_time
from diffalign.runtime.runlock import (
    LOCK_NAME,
    RunLockCallback,
    RunLockedError,
    acquire,
    check_nested,
    describe,
    holder_record,
    holds,
    process_alive,
    read_holder,
    release,
    run_lock,
)

HOST = socket.gethostname()


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield
    for key in list(runlock._HELD):  # a failed test leaves no lock behind
        runlock._HELD[key].count = 1
        release(key)


class LiveHolder:
    """An exclusive flock on ``folder/.diffalign.lock`` through its own file description, with `record` written."""

    def __init__(self, folder: Path, record: dict | None):
        folder.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if record is not None:
            os.write(self.fd, json.dumps(record).encode())

    def close(self):
        os.close(self.fd)


def parent_record(**fields) -> dict:
    return {"pid": os.getppid(), "host": HOST, "started": "2026-12-01 19:05:03 UTC", "program": "diffalign-train",
            "process_start": process_start_time(os.getppid()), **fields}


def test_a_run_inside_a_live_runs_folder_is_refused_naming_both_folders_and_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = LiveHolder(run, parent_record())
    try:
        inner = run / "eval" / "deeper"
        expected = (f"output_dir={str(inner)!r} is inside {str(run)!r}, which is in use by another run: pid "
                    f"{os.getppid()} on host {HOST}, started 2026-12-01 19:05:03 UTC (diffalign-train). That run writes "
                    f"there (its evaluation goes to {run / 'eval'}); wait for it to finish, or pass an "
                    f"output_dir=<folder> outside it. (Lock file: {run / LOCK_NAME}.)")
        with pytest.raises(RunLockedError, match=f"^{re.escape(expected)}$"):
            acquire(inner, "diffalign-eval")
        assert not inner.exists()  # refused before the folder was made
    finally:
        holder.close()
    assert acquire(inner) and holds(inner)  # the holder is gone: its file is stale
    release(inner)


def test_an_unlocked_or_stale_parent_and_this_processs_own_run_do_not_refuse(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps(parent_record()))  # a record nobody flocks: stale
    check_nested(run / "eval")  # (flock decides: nobody holds it)
    (run / LOCK_NAME).unlink()  # (acquire would still read a live pid in it: the no-flock file systems' rule)
    assert acquire(run)  # this process's own run: its evaluation folder inside is allowed
    try:
        assert acquire(run / "eval") and holds(run / "eval")
        release(run / "eval")
    finally:
        release(run)


@pytest.mark.parametrize("child", ["eval", "logs", "prepared", "final", "checkpoint-3"])
def test_a_run_over_a_live_run_subfolder_is_refused(tmp_path, child):
    run = tmp_path / "run"
    holder = LiveHolder(run / child, parent_record(program="diffalign-eval"))
    try:
        expected = (f"output_dir={str(run)!r} holds {str(run / child)!r}, which is in use by another run: pid "
                    f"{os.getppid()} on host {HOST}, started 2026-12-01 19:05:03 UTC (diffalign-eval); this run "
                    f"would write into it. Wait for it to finish, or pass another output_dir=<folder>. (Lock file: "
                    f"{run / child / LOCK_NAME}.)")
        with pytest.raises(RunLockedError, match=f"^{re.escape(expected)}$"):
            acquire(run)
        assert sorted(p.name for p in run.iterdir()) == [child]  # no lock file written
    finally:
        holder.close()


def test_a_live_subfolder_that_is_not_a_run_subfolder_does_not_refuse(tmp_path):
    run = tmp_path / "run"
    holders = [LiveHolder(run / name, parent_record()) for name in ("other", "my-checkpoint-3")]
    (run / "checkpoint-9").write_text("")  # a file, not a folder
    try:
        assert acquire(run)
        release(run)
    finally:
        for holder in holders:
            holder.close()


def test_a_holder_that_has_not_written_its_record_yet_is_described_so(tmp_path):
    run = tmp_path / "run"
    holder = LiveHolder(run, None)
    try:
        with pytest.raises(RunLockedError, match=r"is inside .*, which is in use by another run: a process that has "
                                                 r"not written its details yet\. That run"):
            check_nested(run / "eval")
    finally:
        holder.close()


def test_records_are_described_and_read_back(tmp_path):
    assert describe({"pid": 12, "host": "h", "started": "s"}) == "pid 12 on host h, started s (diffalign)"
    assert describe({"pid": 12, "host": "h", "started": "s", "program": "diffalign-eval"}) == \
        "pid 12 on host h, started s (diffalign-eval)"
    assert describe(None) == describe({}) == "a process that has not written its details yet"
    path = tmp_path / LOCK_NAME
    assert read_holder(path) is None  # missing
    for text in ("", "  \n", "{not json", "[1, 2]", "3"):
        path.write_text(text)
        assert read_holder(path) is None, text
    path.write_text('{"pid": 5}')
    assert read_holder(path) == {"pid": 5}


def test_the_record_names_this_process_and_under_a_launch_its_launcher(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["diffalign-train", "x" * 400])
    before = time.time()
    record = holder_record("diffalign-train")
    assert record["pid"] == os.getpid() and record["host"] == HOST and record["program"] == "diffalign-train"
    assert before <= record["start_time"] <= time.time()
    assert record["started"] == time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(record["start_time"]))
    assert record["process_start"] == process_start_time(os.getpid()) and record["launcher_pid"] is None
    assert record["command"] == ("diffalign-train " + "x" * 400)[:300]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert holder_record("p")["launcher_pid"] == os.getppid()


def test_rank_and_world_size_read_the_launchers_variables(monkeypatch):
    assert (runlock._rank(), runlock._world_size()) == (0, 1)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert runlock._rank() == 3  # torchrun without RANK
    monkeypatch.setenv("RANK", "5")
    assert runlock._rank() == 5
    monkeypatch.setenv("RANK", "")
    monkeypatch.setenv("WORLD_SIZE", "")
    assert (runlock._rank(), runlock._world_size()) == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert runlock._world_size() == 4


def test_process_alive_tells_dead_zombie_reused_and_live_processes():
    me = os.getpid()
    assert process_alive(me) and process_alive(me, process_start_time(me))
    assert process_alive(me, process_start_time(me) + 1.5)  # within the 2 s tolerance of the start time
    assert not process_alive(me, process_start_time(me) + 2.5)  # another process that got this pid
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 60
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline
        time.sleep(0.02)
    assert not process_alive(child.pid)  # exited, not yet reaped
    child.wait()
    assert not process_alive(child.pid)


def test_run_lock_holds_the_folder_for_the_block_only(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with run_lock(run, "diffalign-eval"):
        assert holds(run) and json.loads((run / LOCK_NAME).read_text())["program"] == "diffalign-eval"
    assert not holds(run) and not (run / LOCK_NAME).exists()
    with pytest.raises(KeyError), run_lock(run):
        raise KeyError("the block failed")
    assert not holds(run) and not (run / LOCK_NAME).exists()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with run_lock(tmp_path / "other"):  # another rank takes nothing and releases nothing
        assert not holds(tmp_path / "other")


def test_the_hydra_callback_locks_for_the_run_and_for_each_job(tmp_path):
    callback = RunLockCallback("diffalign-train")
    run, job = tmp_path / "run", tmp_path / "job"
    callback.on_run_start(SimpleNamespace(output_dir=run))
    assert holds(run) and callback.dirs == [str(run.resolve())]
    assert json.loads((run / LOCK_NAME).read_text())["program"] == "diffalign-train"
    callback.on_job_start(SimpleNamespace(output_dir=job))
    assert holds(job) and callback.dirs == [str(run.resolve()), str(job.resolve())]
    callback.on_job_end(SimpleNamespace(output_dir=job))
    assert not holds(job) and holds(run)
    callback.on_run_end(SimpleNamespace(output_dir=run))
    assert not holds(run) and callback.dirs == []
    callback.on_run_end(SimpleNamespace(output_dir=run))  # nothing left to drop
    assert RunLockCallback().program == "diffalign"


def test_the_hydra_callback_turns_a_refusal_into_one_error_line(tmp_path):
    run = tmp_path / "run"
    holder = LiveHolder(run, parent_record())
    try:
        with pytest.raises(SystemExit) as refused:
            RunLockCallback("diffalign-eval").on_run_start(SimpleNamespace(output_dir=run))
        assert str(refused.value).startswith(f"diffalign: error: output_dir={str(run)!r} is in use by another run: "
                                             f"pid {os.getppid()} on host {HOST}")
        blocker = tmp_path / "file"
        blocker.write_text("")
        with pytest.raises(SystemExit, match=r"^diffalign: error: output_dir='.*file/run' cannot be written"):
            RunLockCallback().on_job_start(SimpleNamespace(output_dir=blocker / "run"))
    finally:
        holder.close()
