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


def test_an_output_dir_inside_a_live_runs_folder_is_refused_naming_both_folders_and_the_holder(tmp_path):
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


# --------------------------------------------------------------------------- acquire's own paths (mutation survivors)


def test_this_processs_own_record_is_neither_refused_nor_reported(tmp_path):
    """A record naming this very process (pid and host), e.g. left by a release that could not remove the file, is
    taken without a takeover line; the same pid on another host is another host's run."""
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps(parent_record(pid=os.getpid(), process_start=process_start_time(
        os.getpid()))))
    said = []
    assert acquire(run, log=said.append) and said == []
    release(run)
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_NAME).write_text(json.dumps(parent_record(pid=os.getpid(), host="node-17")))
    with pytest.raises(RunLockedError, match="on host node-17"):
        acquire(other)


def test_refusals_say_the_whole_message_for_this_host_and_another(tmp_path):
    run = tmp_path / "run"
    holder = LiveHolder(run, parent_record())
    try:
        expected = (f"output_dir={str(run)!r} is in use by another run: pid {os.getppid()} on host {HOST}, started "
                    f"2026-12-01 19:05:03 UTC (diffalign-train). Wait for it to finish, or pass another "
                    f"output_dir=<folder>. (Lock file: {run / LOCK_NAME}.)")
        with pytest.raises(RunLockedError, match=f"^{re.escape(expected)}$"):
            acquire(run)
    finally:
        holder.close()
    other = tmp_path / "other"
    other.mkdir()
    (other / LOCK_NAME).write_text(json.dumps(parent_record(host="node-17")))
    expected = (f"output_dir={str(other)!r} is in use by another run: pid {os.getppid()} on host node-17, started "
                f"2026-12-01 19:05:03 UTC (diffalign-train). Wait for it to finish, or pass another output_dir=<folder>. "
                f"This host cannot tell whether a process on node-17 still runs: once that run has ended, delete "
                f"{other / LOCK_NAME}.")
    with pytest.raises(RunLockedError, match=f"^{re.escape(expected)}$"):
        acquire(other)


def test_a_flocked_file_refuses_whatever_its_record_says_and_the_taken_lock_is_a_real_flock(tmp_path):
    run = tmp_path / "run"
    holder = LiveHolder(run, parent_record(pid=999_999_999))  # a pid that cannot run: only the flock says "held"
    try:
        with pytest.raises(RunLockedError, match="pid 999999999"):
            acquire(run)
    finally:
        holder.close()
    assert acquire(run)
    try:
        other = os.open(run / LOCK_NAME, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(other)
        umask = os.umask(0)
        os.umask(umask)
        assert (run / LOCK_NAME).stat().st_mode & 0o777 == 0o644 & ~umask
        assert json.loads((run / LOCK_NAME).read_text())["program"] == "diffalign"  # acquire's default program
    finally:
        release(run)


def test_a_holder_that_has_not_written_its_record_is_read_again_ten_times(tmp_path, monkeypatch):
    """A flocked file still empty is re-read every 0.02 s, ten times at most, before the refusal (its holder may be
    between its flock and its write); a record already there is read at once."""
    run = tmp_path / "run"
    holder = LiveHolder(run, None)
    sleeps = []
    monkeypatch.setattr(runlock.time, "sleep", sleeps.append)
    try:
        with pytest.raises(RunLockedError, match="in use by another run: a process that has not written its details"):
            acquire(run)
        assert sleeps == [0.02] * 10
        sleeps.clear()

        def write_on_the_third(seconds):
            sleeps.append(seconds)
            if len(sleeps) == 3:
                os.pwrite(holder.fd, json.dumps(parent_record()).encode(), 0)
        monkeypatch.setattr(runlock.time, "sleep", write_on_the_third)
        with pytest.raises(RunLockedError, match=f"in use by another run: pid {os.getppid()} on host"):
            acquire(run)
        assert sleeps == [0.02] * 3
        sleeps.clear()
        with pytest.raises(RunLockedError, match=f"pid {os.getppid()}"):
            acquire(run)
        assert sleeps == []
    finally:
        holder.close()


class ReplacingFlock:
    """`fcntl` whose first exclusive flock happens just after another run released the folder: the file opened is
    unlinked (and, with `recreate`, a new one made) before the lock is taken, as a release between our open and our
    flock does."""

    LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN = fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_SH, fcntl.LOCK_UN

    def __init__(self, path: Path, recreate: bool):
        self.path, self.recreate, self.calls = path, recreate, 0

    def flock(self, fd, operation):
        if operation & fcntl.LOCK_EX:
            self.calls += 1
            if self.calls == 1:
                self.path.unlink()
                if self.recreate:
                    self.path.write_text("")
        fcntl.flock(fd, operation)


@pytest.mark.parametrize("recreate", [True, False])
def test_a_lock_file_replaced_before_the_flock_is_opened_again(tmp_path, monkeypatch, recreate):
    run = tmp_path / "run"
    fake = ReplacingFlock(run / LOCK_NAME, recreate)
    monkeypatch.setattr(runlock, "fcntl", fake)
    assert acquire(run, "diffalign-eval")
    try:
        assert fake.calls == 2  # the stale file, then the one at the path
        held = runlock._HELD[run.resolve()]
        assert os.fstat(held.fd).st_ino == (run / LOCK_NAME).stat().st_ino
        assert json.loads((run / LOCK_NAME).read_text())["program"] == "diffalign-eval"
        umask = os.umask(0)
        os.umask(umask)
        assert (run / LOCK_NAME).stat().st_mode & 0o777 == 0o644 & ~umask
    finally:
        release(run)
    assert not (run / LOCK_NAME).exists()


class NoFlock:
    """`fcntl` of a file system without flock (some network mounts): every flock fails with `code`."""

    LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN = fcntl.LOCK_EX, fcntl.LOCK_NB, fcntl.LOCK_SH, fcntl.LOCK_UN

    def __init__(self, code: int):
        self.code = code

    def flock(self, fd, operation):
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("without", ["ENOLCK", "EOPNOTSUPP", "ENOSYS", "EINVAL", "no fcntl"])
def test_without_flock_the_record_decides(tmp_path, monkeypatch, without):
    import errno

    monkeypatch.setattr(runlock, "fcntl", None if without == "no fcntl" else NoFlock(getattr(errno, without)))
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps(parent_record()))  # a live process of this host
    with pytest.raises(RunLockedError, match=rf"^output_dir='.*run/eval' is inside '.*run', which is in use by "
                                             rf"another run: pid {os.getppid()} on host {HOST}"):
        acquire(run / "eval")
    with pytest.raises(RunLockedError, match=rf"^output_dir='.*run' is in use by another run: pid {os.getppid()}"):
        acquire(run)
    (run / LOCK_NAME).write_text(json.dumps(parent_record(host="node-17")))  # another host's: cannot be told
    with pytest.raises(RunLockedError, match="is inside .* on host node-17"):
        acquire(run / "eval")
    (run / LOCK_NAME).write_text(json.dumps(parent_record(pid=999_999_999)))  # a dead one: stale
    assert acquire(run / "eval")
    release(run / "eval")
    (run / LOCK_NAME).write_text(json.dumps(parent_record(pid=os.getpid(), process_start=process_start_time(
        os.getpid()))))  # this process's own
    assert acquire(run / "eval")
    release(run / "eval")


def test_another_flock_error_is_raised(tmp_path, monkeypatch):
    import errno

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text("")
    monkeypatch.setattr(runlock, "fcntl", NoFlock(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        check_nested(run / "eval")
    with pytest.raises(OSError, match="Input/output error"):
        acquire(tmp_path / "other")


def test_a_stale_lock_is_reported_on_stderr_by_default(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps(parent_record(pid=999_999_999)))
    assert acquire(run)
    release(run)
    assert capsys.readouterr().err == (f"diffalign: taking over the stale lock of {run} left by pid 999999999 on host "
                                       f"{HOST}, started 2026-12-01 19:05:03 UTC (diffalign-train), which is no longer "
                                       "running\n")


def test_a_single_process_run_with_a_stray_rank_takes_the_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # WORLD_SIZE unset: one process
    assert acquire(tmp_path / "run") and holds(tmp_path / "run")
    release(tmp_path / "run")


def test_another_launchs_holder_is_named_to_a_non_zero_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text(json.dumps(parent_record(launcher_pid=1)))
    with pytest.raises(RunLockedError, match=rf"^output_dir='.*run' is in use by another run: pid {os.getppid()} on "
                                             rf"host {HOST}, started 2026-12-01 19:05:03 UTC \(diffalign-train\)\."):
        acquire(run)


def test_an_unwritable_output_dir_says_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match=r"cannot be written \(.*\); pass an output_dir=<folder> on a writable "
                                              r"disk$"):
        acquire(blocker / "run")


def test_a_live_process_ignoring_nothing_is_not_signalled():
    """The liveness probe is signal 0: a child with SIGHUP's default action (it ends the process) survives it."""
    code = ("import signal, sys, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print('ready', flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert process_alive(child.pid)
        time.sleep(0.2)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_the_state_is_read_after_the_last_parenthesis_of_the_command_name():
    """``/proc/<pid>/stat`` is ``pid (comm) state …`` and comm may hold ``)`` and spaces: a running process named
    ``a) Z b`` is alive (its state is the field after the *last* ``)``)."""
    code = ("import ctypes, sys, time; ctypes.CDLL(None).prctl(15, b'a) Z b', 0, 0, 0); print('ready', flush=True); "
            "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert "(a) Z b)" in Path(f"/proc/{child.pid}/stat").read_text()
        assert process_alive(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_start_time_exactly_two_seconds_off_is_still_the_same_process():
    start = process_start_time(os.getpid())
    assert abs(start - (start + 2.0)) == 2.0
    assert process_alive(os.getpid(), start + 2.0)  # the tolerance is inclusive: "> 2 s" means another process


def test_release_after_the_file_was_removed_by_hand(tmp_path):
    run = tmp_path / "run"
    assert acquire(run)
    fd = runlock._HELD[run.resolve()].fd
    (run / LOCK_NAME).unlink()
    release(run)  # no error: the file is already gone
    assert not holds(run)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_the_lock_file_is_created_readable_by_all_and_writable_by_its_owner(tmp_path):
    umask = os.umask(0)
    os.umask(umask)
    assert acquire(tmp_path / "run")
    try:
        assert (tmp_path / "run" / LOCK_NAME).stat().st_mode & 0o777 == 0o644 & ~umask
    finally:
        release(tmp_path / "run")


def test_undo_run_start_removes_only_what_the_run_start_wrote(tmp_path):
    """`undo_run_start`: a folder this process created, holding only its lock, Hydra's three files and the job log,
    goes with the parents created for it (not the parent that existed); one holding anything else stays; a folder
    that existed gets Hydra's files back as they were and its log cut back, and only when asked (``existing``)."""
    hydra_files = ("config.yaml", "hydra.yaml", "overrides.yaml")
    runlock.forget_run_start()  # (records of runs this worker process ran before are not this test's)

    def start(folder, log="cli.log"):  # what Hydra does after the callback: the lock, .hydra/, the job log
        runlock.record_run_start(folder, log)
        assert acquire(folder, "diffalign-train")
        (folder / ".hydra").mkdir(exist_ok=True)
        for name in hydra_files:
            (folder / ".hydra" / name).write_text(f"new {name}\n")
        with open(folder / log, "a") as f:
            f.write("new line\n")

    created = tmp_path / "runs" / "a" / "b"
    start(created)
    kept = tmp_path / "kept"
    start(kept)
    (kept / "checkpoint-1").mkdir()
    existing = tmp_path / "existing"
    (existing / ".hydra").mkdir(parents=True)
    (existing / ".hydra" / "config.yaml").write_text("old config\n")
    (existing / "cli.log").write_text("old log\n")
    start(existing)
    assert runlock.undo_run_start(existing=False) == [created.resolve()]  # (kept: not only the run start's files)
    assert not (tmp_path / "runs").exists() and not holds(created)
    assert (kept / "checkpoint-1").is_dir() and (kept / ".hydra" / "config.yaml").is_file()
    assert (existing / ".hydra" / "hydra.yaml").is_file() and holds(existing)  # (existing=False: left alone)
    assert runlock.undo_run_start() == [existing.resolve()]
    assert sorted(p.name for p in (existing / ".hydra").iterdir()) == ["config.yaml"]
    assert (existing / ".hydra" / "config.yaml").read_text() == "old config\n"
    assert (existing / "cli.log").read_text() == "old log\n" and not holds(existing)
    assert not (existing / LOCK_NAME).exists() and runlock.undo_run_start() == []
    release(kept)
    empty = tmp_path / "empty"  # an existing empty folder: Hydra's .hydra/ and log go, the folder stays
    empty.mkdir()
    start(empty)
    assert runlock.undo_run_start() == [empty.resolve()] and list(empty.iterdir()) == []
