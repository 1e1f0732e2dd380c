"""Interrupt anywhere (issue 19 item 3): real SIGINT / SIGTERM sent to diffalign-eval and diffalign-train subprocesses
during the evaluation, the data preparation and the training run's evaluation stop them at the next safe point with one
line and exit 130 / 143, without a traceback; what was finished is kept and a rerun continues it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CHILD_ENV as ENV
from conftest import REPO, compose_cfg

from diffalign.runtime.faults import StopSignals, stop_received

SLOW_EVAL = """
import time
import diffalign.evaluation.evaluate as evaluate
sample_images = evaluate.sample_images
def slow(*args, **kwargs):
    time.sleep(0.4)  # room for a signal between two batches
    return sample_images(*args, **kwargs)
evaluate.sample_images = slow
"""
EVAL = ["model=tiny_random", "eval.prompts_per_tag=1", "eval.seeds=[0]", "eval.sampler.num_inference_steps=2",
        "eval.batch_size=1", "report=false"]


def _start(command: str, args: list[str], prelude: str = "") -> subprocess.Popen:
    code = (prelude + f"\nimport sys; from diffalign.cli import {command.split('-')[1].replace('eval', 'evaluate')}"
            f" as main; sys.argv = ['{command}'] + sys.argv[1:]; main()")
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(predicate, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_nested_stop_signals_hand_their_signal_outwards():
    with StopSignals() as outer:
        with StopSignals(hint="rerun") as inner:
            assert stop_received() is None
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop_received() is inner and outer.signum is None
            err = inner.interrupted("during x")
            assert str(err) == "stopped by SIGTERM during x; rerun" and err.exit_code == 143
        assert outer.signum == signal.SIGTERM and stop_received() is outer
    assert stop_received() is None


@pytest.mark.slow
def test_ctrl_c_in_diffalign_eval_stops_before_the_next_batch_and_a_rerun_continues(tmp_path):
    from diffalign.cli import _eval_main

    out_dir = tmp_path / "ev"
    proc = _start("diffalign-eval", [f"output_dir={out_dir}", *EVAL], prelude=SLOW_EVAL)
    _wait(lambda: _lines(out_dir / "samples.jsonl") >= 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("diffalign: stopped by SIGINT during the evaluation (") and "evaluations finished, kept in" \
        in last and last.endswith("run the same command again to continue")
    kept = _lines(out_dir / "samples.jsonl")
    assert kept >= 2 and not (out_dir / "metrics.json").exists()
    _eval_main(compose_cfg([f"output_dir={out_dir}", *EVAL], name="evaluate"))  # continues in the same folder
    _eval_main(compose_cfg([f"output_dir={tmp_path / 'ref'}", *EVAL], name="evaluate"))
    a, b = (json.loads((d / "metrics.json").read_text()) for d in (out_dir, tmp_path / "ref"))
    assert a["variants"] == b["variants"]


@pytest.mark.slow
def test_a_second_ctrl_c_interrupts_at_once_without_a_traceback(tmp_path):
    out_dir = tmp_path / "ev"
    prelude = SLOW_EVAL.replace("0.4", "5")
    proc = _start("diffalign-eval", [f"output_dir={out_dir}", *EVAL], prelude=prelude)
    _wait(lambda: (out_dir / "samples.jsonl").exists(), proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    # the message is the last thing written: the open bar is closed first, not drawn again as the interpreter exits
    assert err.rstrip("\n").rsplit("\n", 1)[-1] == "diffalign: interrupted" and "Traceback" not in err, err[-600:]


TRAIN = ["model=tiny_random", "trainer.max_steps=2", "trainer.batch_size=2", "trainer.checkpointing_steps=1",
         "trainer.log_with=none", "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=1"]
PREP = ["data=ranked_pairs", "data.num_prompts=4", "data.samples_per_prompt=4", "data.batch_size=2",
        "data.sampler.num_inference_steps=2", "data.reward=geneval_shapes", "eval.enabled=false"]
SLOW_PREP = """
import time
import diffalign.data.onpolicy as onpolicy
_rollout = onpolicy.rollout
def rollout(*args, **kwargs):
    time.sleep(0.4)
    return _rollout(*args, **kwargs)
onpolicy.rollout = rollout
"""


@pytest.mark.slow
def test_sigint_during_the_data_preparation_stops_after_the_chunk_and_resume_finishes_it(tmp_path):
    from diffalign.train.preference import train

    run = tmp_path / "run"
    proc = _start("diffalign-train", [f"output_dir={run}", *TRAIN, *PREP], prelude=SLOW_PREP)
    _wait(lambda: len(list(run.glob("prepared/*/chunk-*"))) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("diffalign: stopped by SIGINT during the data preparation after ") and \
        last.endswith("chunks (kept in " + str(next(run.glob("prepared/*")))
                      + f"); continue with output_dir={run} resume=latest"), last
    assert "Traceback" not in err and not list(run.glob("checkpoint-*"))
    made = len(list(run.glob("prepared/*/chunk-*")))
    assert 2 <= made < 8
    results = train(compose_cfg([f"output_dir={run}", *TRAIN, *PREP, "resume=latest"]))
    assert results["global_step"] == 2 and len(list(run.glob("prepared/*/chunk-*"))) == 8


@pytest.mark.slow
def test_sigterm_during_the_training_runs_evaluation_stops_it_and_resume_finishes_it(tmp_path):
    from diffalign.train.preference import train

    run = tmp_path / "run"
    args = [f"output_dir={run}", *TRAIN, "data=shapes_pairs", "data.num_pairs=16", *EVAL[1:5]]
    proc = _start("diffalign-train", args, prelude=SLOW_EVAL)
    _wait(lambda: _lines(run / "eval" / "samples.jsonl") >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("diffalign: stopped by SIGTERM during the evaluation (") and \
        last.endswith(f"continue with output_dir={run} resume=latest") and "Traceback" not in err
    assert (run / "checkpoint-2").is_dir() and not (run / "eval" / "metrics.json").exists()
    results = train(compose_cfg(args + ["resume=latest"]))
    assert results["global_step"] == 2 and (run / "eval" / "metrics.json").is_file()
