"""The train/rollout consistency alarm of the policy-gradient methods (issue 19 item 6) and the online loop's gradient
accumulation (issue 19 item 2).

Before the first update of an epoch the policy is the one that sampled the epoch, so the log-probs the training
forward recomputes must equal the stored ones up to float noise. A rollout whose stored guidance scale differs from
the one it sampled with (here: the stored value is shifted after the rollout, so the training forward guides with
another scale, as a bug in a sampler or plugin would) must stop the run, naming the likely causes; the same run
without the shift must not."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from conftest import ONLINE_CASES, compose_cfg, online_overrides
from safetensors.torch import load_file

from diffalign.objectives.policy_gradient import CAUSES, LOGPROB_TOLERANCE
from diffalign.runtime.faults import RolloutMismatchError
from diffalign.train import online

CASES = {"flow_grpo_flow": ONLINE_CASES["flow_grpo_flow"], "ddpo_sd": ONLINE_CASES["ddpo_sd"],
         "vipo_flow": ["model=tiny_flow_random", "method=vipo", "sampler=flow_sde", "method.map=ones",
                       "online.shared_initial_noise=true"]}


@pytest.fixture(autouse=True)
def _release_locks(release_run_locks):
    """Every test here releases the run locks it took (`conftest.release_run_locks`)."""


def _shift_stored_guidance(monkeypatch, shift: float) -> None:
    """Rollouts sample as configured but store a guidance scale off by `shift`, so training recomputes with it."""
    rollout = online.group_rollout

    def shifted(*args, **kwargs):
        trajectory, group_ids = rollout(*args, **kwargs)
        trajectory.guidance_scale += shift
        return trajectory, group_ids

    monkeypatch.setattr(online, "group_rollout", shifted)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_guidance_scale_that_differs_between_rollout_and_training_stops_the_run(case, tmp_path, monkeypatch):
    _shift_stored_guidance(monkeypatch, 0.5)
    cfg = compose_cfg(CASES[case] + online_overrides(tmp_path))
    with pytest.raises(RolloutMismatchError) as stopped:
        online.train(cfg)
    message = str(stopped.value)
    assert "before the first update of epoch 0" in message
    assert f"> method.logprob_tolerance={LOGPROB_TOLERANCE:g}" in message
    for cause in ("guidance scale", "sampler.eta", "trainer.mixed_precision", "order of the latents", "timestep"):
        assert cause in message and cause in CAUSES
    assert "method.logprob_check=warn" in message
    assert not list(tmp_path.glob("checkpoint-*"))  # stopped before the first optimizer step


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_normal_run_stays_far_below_the_tolerance(case, tmp_path, monkeypatch):
    """Without the shift the recomputed log-probs equal the stored ones to float noise: the run passes with a
    tolerance 100 times tighter than the default (measured: at most 1.4e-6 in the tiny world on CPU)."""
    from diffalign.objectives import policy_gradient

    seen = []

    original = policy_gradient.StoredTransitionMethod.check_logprobs

    def recorded(self, new, old, k):
        if self._checking:
            seen.append(float((new.detach() - old).abs().max()))
        return original(self, new, old, k)

    monkeypatch.setattr(policy_gradient.StoredTransitionMethod, "check_logprobs", recorded)
    tight = f"method.logprob_tolerance={LOGPROB_TOLERANCE / 100}"
    cfg = compose_cfg(CASES[case] + online_overrides(tmp_path) + [tight])
    online.train(cfg)
    assert seen and max(seen) <= LOGPROB_TOLERANCE / 100


def test_warn_mode_trains_on_and_says_so_once_per_epoch(tmp_path, monkeypatch, caplog):
    """One warning per epoch, in the epoch's summary of repeating warnings (diffalign.runtime.console)."""
    _shift_stored_guidance(monkeypatch, 0.5)
    cfg = compose_cfg(CASES["flow_grpo_flow"] + online_overrides(tmp_path) + ["method.logprob_check=warn"])
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.policy_gradient"):
        results = online.train(cfg)
    said = [r.getMessage() for r in caplog.records if "the log-probs recomputed" in r.getMessage()]
    assert len(said) == 2
    for epoch, message in enumerate(said):
        assert message.startswith(f"epoch {epoch}: 1 epoch(s) trained on anyway (method.logprob_check=warn): the "
                                  f"log-probs recomputed for training differ")
        assert f"before the first update of epoch {epoch}:" in message
    assert results["warnings"]["logprob_mismatch"]["count"] == 2
    assert (tmp_path / "checkpoint-2").is_dir()


def test_the_cli_prints_the_alarm_without_a_traceback(tmp_path, monkeypatch):
    from diffalign import cli

    _shift_stored_guidance(monkeypatch, 0.5)
    monkeypatch.setattr(sys, "argv", ["diffalign-train", *CASES["flow_grpo_flow"], *online_overrides(tmp_path),
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    with pytest.raises(SystemExit) as stopped:
        cli.train()
    assert str(stopped.value.code).startswith("diffalign: error: the log-probs recomputed for training differ")
    from diffalign.runtime.runlock import undo_run_start
    assert undo_run_start() == []  # the run has ended: nothing of it is left for a later run in this process to undo


def test_the_alarm_settings_are_checked_before_any_model_loads(tmp_path):
    from diffalign.config.validation import construct, validate_train_config

    for bad, match in (("method.logprob_check=maybe", "method.logprob_check='maybe' must be one of"),
                       ("method.logprob_tolerance=0", "method.logprob_tolerance=0.0 must be > 0")):
        cfg = compose_cfg(CASES["ddpo_sd"] + online_overrides(tmp_path) + [bad])
        with pytest.raises(ValueError, match=match):  # the config checks, then the method's constructor (build_run's
            validate_train_config(cfg)                # first step, before any model loads)
            construct(cfg.method, "method")


# -------------------------------------------------------------------------------- gradient accumulation per update


def test_one_process_accumulating_two_micro_batches_takes_the_full_batch_gradient(tmp_path):
    """An update of the online loop over 2 micro-batches of 4 rows (trainer.batch_size=4) equals one over the full
    batch of 8 (trainer.batch_size=8): each micro-batch's mean loss is divided by the number of micro-batches, so the
    accumulated gradient is the full batch's mean. With Adam's epsilon 1 the first step is −lr·g/(|g| + 1) element
    by element, so equal LoRAs after one update mean equal gradients (a sum instead of the mean would double g)."""
    base = CASES["flow_grpo_flow"] + online_overrides(tmp_path, epochs=1) + [
        "trainer.optimizer.eps=1", "trainer.optimizer.lr=10", "trainer.max_grad_norm=null", "method.beta_kl=0",
        "method.clip_range=1e6", "online.checkpointing_epochs=null", "reward=[jpeg_compressibility]"]
    loras = {}
    for batch in (8, 4):
        out = tmp_path / f"batch{batch}"
        online.train(compose_cfg(base + [f"output_dir={out}", f"trainer.batch_size={batch}"]))
        loras[batch] = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    moved = max(float(v.abs().max()) for k, v in loras[8].items() if "lora_B" in k)  # (B starts at zero)
    assert moved > 1e-3
    for key, full in loras[8].items():
        torch.testing.assert_close(loras[4][key], full, rtol=0, atol=1e-5)
