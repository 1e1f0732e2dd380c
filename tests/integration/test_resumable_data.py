"""Resumable on-policy data preparation (issue 19 item 4): chunks in the run folder, continued after a fault or a
SIGKILL, reused when finished, and never mixed across settings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, EveryOtherCorrect

from diffalign.data.failure_pairs import FailurePairs
from diffalign.data.ranked_pairs import RankedPairs
from diffalign.data.resumable import Preparation
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.types import RewardOutput


class Counting:
    """A stand-in reward: the mean brightness, judged correct above 0.5; counts its calls and can fail on one."""

    modality = "image"

    def __init__(self, fail_on_call: int | None = None):
        self.calls, self.fail_on_call = 0, fail_on_call

    def __call__(self, images, prompts, metadata=None):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("injected fault")
        scores = images.float().mean(dim=(1, 2, 3))
        return RewardOutput(scores, info={"correct": scores > 0.5})


@pytest.fixture(scope="module")
def policy():
    return build_tiny_random_policy(seed=0)


def ranked(seed: int = 3) -> RankedPairs:
    # 3 prompts × 4 samples in batches of 2: 6 chunks
    return RankedPairs(num_prompts=3, samples_per_prompt=4, sampler={"name": "ddim", "num_inference_steps": 2}, batch_size=2, seed=seed,
                       reward="judge")


def same_pairs(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        set(x) == set(y) and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k] for k in x)
        for x, y in zip(a, b))


def test_an_interrupted_preparation_continues_and_equals_an_uninterrupted_one(policy, tmp_path):
    said = []
    prep = Preparation(tmp_path / "prepared", {"weights": "w0"}, progress=False, log=said.append)
    reference = ranked()
    reference.prepare(policy, {"judge": Counting()})  # no preparation: everything in memory, as before
    with pytest.raises(RuntimeError, match="injected fault"):
        ranked().prepare(policy, {"judge": Counting(fail_on_call=4)}, preparation=prep)  # dies in chunk 4 of 6
    (folder,) = (tmp_path / "prepared").iterdir()
    assert sorted(p.name for p in folder.glob("chunk-*")) == [f"chunk-{k:05d}.safetensors" for k in range(3)]
    resumed, judge = ranked(), Counting()
    resumed.prepare(policy, {"judge": judge}, preparation=prep)
    assert judge.calls == 3  # only the three missing chunks were sampled and judged
    assert said[-1] == f"[diffalign] data: continuing the preparation in {folder} at 3 of 6 chunks"
    assert same_pairs(resumed.pairs, reference.pairs) and resumed.stats == reference.stats
    again, judge = ranked(), Counting()
    again.prepare(policy, {"judge": judge}, preparation=prep)  # finished: reused, nothing sampled
    assert judge.calls == 0 and same_pairs(again.pairs, reference.pairs)
    assert "all 6 chunks" in said[-1]


def test_other_settings_or_weights_never_reuse_the_chunks(policy, tmp_path):
    prep = Preparation(tmp_path / "prepared", {"weights": "w0"}, progress=False, log=lambda m: None)
    ranked().prepare(policy, {"judge": Counting()}, preparation=prep)
    judge = Counting()
    ranked(seed=4).prepare(policy, {"judge": judge}, preparation=prep)  # another data seed
    assert judge.calls == 6
    judge = Counting()
    other_weights = Preparation(tmp_path / "prepared", {"weights": "w1"}, progress=False, log=lambda m: None)
    ranked().prepare(policy, {"judge": judge}, preparation=other_weights)
    assert judge.calls == 6 and len(list((tmp_path / "prepared").iterdir())) == 3


def test_failure_pairs_and_their_ablation_share_the_samples(policy, tmp_path):
    """The verdicts are stored with the samples; losers=all (pairing, not sampling) reuses them."""
    prep = Preparation(tmp_path / "prepared", {}, progress=False, log=lambda m: None)
    kwargs = {"num_prompts": 3, "samples_per_prompt": 2, "sampler": {"name": "ddim", "num_inference_steps": 2, "eta": 0.0},
              "batch_size": 2, "seed": 5,
              "reward": "judge"}
    reference = FailurePairs(**kwargs)
    reference.prepare(policy, {"judge": EveryOtherCorrect()})
    stored = FailurePairs(**kwargs)
    stored.prepare(policy, {"judge": EveryOtherCorrect()}, preparation=prep)
    assert same_pairs(stored.pairs, reference.pairs)
    judge = EveryOtherCorrect()
    every = FailurePairs(**kwargs, losers="all")
    every.prepare(policy, {"judge": judge}, preparation=prep)
    assert judge.seen == 0 and len(every.pairs) == 6


def test_a_new_run_reuses_a_finished_preparation_of_a_sibling_run(policy, tmp_path):
    done = Preparation(tmp_path / "runs" / "a" / "prepared", {"weights": "w0"}, progress=False, log=lambda m: None)
    reference = ranked()
    reference.prepare(policy, {"judge": Counting()}, preparation=done)
    said = []
    fresh = Preparation(tmp_path / "runs" / "b" / "prepared", {"weights": "w0"}, progress=False, log=said.append,
                        search=[tmp_path / "runs" / "a" / "prepared"])
    judge, data = Counting(), ranked()
    data.prepare(policy, {"judge": judge}, preparation=fresh)
    assert judge.calls == 0 and same_pairs(data.pairs, reference.pairs)
    assert any("reusing the finished preparation in" in m for m in said)
    assert len(list((tmp_path / "runs" / "b" / "prepared").glob("*/chunk-*"))) == 6  # the run folder is whole


def test_a_stop_signal_ends_the_preparation_after_the_current_chunk(policy, tmp_path):
    asked = []

    def should_stop():
        asked.append(1)
        return len(asked) == 2

    class Stopped(Exception):
        pass

    prep = Preparation(tmp_path / "prepared", {}, progress=False, log=lambda m: None, should_stop=should_stop,
                       stop_error=lambda done, total, folder: Stopped(f"{done}/{total} in {folder.name}"))
    with pytest.raises(Stopped, match=r"^2/6 in onpolicy-samples-"):
        ranked().prepare(policy, {"judge": Counting()}, preparation=prep)
    assert len(list((tmp_path / "prepared").glob("*/chunk-*"))) == 2


# ----------------------------------------------------------------------------- the training loop, killed mid-way

DATA = ["data=ranked_pairs", "data.num_prompts=4", "data.samples_per_prompt=4", "data.batch_size=2",
        "data.sampler.num_inference_steps=2", "data.reward=geneval_shapes", "model=tiny_random", "trainer.max_steps=2",
        "trainer.batch_size=2", "trainer.checkpointing_steps=1", "trainer.log_with=none", "eval.enabled=false",
        "trainer.optimizer.lr=1e-2", "trainer.lr_warmup_steps=1"]

SLOW_ROLLOUT = """
import time
import diffalign.data.onpolicy as onpolicy
_rollout = onpolicy.rollout
def rollout(*args, **kwargs):
    time.sleep(0.5)  # room to kill the run between two chunks
    return _rollout(*args, **kwargs)
onpolicy.rollout = rollout
"""


@pytest.mark.slow
def test_training_run_killed_during_the_preparation_resumes_it_exactly(tmp_path, capsys):
    from conftest import compose_cfg
    from safetensors.torch import load_file

    from diffalign.runtime.checkpoint import latest_checkpoint
    from diffalign.train.preference import train

    run, ref = tmp_path / "runs" / "run", tmp_path / "elsewhere" / "ref"  # (not siblings: ref must sample its own)
    code = (SLOW_ROLLOUT + "\nimport sys; from diffalign.cli import train; "
            "sys.argv = ['diffalign-train'] + sys.argv[1:]; train()")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code, f"output_dir={run}", *DATA], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while len(list(run.glob("prepared/*/chunk-*"))) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    proc.kill()  # SIGKILL mid-way through the 8 chunks
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    made = len(list(run.glob("prepared/*/chunk-*")))
    assert 3 <= made < 8 and latest_checkpoint(run) is None
    capsys.readouterr()
    resumed = train(compose_cfg([f"output_dir={run}", *DATA, "resume=latest"]))
    out, err = capsys.readouterr()
    assert f"at {made} of 8 chunks" in out and "taking over the stale lock" in err
    fresh = train(compose_cfg([f"output_dir={ref}", *DATA]))
    out, _ = capsys.readouterr()
    assert "continuing the preparation" not in out and "reusing" not in out
    assert resumed["data_stats"] == fresh["data_stats"]
    a, b = (load_file(d / "final" / "pytorch_lora_weights.safetensors") for d in (run, ref))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    chunks = sorted(run.glob("prepared/*/chunk-*"))
    assert len(chunks) == 8
    for path in chunks:  # chunk by chunk, the resumed run's data are the uninterrupted run's
        x, y = load_file(path), load_file(ref / "prepared" / path.parent.name / path.name)
        assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)
