"""Both loops step the reference the same way (`diffalign.train.common.Updates`): ``reference.on_step(policy, n)``
before every optimizer update, with n = the updates already done (0 before the first), and a resumed run continues
that sequence exactly: no call repeated, none skipped, each one seeing the same policy weights as in the run that
was never stopped."""

from __future__ import annotations

import hashlib
import shutil
from typing import ClassVar

import pytest
import torch
from conftest import compose_cfg, online_overrides, smoke_overrides

from diffalign.reference.frozen_base import FrozenBaseReference

RECORDING = f"{__name__}.RecordingReference"


class RecordingReference(FrozenBaseReference):
    """The frozen base, recording every `on_step` call as (n, digest of the policy's trainable weights at the call)."""

    calls: ClassVar[list[tuple[int, str]]] = []

    def on_step(self, policy, global_step: int) -> bool:
        digest = hashlib.sha256()
        for param in policy.trainable_parameters():
            digest.update(param.detach().float().cpu().numpy().tobytes())
        RecordingReference.calls.append((global_step, digest.hexdigest()))
        return super().on_step(policy, global_step)


def record(train, overrides: list[str]) -> list[tuple[int, str]]:
    RecordingReference.calls = []
    train(compose_cfg(overrides + [f"reference._target_={RECORDING}"]))
    return list(RecordingReference.calls)


def initial_digest() -> str:
    """The digest the first call must see: the fresh LoRA (tiny random model, the recorded runs' `model`)."""
    from diffalign.models.tiny_random import build_tiny_random_policy

    torch.manual_seed(0)
    digest = hashlib.sha256()
    for param in build_tiny_random_policy(seed=0).trainable_parameters():
        digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()


def test_preference_loop_steps_the_reference_before_every_update_and_resumes_the_sequence(tmp_path):
    from diffalign.train.preference import train

    def overrides(run: str, steps: int) -> list[str]:
        return smoke_overrides(tmp_path / run, steps=steps) + ["trainer.lr_scheduler=constant_with_warmup"]

    full = record(train, overrides("full", 4))
    assert [n for n, _ in full] == [0, 1, 2, 3]  # before each of the 4 updates, none after the last
    assert len({d for _, d in full}) == 4  # every call saw the policy after one more update
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")  # stopped after 2
    resumed = record(train, overrides("resumed", 4) + ["resume=latest"])
    assert resumed == full[2:]  # n = 2, 3 with the same weights as the uninterrupted run


def test_online_loop_steps_the_reference_before_every_update_and_resumes_the_sequence(tmp_path):
    from diffalign.train.online import train

    case = ["model=tiny_random", "method=flow_grpo", "sampler=ddim", "online.updates_per_epoch=2"]
    full = record(train, case + online_overrides(tmp_path / "full", epochs=3))
    assert [n for n, _ in full] == [0, 1, 2, 3, 4, 5]  # 3 epochs × 2 updates, before each update
    assert full[0][1] == initial_digest()  # n = 0: before the first update, the untouched LoRA
    assert len({d for _, d in full}) == 6
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")  # after epoch 1
    resumed = record(train, case + online_overrides(tmp_path / "resumed", epochs=3) + ["resume=latest"])
    assert resumed == full[2:]


@pytest.mark.parametrize("strategy", ["ema", "pool"])
def test_a_stepped_reference_is_ready_for_the_first_online_update(strategy, tmp_path):
    """θ_0 is in the pool before update 0 (the pool raises if used before any `on_step`), and the EMA reference's
    first step follows the first update."""
    from diffalign.train.online import train

    extra = ["reference.save_every=2", "reference.keep=2"] if strategy == "pool" else ["reference.decay=0.5"]
    train(compose_cfg(["model=tiny_random", "method=dgpo", "sampler=dpm_ode", "method.timestep_max_index=2",
                       "method.timesteps_per_epoch=2", f"reference={strategy}", *extra]
                      + online_overrides(tmp_path, epochs=2)))
    assert (tmp_path / "final" / "pytorch_lora_weights.safetensors").is_file()
