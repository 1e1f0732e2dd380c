"""Exact resume depends on every random state the checkpoint carries (issue 35): the global generators of Python's
`random`, NumPy and torch (CPU), restored by `diffalign.runtime.checkpoint.load_checkpoint`, and the data sampler's position
(`diffalign.data.preference.ResumableSampler`, in the trainer state).

The training loops draw their own randomness from seeded streams, so a run that resumed with fresh global generators
still matched — the end-to-end resume tests could not tell. Here the online run's reward draws from all three global
generators, so its advantages after the resume are the uninterrupted run's only if every state is restored; the
preference run resumes in the middle of a data epoch, so its batches are the uninterrupted run's only if the sampler
resumes at the right batch. Run A goes straight to the end; run B starts from a copy of A's intermediate checkpoint
and must end with A's weights and optimizer bit for bit.
"""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import torch
from conftest import ONLINE_CASES, compose_cfg, online_overrides, smoke_overrides
from safetensors.torch import load_file

from diffalign.config import registry
from diffalign.rewards import python_function

SPEC = "python:test_resume_rng:brightness_plus_rng_draws"


def brightness_plus_rng_draws(images, prompts, metadata=None):
    """Mean brightness plus one draw per image from each global generator: `random`, `numpy.random`, `torch`."""
    n = images.shape[0]
    draws = (torch.tensor([random.random() for _ in range(n)]) + torch.from_numpy(np.random.rand(n)).float()
             + torch.rand(n))
    return images.float().flatten(1).mean(1).cpu() + draws


def same_files(a, b, names) -> bool:
    for name in names:
        x, y = load_file(a / name), load_file(b / name)
        if set(x) != set(y) or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def test_online_resume_restores_the_python_numpy_and_torch_generators(tmp_path):
    from diffalign.train.online import train

    registry.register_configs()
    name = python_function.register_python_reward(SPEC)

    def cfg(run):
        return compose_cfg(ONLINE_CASES["flow_grpo_sd"] + online_overrides(tmp_path / run, epochs=2)
                           + [f"reward=[{SPEC}]"] + (["resume=latest"] if run == "b" else []))

    assert name in cfg("a").reward
    full = train(cfg("a"))
    first = json.loads((tmp_path / "a" / "history.jsonl").read_text().splitlines()[0])["step"]  # after epoch 1
    shutil.copytree(tmp_path / "a" / f"checkpoint-{first}", tmp_path / "b" / f"checkpoint-{first}")
    resumed = train(cfg("b"))
    step = full["global_step"]
    assert resumed["global_step"] == step > first
    rewards = {run: [json.loads(line)["reward/mean"] for line in (tmp_path / run / "history.jsonl").read_text()
                     .splitlines()] for run in ("a", "b")}
    assert rewards["a"][-1] == rewards["b"][-1], rewards  # the resumed epoch drew what the uninterrupted one drew
    assert same_files(tmp_path / "a" / f"checkpoint-{step}", tmp_path / "b" / f"checkpoint-{step}",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors"]), rewards


def test_preference_resume_mid_epoch_continues_the_data_order(tmp_path):
    from diffalign.train.preference import train

    def cfg(run):  # 16 pairs in batches of 2: 8 batches per data epoch, resumed after batch 2
        return compose_cfg(smoke_overrides(tmp_path / run, steps=4) + ["method=diffusion_dpo"]
                           + (["resume=latest"] if run == "b" else []))

    train(cfg("a"))
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    state = json.loads((tmp_path / "b" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["sampler"]["position"] == 2 and state["sampler"]["epoch"] == 0
    assert train(cfg("b"))["global_step"] == 4
    assert same_files(tmp_path / "a" / "checkpoint-4", tmp_path / "b" / "checkpoint-4",
                      ["pytorch_lora_weights.safetensors", "optimizer.safetensors"])
