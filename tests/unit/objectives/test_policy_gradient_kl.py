"""The rest of `ClippedPolicyGradient` (issue 35: survivors of ``python scripts/mutation.py objectives/policy_gradient``):
the KL term to the reference, its two forms, the metrics, `loss` on a unit and the train/rollout consistency alarm.

The KL term follows the released Flow-GRPO code (``flow_grpo/scripts/train_sd3.py``): ``kl = ((mean − mean_ref) ** 2)
.mean(dim=(1, 2, 3)) / (2 · std_dev_t ** 2)``, then its batch mean, where for the flow SDE ``std_dev_t`` is the noise
scale before the √Δσ factor, so the step std s gives std_dev_t = s / √(σ_k − σ_{k+1}) (``kl_form="code"``) and
``kl_form="exact"`` keeps s (docs/methods/algorithms.md#flow-grpo). The expected values below are computed from the
step outputs of θ and of the frozen base by that formula; the PPO part is −mean A at ratio 1 (fresh rollouts).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import step_sampler
from test_clip_binding import PROMPTS, K, policy_for, with_ratios

from diffalign.objectives.policy_gradient import ClippedPolicyGradient, TransitionUnit
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.runtime.faults import RolloutMismatchError
from diffalign.samplers.rollout import recompute_step, rollout

BETA_KL = 0.3


def fresh_rollout(policy, eta, sde_type=None):
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    sampler = step_sampler(policy, num_inference_steps=3, guidance_scale=4.5, noise=eta, sde_type=sde_type)
    return rollout(policy, PROMPTS[:4], sampler, generator=gens)


def released_kl(policy, traj, form: str) -> torch.Tensor:
    """mean_i mean_elements (μθ − μref)² / (2 std²), std per `form` (see the module docstring)."""
    with torch.no_grad():
        now = recompute_step(policy, traj, K)
        with policy.reference():
            ref = recompute_step(policy, traj, K)
    std = torch.as_tensor(now.std).float().reshape(-1)
    if form == "code" and traj.sampler in ("flow_sde", "dance_sde"):
        std = std / (traj.sigmas[K] - traj.sigmas[K + 1]).sqrt()
    squared = (now.mean - ref.mean).pow(2).flatten(1).mean(1)
    return (squared / (2 * std**2)).mean()


@pytest.mark.parametrize("family", ["ddim", "flow"])
@pytest.mark.parametrize("form", ["code", "exact"])
def test_kl_term_to_the_frozen_base(family, form):
    policy, eta = policy_for(family)
    traj = fresh_rollout(policy, eta)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.5])
    objective = ClippedPolicyGradient(clip_range=0.2, beta_kl=BETA_KL, kl_form=form)
    loss, metrics = objective(policy, traj, adv, K, reference=FrozenBaseReference())
    kl = released_kl(policy, traj, form)
    assert kl > 0  # (θ ≠ the base: the LoRA weights are not zero)
    torch.testing.assert_close(metrics["kl"], kl, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(loss, -adv.mean() + BETA_KL * kl, rtol=1e-4, atol=1e-6)
    assert set(metrics) == {"loss", "ratio", "clipfrac", "approx_kl", "kl"}
    torch.testing.assert_close(metrics["loss"], loss.detach())


def test_code_and_exact_kl_differ_by_the_sigma_step_on_flow_only():
    """Both flow SDEs (Flow-GRPO's and DanceGRPO's) take the code form's √Δσ; DDIM has no σ step."""
    for family, kwargs in (("ddim", {}), ("flow", {}), ("flow", {"sde_type": "dance"})):
        policy, eta = policy_for(family)
        traj = fresh_rollout(policy, eta, **kwargs)
        kls = {form: ClippedPolicyGradient(beta_kl=BETA_KL, kl_form=form)(
            policy, traj, torch.zeros(4), K, reference=FrozenBaseReference())[1]["kl"] for form in ("code", "exact")}
        factor = float(traj.sigmas[K] - traj.sigmas[K + 1]) if family == "flow" else 1.0
        assert factor != 1.0 or family == "ddim"
        torch.testing.assert_close(kls["code"], kls["exact"] * factor, rtol=1e-4, atol=1e-10)


def test_kl_without_a_reference_is_refused_and_no_kl_without_beta():
    policy, eta = policy_for("ddim")
    traj = fresh_rollout(policy, eta)
    with pytest.raises(ValueError, match=r"^method\.beta_kl > 0 needs a reference; the loop passed none\.$"):
        ClippedPolicyGradient(beta_kl=0.1)(policy, traj, torch.ones(4), K)
    loss, metrics = ClippedPolicyGradient(beta_kl=0.0)(policy, traj, torch.ones(4), K)
    assert float(metrics["kl"]) == 0.0
    torch.testing.assert_close(loss, torch.tensor(-1.0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["ddim", "flow"])
def test_approx_kl_and_loss_on_a_unit(family):
    """approx_kl = mean ½ (Δ log π)² = mean ½ log(ρ)²; `loss` of a unit is its weight times the objective on its rows."""
    policy, eta = policy_for(family)
    ratios = torch.tensor([1.5, 0.5, 1.5, 0.5])
    traj = with_ratios(policy, eta, ratios, "mean")
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    objective = ClippedPolicyGradient(clip_range=0.2)
    _, metrics = objective(policy, traj, adv, K)
    torch.testing.assert_close(metrics["approx_kl"], (0.5 * ratios.log() ** 2).mean(), rtol=1e-4, atol=1e-6)
    epoch = SimpleNamespace(trajectory=traj, advantages=adv)
    rows = torch.tensor([3, 0])
    loss, _ = objective.loss(policy, TransitionUnit(epoch, rows, K, weight=0.5), reference=None)
    # rows 3 (A = −1, ρ = 0.5: clipped, 0.8) and 0 (A = 2, ρ = 1.5: clipped, −2.4): 0.5 · (0.8 − 2.4) / 2
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.8 - 2.4) / 2), rtol=1e-4, atol=1e-5)
    # with a KL term the unit's reference reaches the objective: 0.5 · (the PPO part + β_KL · KL of those rows)
    with_kl = ClippedPolicyGradient(clip_range=0.2, beta_kl=BETA_KL)
    loss, metrics = with_kl.loss(policy, TransitionUnit(epoch, rows, K, weight=0.5), reference=FrozenBaseReference())
    kl = released_kl(policy, traj.index(rows), "code")
    torch.testing.assert_close(loss, 0.5 * (torch.tensor((0.8 - 2.4) / 2) + BETA_KL * kl), rtol=1e-4, atol=1e-5)


def test_the_consistency_alarm_checks_the_trained_log_probs():
    """During an epoch's first update a stored log-prob off by log 1.5 (> the 1e-3 tolerance) stops the run, naming
    the transition."""
    policy, eta = policy_for("ddim")
    traj = with_ratios(policy, eta, torch.tensor([1.5, 1.0, 1.0, 1.0]), "mean")
    objective = ClippedPolicyGradient(logprob_check="stop")
    updates = objective.checked_updates(SimpleNamespace(epoch=4), iter([["update 0"], ["update 1"]]))
    next(updates)
    with pytest.raises(RolloutMismatchError, match=r"epoch 4 \(transition 1\): max \|Δ log π\| = 0\.405 > "
                       r"method\.logprob_tolerance=0\.001"):
        objective(policy, traj, torch.ones(4), K)


@pytest.mark.parametrize("form, factor", [("exact", 1.0), ("code", 0.25)])
def test_kl_with_per_row_step_stds_by_hand(monkeypatch, form, factor):
    """A `(B, 1)` step std with one s_i per row (what per-sample sigmas give) enters the KL row by row, as in the
    released Flow-GRPO code: mean_i mean_j (μθ − μref)²_ij / (2 s_i²). Rows: Δμ = (0.1, 0.3), (0.2, 0.2), (1, 0) and
    s = 0.5, 0.25, 1 give 0.05 / 0.5 = 0.1, 0.04 / 0.125 = 0.32, 0.5 / 2 = 0.25, so KL = 0.67 / 3. The code form divides
    s by √Δσ = √(1 − 0.75) = 0.5, which multiplies the KL by Δσ = 0.25 (a batch mean of Δμ² over one std would give
    0.688)."""
    from diffalign.objectives import policy_gradient

    mean = torch.tensor([[0.1, 0.3], [0.2, 0.2], [1.0, 0.0]])
    monkeypatch.setattr(policy_gradient, "recompute_step",
                        lambda policy, trajectory, k: SimpleNamespace(mean=torch.zeros(3, 2)))  # μ_ref = 0
    step = SimpleNamespace(mean=mean, std=torch.tensor([[0.5], [0.25], [1.0]]), log_prob=torch.zeros(3))
    traj = SimpleNamespace(log_probs=torch.zeros(3, 1), sampler="flow_sde", sigmas=torch.tensor([1.0, 0.75]))
    reference = SimpleNamespace(use=lambda policy: contextlib.nullcontext(policy))
    adv = torch.tensor([1.0, -2.0, 4.0])
    objective = ClippedPolicyGradient(clip_range=0.2, beta_kl=BETA_KL, kl_form=form)
    loss, metrics = objective.clipped_loss(None, traj, adv, 0, step, torch.zeros(3), reference=reference)
    kl = torch.tensor(0.67 / 3 * factor)
    torch.testing.assert_close(metrics["kl"], kl, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(loss, -adv.mean() + BETA_KL * kl, rtol=1e-5, atol=1e-7)
