"""Fault injection: non-finite losses and gradients, SIGTERM mid-run, SIGKILL mid-save (issue 10, items 1-3)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ONLINE_CASES as CASES
from conftest import REPO, compose_cfg, online_overrides, smoke_overrides
from safetensors.torch import load_file

from diffalign.objectives.dgpo import DGPO
from diffalign.objectives.diffusion_dpo import DiffusionDPO
from diffalign.runtime.checkpoint import latest_checkpoint, load_checkpoint
from diffalign.runtime.faults import NonFiniteError, StopSignals

LORA = "pytorch_lora_weights.safetensors"


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN gradient backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def inject(monkeypatch, cls, attr: str, bad_calls: set[int] | None, kind: str = "loss") -> list[int]:
    """Makes `cls.<attr>` return a NaN loss (kind "loss") or a finite loss with NaN gradients (kind "grad") on the
    0-based calls in `bad_calls` (every call from the first listed one when `bad_calls` is None)."""
    original = getattr(cls, attr)
    calls = []

    def wrapped(self, *args, **kwargs):
        loss, metrics = original(self, *args, **kwargs)
        n = len(calls)
        calls.append(n)
        if bad_calls is None or n in bad_calls:
            loss = loss * float("nan") if kind == "loss" else _NaNGrad.apply(loss)
        return loss, metrics

    monkeypatch.setattr(cls, attr, wrapped)
    return calls


def lora(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / LORA)


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_nonfinite_update_is_skipped_counted_and_the_run_goes_on(kind, tmp_path, monkeypatch, caplog):
    from diffalign.train.preference import train

    inject(monkeypatch, DiffusionDPO, "forward", {1}, kind)  # the 2nd update
    with caplog.at_level(logging.WARNING, logger="diffalign.runtime.faults"):
        results = train(compose_cfg(smoke_overrides(tmp_path, steps=3)))
    assert results["global_step"] == 3
    assert [h["nonfinite_skips"] for h in results["history_tail"]] == [0, 1, 1]
    # said once, in the interval's summary (diffalign.runtime.console; the interval is the whole 3-step run)
    said = [r.getMessage() for r in caplog.records if r.name == "diffalign.runtime.faults"]
    assert said == [("steps 1-3: 1 of 3 optimizer updates skipped: a non-finite loss or gradient (the step still "
                     "counts); 5 in a row stop the run (trainer.max_consecutive_nonfinite)")]
    assert results["warnings"]["nonfinite_skips"]["count"] == 1
    assert same(lora(tmp_path / "checkpoint-1"), lora(tmp_path / "checkpoint-2"))  # step 2 changed nothing
    assert not same(lora(tmp_path / "checkpoint-2"), lora(tmp_path / "checkpoint-3"))
    assert all(torch.isfinite(v).all() for v in lora(tmp_path / "checkpoint-3").values())
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["nonfinite"] == {"skips": 1, "consecutive": 0}


def test_consecutive_nonfinite_updates_stop_with_a_checkpoint(tmp_path, monkeypatch, caplog):
    from diffalign.train.preference import train

    inject(monkeypatch, DiffusionDPO, "forward", set(range(1, 99)))  # every update after the 1st
    cfg = compose_cfg(smoke_overrides(tmp_path, steps=6) + ["trainer.max_consecutive_nonfinite=2",
                                                            "trainer.checkpointing_steps=100"])
    with caplog.at_level(logging.WARNING, logger="diffalign.runtime.faults"), \
            pytest.raises(NonFiniteError, match=r"2 updates in a row.*step 3.*max_consecutive_nonfinite=2.*"
                                                r"checkpoint saved to .*checkpoint-3") as info:
        train(cfg)
    # the interval cut short by the stop is reported on the way out
    assert [r.getMessage() for r in caplog.records if r.name == "diffalign.runtime.faults"] == [
        ("at the end: 2 of 3 optimizer updates skipped: a non-finite loss or gradient (the step still counts); 2 in "
         "a row stop the run (trainer.max_consecutive_nonfinite)")]
    assert info.value.checkpoint == tmp_path / "checkpoint-3"
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["nonfinite"] == {"skips": 2, "consecutive": 2}


def test_online_loop_skips_nonfinite_updates_and_stops(tmp_path, monkeypatch):
    from diffalign.train.online import train

    inject(monkeypatch, DGPO, "__call__", None)
    cfg = compose_cfg(CASES["dgpo_sd"] + online_overrides(tmp_path, epochs=3) + [
        "trainer.max_consecutive_nonfinite=2", "online.checkpointing_epochs=10"])
    with pytest.raises(NonFiniteError, match=r"2 updates in a row.*epoch 1, step 2"):
        train(cfg)
    ckpt = tmp_path / "checkpoint-2"
    assert latest_checkpoint(tmp_path) == ckpt
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["nonfinite"] == {"skips": 2, "consecutive": 2} and state["epoch"] == 1
    assert all(float(v.abs().sum()) == 0 for k, v in lora(ckpt).items() if "lora_B" in k or "lora.up" in k)


def test_stop_signals_set_a_flag_and_restore_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT and stop.name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a second Ctrl-C interrupts
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGINT  # the first signal wins
    assert signal.getsignal(signal.SIGTERM) == before


def _train_cli(args: list[str], cwd: Path, prelude: str = "") -> subprocess.Popen:
    code = (prelude + "\nimport sys; from diffalign.cli import train; "
            "sys.argv = ['diffalign-train'] + sys.argv[1:]; train()")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {path} appeared: {proc.stderr.read()}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"{path} did not appear in {timeout}s")
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_mid_run_saves_a_checkpoint_exits_143_and_resumes_exactly(tmp_path):
    from diffalign.train.preference import train

    run = tmp_path / "run"
    args = smoke_overrides(run, steps=10_000) + ["trainer.checkpointing_steps=2"]
    proc = _train_cli(args, tmp_path)
    _wait_for(run / "checkpoint-2", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM received: stopped at step" in out and "resume=latest" in err
    stopped = latest_checkpoint(run)
    step = int(stopped.name.split("-")[1])
    assert 2 <= step < 10_000 and not list(run.glob(".tmp-*"))
    # resume to step + 2; an uninterrupted run of step + 2 steps gives the same weights
    train(compose_cfg(smoke_overrides(run, steps=step + 2) + ["trainer.checkpointing_steps=2", "resume=latest"]))
    train(compose_cfg(smoke_overrides(tmp_path / "ref", steps=step + 2) + ["trainer.checkpointing_steps=2"]))
    assert same(lora(run / "final"), lora(tmp_path / "ref" / "final"))


SLOW_SAVE = """
import os, time
from pathlib import Path
import diffalign.train.common as common  # (the loops write checkpoints through diffalign.train.common)
_save = common.save_checkpoint
def save_checkpoint(output_dir, step, *, lora_dir_writer, **kwargs):
    def writer(directory):
        lora_dir_writer(directory)
        if step == 2:  # half written: signal the test, then hang until killed
            (Path(output_dir) / "saving-2").touch()
            time.sleep(600)
    return _save(output_dir, step, lora_dir_writer=writer, **kwargs)
common.save_checkpoint = save_checkpoint
"""


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    from diffalign.train.preference import train

    run = tmp_path / "run"
    proc = _train_cli(smoke_overrides(run, steps=4), tmp_path, prelude=SLOW_SAVE)
    _wait_for(run / "saving-2", proc)
    proc.kill()  # SIGKILL while checkpoint-2 is being written
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert list(run.glob(".tmp-checkpoint-2-*"))  # the half-written folder is there, under its temporary name
    assert latest_checkpoint(run) == run / "checkpoint-1" and not (run / "checkpoint-2").exists()
    cfg = compose_cfg(smoke_overrides(run, steps=4) + ["resume=latest"])
    results = train(cfg)  # resumes from checkpoint-1 and removes the temporary folder
    assert results["global_step"] == 4 and not list(run.glob(".tmp-*"))
    train(compose_cfg(smoke_overrides(tmp_path / "ref", steps=4)))
    assert same(lora(run / "final"), lora(tmp_path / "ref" / "final"))
    from diffalign.models.tiny_random import build_tiny_random_policy

    policy = build_tiny_random_policy(seed=0)
    optimizer = torch.optim.AdamW(policy.trainable_parameters())
    assert load_checkpoint(run / "checkpoint-1", optimizer=optimizer, lr_scheduler=None)["global_step"] == 1


def test_max_consecutive_nonfinite_is_checked_up_front():
    from diffalign.config.validation import validate_train_config

    with pytest.raises(ValueError, match="trainer.max_consecutive_nonfinite must be an integer >= 1"):
        validate_train_config(compose_cfg(["trainer.max_consecutive_nonfinite=0"]))
