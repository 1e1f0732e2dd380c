"""One run per output folder (issue 19 item 1): the lock file, its refusal and takeover, ranks, lineage pruning."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CHILD_ENV as ENV
from conftest import REPO, compose_cfg, run_cli_in_process, smoke_overrides

from diffalign import cli
from diffalign.runtime import runlock
from diffalign.runtime.checkpoint import checkpoint_lineage, save_checkpoint
from diffalign.runtime.launch import process_start_time
from diffalign.runtime.runlock import LOCK_NAME, RunLockedError, acquire, release

HOST = socket.gethostname()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(folder: Path, **fields) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"host": HOST, "started": "2026-01-01 00:00:00 UTC", "program": "diffalign-train", **fields}
    (folder / LOCK_NAME).write_text(json.dumps(record))


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_lock_records_the_holder_is_reentrant_and_released(tmp_path):
    run = tmp_path / "run"
    assert acquire(run, "diffalign-train") and acquire(run, "diffalign-train")  # (the CLI, then the loop)
    holder = json.loads((run / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == HOST and holder["program"] == "diffalign-train"
    assert abs(holder["start_time"] - time.time()) < 60 and holder["started"]
    release(run)
    assert (run / LOCK_NAME).exists()  # one reference left
    release(run)
    assert not (run / LOCK_NAME).exists()


HOLD = """
import sys, time
from diffalign.runtime.runlock import acquire
acquire(sys.argv[1], "diffalign-eval")
print("locked", flush=True)
time.sleep(120)
"""


def test_a_live_holder_refuses_and_its_sigkilled_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError) as refused:
            acquire(run, "diffalign-train")
        message = str(refused.value)
        assert f"pid {holder.pid} on host {HOST}, started " in message and "(diffalign-eval)" in message
        assert "pass another output_dir=<folder>" in message and "Wait for it" in message
    finally:
        holder.kill()  # SIGKILL: the kernel drops its flock; the file still names it
        holder.wait()
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == holder.pid
    said = []
    assert acquire(run, "diffalign-train", log=said.append)
    assert len(said) == 1 and f"left by pid {holder.pid} on host {HOST}" in said[0] and "no longer running" in said[0]
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    release(run)


def test_stale_records_are_taken_over_and_live_or_foreign_ones_refused(tmp_path):
    said = []
    dead = tmp_path / "dead"
    _write_lock(dead, pid=_dead_pid())
    assert acquire(dead, log=said.append) and "taking over the stale lock" in said[-1]
    release(dead)
    reused = tmp_path / "reused"  # a live pid that started at another time: the holder's pid was reused
    _write_lock(reused, pid=os.getppid(), process_start=12.0)
    assert acquire(reused, log=said.append) and f"pid {os.getppid()}" in said[-1]
    release(reused)
    # a live holder whose flock is not visible (a file system without flock): its pid and start time decide
    live = tmp_path / "live"
    _write_lock(live, pid=os.getppid(), process_start=process_start_time(os.getppid()))
    with pytest.raises(RunLockedError, match=f"pid {os.getppid()} on host {HOST}"):
        acquire(live)
    other = tmp_path / "other"
    _write_lock(other, pid=1, host="node-17")
    with pytest.raises(RunLockedError, match=r"on host node-17.*once that run has ended, delete .*\.diffalign\.lock"):
        acquire(other)
    assert len(said) == 2


def test_other_ranks_take_no_lock_and_are_refused_only_by_another_launch(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert not acquire(run) and not run.exists()  # before rank 0 got there: nothing to check, nothing written
    parent_start = process_start_time(os.getppid())
    _write_lock(run, pid=os.getppid(), process_start=parent_start, launcher_pid=os.getppid())
    assert not acquire(run)  # rank 0 of this launch (same launcher) holds it
    _write_lock(run, pid=os.getppid(), process_start=parent_start, launcher_pid=os.getppid() + 1)
    with pytest.raises(RunLockedError, match="in use by another run"):
        acquire(run)
    monkeypatch.setenv("RANK", "0")  # rank 0 takes the lock and records the launcher
    (run / LOCK_NAME).unlink()
    assert acquire(run)
    assert json.loads((run / LOCK_NAME).read_text())["launcher_pid"] == os.getppid()
    release(run)


def test_unwritable_output_dir_is_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PermissionError, match=r"output_dir='.*file/run' cannot be written"):
        acquire(blocker / "run")


# --------------------------------------------------------------------------------------------- two real processes

WAIT_IN_TRAIN = """
import os, time
from pathlib import Path
import diffalign.train.preference as preference
def train(cfg):  # holds the run (and its lock) until the test says so
    Path(os.environ["MARK"] + "-started").touch()
    while not Path(os.environ["MARK"] + "-release").exists():
        time.sleep(0.05)
    return {}
preference.train = train
"""


def _cli(args: list[str], prelude: str = "", **env) -> subprocess.Popen:
    code = prelude + "\nimport sys; from diffalign.cli import train; sys.argv = ['diffalign-train'] + sys.argv[1:]; train()"
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env={**ENV, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # (two CLI processes: ~14 s on 2 busy cores)
def test_a_second_diffalign_train_into_a_locked_folder_is_refused_before_writing_anything(tmp_path, monkeypatch,
                                                                                         capsys, release_run_locks):
    run, mark = tmp_path / "run", tmp_path / "a"
    first = _cli(smoke_overrides(run, steps=2), prelude=WAIT_IN_TRAIN, MARK=str(mark))
    try:
        deadline = time.time() + 120
        while not Path(f"{mark}-started").exists():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline
            time.sleep(0.05)
        assert (run / ".hydra" / "config.yaml").is_file()  # the first run's Hydra files are there
        before = _snapshot(run)
        # (the second diffalign-train in this process: the holder is the child, another process)
        second = run_cli_in_process(cli.train, smoke_overrides(run, steps=3), REPO, monkeypatch, capsys)
        err = second.stderr
        assert second.returncode == 1, err
        assert err.strip().startswith("diffalign: error: output_dir=") and "Traceback" not in err
        assert f"in use by another run: pid {first.pid} on host {HOST}, started " in err
        assert "(diffalign-train)" in err and "pass another output_dir=<folder>" in err
        assert _snapshot(run) == before  # nothing written: not even Hydra's .hydra/ files or its log
    finally:
        Path(f"{mark}-release").touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert not (run / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------------ lineage pruning


def _save(folder: Path, step: int, lineage: str | None, keep_last: int = -1) -> Path:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(folder, step, lora_dir_writer=lambda d: None, optimizer=optimizer, lr_scheduler=None,
                           state={"global_step": step}, keep_last=keep_last, lineage=lineage)


def test_keep_last_prunes_only_the_runs_own_lineage(tmp_path):
    _save(tmp_path, 1, "other")
    _save(tmp_path, 2, None)  # written before lineages existed
    for step in (3, 4, 5, 6):
        _save(tmp_path, step, "mine", keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (1, 2, 5, 6)]
    assert checkpoint_lineage(tmp_path / "checkpoint-6") == "mine" and checkpoint_lineage(tmp_path / "checkpoint-2") is None
    _save(tmp_path, 7, None, keep_last=1)  # no lineage: the old behaviour, every numbered checkpoint counts
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-7"]


def test_resume_latest_prunes_the_resumed_lineage_and_leaves_a_foreign_checkpoint(tmp_path):
    from diffalign.train.preference import train

    run, other = tmp_path / "run", tmp_path / "other"
    keep2 = ["trainer.keep_last=2"]
    train(compose_cfg(smoke_overrides(other, steps=1) + keep2))
    train(compose_cfg(smoke_overrides(run, steps=2) + keep2))
    lineage = checkpoint_lineage(run / "checkpoint-2")
    assert lineage and checkpoint_lineage(other / "checkpoint-1") not in (None, lineage)
    shutil.copytree(other / "checkpoint-1", run / "checkpoint-0")  # a foreign checkpoint in the folder
    train(compose_cfg(smoke_overrides(run, steps=4) + keep2 + ["resume=latest"]))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-0", "checkpoint-3", "checkpoint-4"]
    assert checkpoint_lineage(run / "checkpoint-4") == lineage
    assert not (run / LOCK_NAME).exists() and not runlock._HELD


def test_diffalign_eval_into_a_locked_folder_is_refused(tmp_path):
    run = tmp_path / "eval"
    assert acquire(run, "diffalign-train")
    try:
        code = "import sys; from diffalign.cli import evaluate; sys.argv = ['diffalign-eval'] + sys.argv[1:]; evaluate()"
        done = subprocess.run([sys.executable, "-c", code, f"output_dir={run}", "model=tiny_random"], cwd=REPO,
                              env=ENV, check=False, capture_output=True, text=True, timeout=120)
    finally:
        release(run)
    assert done.returncode == 1, done.stderr
    assert f"in use by another run: pid {os.getpid()} on host {HOST}" in done.stderr and "Traceback" not in done.stderr
    assert sorted(p.name for p in run.iterdir()) == []  # (the lock file went with the release)


def test_a_run_inside_a_live_runs_folder_or_over_a_live_subfolder_is_refused(tmp_path, monkeypatch, capsys,
                                                                             release_run_locks):
    """``diffalign-eval output_dir=runs/x/eval`` while ``diffalign-train`` runs in ``runs/x`` (whose evaluation writes
    there) is refused by the lock, as is a training run into ``runs/x`` while an evaluation holds ``runs/x/eval``;
    once the holder is gone (SIGKILL: its file is stale) both are allowed."""
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"output_dir='.*run/eval' is inside '.*run', which is in use by "
                                                 rf"another run: pid {holder.pid} on host {HOST}"):
            acquire(run / "eval", "diffalign-eval")
        # (diffalign-eval in this process: the holder is the child, another process)
        done = run_cli_in_process(cli.evaluate, [f"output_dir={run / 'eval'}", "model=tiny_random"], REPO,
                                  monkeypatch, capsys, prog="diffalign-eval")
        assert done.returncode == 1 and "is inside" in done.stderr and f"pid {holder.pid}" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and not (run / "eval").exists()  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert acquire(run / "eval", "diffalign-eval")  # the holder is gone
    release(run / "eval")
    evaluation = subprocess.Popen([sys.executable, "-c", HOLD, str(run / "eval")], env=ENV, stdout=subprocess.PIPE,
                                  text=True)
    try:
        assert evaluation.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"output_dir='.*run' holds '.*run/eval', which is in use by another "
                                                 rf"run: pid {evaluation.pid}"):
            acquire(run, "diffalign-train")
    finally:
        evaluation.kill()
        evaluation.wait()
    assert acquire(run, "diffalign-train")
    release(run)
