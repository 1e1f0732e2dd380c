"""experiments/probes.py: the one-epoch set-up shared by scripts/probe_one_step.py and
experiments/gradient_consistency.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import ONLINE_CASES, compose_cfg, online_overrides

from diffalign.train.online import train

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))  # experiments/probes.py
from probes import (
    build_probe_setup,
    compose_run_config,
    epoch_gradient,
    epoch_prompt_rows,
    sample_epoch,
)


def test_the_online_draw_samples_and_scores_what_the_loop_samples(tmp_path):
    overrides = ONLINE_CASES["flow_grpo_flow"] + online_overrides(tmp_path / "run", epochs=1)
    train(compose_cfg(overrides))
    logged = json.loads((tmp_path / "run" / "history.jsonl").read_text().splitlines()[0])
    setup = build_probe_setup(compose_run_config(overrides, str(tmp_path / "probe")))
    traj, group_ids, scores, rows = sample_epoch(setup, 0, draw="online")
    assert len(scores) == 8 and group_ids.tolist() == [0] * 4 + [1] * 4
    # the loop's epoch 0, at the same (initial) weights: the same prompts, noise and so the same reward
    assert float(scores.mean()) == pytest.approx(logged["reward/geneval_shapes/mean"], abs=1e-6)
    assert [r["prompt"] for r in rows] == [traj.prompts[0], traj.prompts[4]]
    with pytest.raises(ValueError, match="draw"):
        epoch_prompt_rows(setup, 0, draw="loop")


def test_the_gradient_is_the_policy_gradient_linear_in_the_advantages(tmp_path):
    # at θ = θ_old the clipped surrogate's gradient is −mean(A ∇log π) (ratio 1, inside the clip), so with no KL term
    # it is linear in A: A → −2A gives −2 × the gradient, and A = 0 gives exactly 0. A gradient accumulated across
    # calls (no zeroing) would give −1 × instead of −2 ×.
    overrides = ONLINE_CASES["flow_grpo_flow"] + online_overrides(tmp_path, epochs=1) + ["method.beta_kl=0"]
    setup = build_probe_setup(compose_run_config(overrides, str(tmp_path)))
    traj, _, _, _ = sample_epoch(setup, 0)
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75, 2.0, -1.0, 0.5, -1.5])
    g = epoch_gradient(setup, traj, advantages)
    flat = torch.cat([x.flatten() for x in g["grads"]])
    assert flat.norm() > 0 and g["steps"] == list(range(len(g["steps"])))  # flow_grpo: the first transitions
    flipped = torch.cat([x.flatten() for x in epoch_gradient(setup, traj, -2 * advantages)["grads"]])
    torch.testing.assert_close(flipped, -2 * flat, rtol=1e-4, atol=1e-7)
    zero = torch.cat([x.flatten() for x in epoch_gradient(setup, traj, torch.zeros(8))["grads"]])
    assert zero.abs().max() == 0


def test_methods_without_a_per_transition_loss_are_refused(tmp_path):
    overrides = ONLINE_CASES["dgpo_flow"] + online_overrides(tmp_path)
    with pytest.raises(ValueError, match="policy-gradient"):
        build_probe_setup(compose_run_config(overrides, str(tmp_path)))


def test_bad_overrides_are_one_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"online\.nosuch"):
        compose_run_config(["recipe=tiny_flow_grpo", "online.nosuch=3"], str(tmp_path))
    with pytest.raises(ValueError, match="unknown reward"):
        compose_run_config(["recipe=tiny_flow_grpo", "reward=[nosuch]"], str(tmp_path))
