"""`GRPOGuard`'s wiring, model-free: its config reaching the objective, `prepare` storing μ_old of exactly the trained
transitions in micro-batches, `loss` reading the unit's rows, and the refusals (found by mutation testing,
docs/contributing.md#mutation-testing: only the online-loop tests ran `prepare` and `loss`).

The policy is replaced by a step whose mean is linear in x_k (μ = a x_k + k), so that μ_old, μ_θ, the stored
log-probs and ε = (x_{k+1} − μ_old)/s are known by hand; the loss is then the paper's (arXiv:2510.22319 eqs. 8, 12)
δ_k mean_i(−A_i ρ̂_i) with log ρ̂_i = mean(ε_i Δμ_i) and δ_k = 1/(σ_k − σ_{k+1}) (no clipping: clip_range 1e6)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import compose_cfg, online_overrides

from diffalign.methods import OnlineEpoch
from diffalign.objectives import grpo_guard, policy_gradient
from diffalign.objectives.flow_grpo import FlowGRPOConfig
from diffalign.objectives.grpo_guard import GRPOGuard, GRPOGuardConfig, grad_weight
from diffalign.objectives.policy_gradient import TransitionUnit
from diffalign.samplers.flow_sde import FlowStepOutput
from diffalign.types import PromptEmbeds, Trajectory

B, K, S = 5, 3, 0.4
SIGMAS = torch.tensor([1.0, 0.8, 0.5, 0.0])
TRAINABLE = [True, False, True]


@pytest.fixture(autouse=True)
def _release_locks(release_run_locks):
    """Every test here releases the run locks it took (`conftest.release_run_locks`)."""


def _mean_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    d = (x - mean).reshape(len(x), -1)
    return (-(d ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)


class LinearStep:
    """`recompute_step` stand-in: μ = a · x_k + k, the log-prob of the stored x_{k+1} under N(μ, S²); records calls."""

    def __init__(self, a: float):
        self.a, self.calls = a, []

    def __call__(self, policy, trajectory, k, **kwargs):
        self.calls.append((trajectory.latents[:, 0, 0].tolist(), k))
        mean = self.a * trajectory.latents[:, k] + k
        x_next = trajectory.latents[:, k + 1]
        return FlowStepOutput(prev_sample=x_next, mean=mean, std=torch.tensor(S), log_prob=_mean_log_prob(x_next,
                                                                                                          mean, S))


def _epoch(batch_size: int, sampler: str = "flow_sde") -> OnlineEpoch:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(B, K + 1, 6, generator=g)
    latents[:, 0, 0] = torch.arange(B, dtype=torch.float32)  # row ids, read back by LinearStep's record
    log_probs = torch.stack([_mean_log_prob(latents[:, k + 1], 2.0 * latents[:, k] + k, S) if TRAINABLE[k]
                             else torch.zeros(B) for k in range(K)], dim=1)
    traj = Trajectory(latents=latents, timesteps=SIGMAS[:K] * 1000, log_probs=log_probs,
                      trainable=torch.tensor(TRAINABLE), prompt_embeds=PromptEmbeds(torch.zeros(B, 2, 3)), images=None, prompts=[""] * B,
                      guidance_scale=4.5, noise=0.7, sigmas=SIGMAS, sampler=sampler)
    return OnlineEpoch(traj, torch.tensor([1.0, -0.5, 2.0, -1.5, 0.25]), torch.arange(B) // 5, 5, torch.ones(1),
                       seed=0, epoch=0, batch_size=batch_size, updates=1, inner_epochs=1, num_processes=1,
                       split="groups", note=lambda message: None)


FIELDS = ("clip_range", "beta_kl", "kl_form", "detach_unconditional", "timestep_fraction", "timestep_selection",
          "logprob_check", "logprob_tolerance")


def test_the_defaults_are_flow_grpos_and_every_field_reaches_the_objective():
    method = GRPOGuard()
    assert {f: getattr(method, f) for f in FIELDS} == {f: getattr(FlowGRPOConfig(), f) for f in FIELDS}
    assert (method.ratio_norm, method.grad_reweight, method.advantage, method._old_means) == (True, "inverse_dt",
                                                                                              "group", None)
    changed = GRPOGuardConfig(clip_range=0.2, beta_kl=0.5, kl_form="exact", detach_unconditional=False,
                              timestep_fraction=0.5, timestep_selection="random", logprob_check="warn",
                              logprob_tolerance=0.25, ratio_norm=False, grad_reweight="none")
    for built in (GRPOGuard(changed), GRPOGuard(**{f: getattr(changed, f) for f in (*FIELDS, "ratio_norm",
                                                                                     "grad_reweight")})):
        assert {f: getattr(built, f) for f in FIELDS} == {f: getattr(changed, f) for f in FIELDS}
        assert (built.ratio_norm, built.grad_reweight) == (False, "none")
    assert GRPOGuard(ratio_norm=0).ratio_norm is False  # stored as a bool
    with pytest.raises(ValueError, match=r"^method.grad_reweight='sqrt' must be one of \('inverse_dt', 'none'\)\.$"):
        GRPOGuard(grad_reweight="sqrt")


def test_grad_weight_refuses_a_schedule_that_does_not_decrease():
    assert grad_weight(torch.tensor([1.0, 0.5, 0.5]), 0) == 2.0
    for sigmas in (torch.tensor([1.0, 0.5, 0.5]), torch.tensor([1.0, 0.5, 0.6])):
        with pytest.raises(ValueError, match=r"^transition 1 has Δt = σ_k − σ_k\+1 = -?0\.?1? ≤ 0; the flow schedule "
                                             r"must decrease\.$"):
            grad_weight(sigmas, 1)
    assert grad_weight(torch.tensor([1.0, 0.5, 0.5]), 1, "none") == 1.0  # no Δt needed
    with pytest.raises(ValueError, match=r"^method.grad_reweight='sqrt' must be one of \('inverse_dt', 'none'\)\.$"):
        grad_weight(SIGMAS, 0, "sqrt")


@pytest.mark.parametrize("batch_size", [1, 2, 0])
def test_prepare_stores_the_old_means_of_the_trained_transitions_in_micro_batches(monkeypatch, batch_size):
    step = LinearStep(2.0)
    monkeypatch.setattr(grpo_guard, "recompute_step", step)
    epoch = _epoch(batch_size)
    method = GRPOGuard(beta_kl=0.0)
    assert method.prepare(None, epoch) == {}
    chunk = max(1, batch_size)
    rows = [list(map(float, range(b, min(b + chunk, B)))) for b in range(0, B, chunk)]
    assert step.calls == [(r, k) for r in rows for k in (0, 2)]  # the trainable transitions only, row order kept
    latents = epoch.trajectory.latents
    expected = torch.zeros(B, K, 6)
    for k in (0, 2):
        expected[:, k] = 2.0 * latents[:, k] + k
    assert torch.equal(method._old_means, expected)


def test_prepare_without_ratio_norm_stores_nothing_and_refuses_other_samplers(monkeypatch):
    step = LinearStep(2.0)
    monkeypatch.setattr(grpo_guard, "recompute_step", step)
    method = GRPOGuard(beta_kl=0.0, ratio_norm=False)
    method._old_means = torch.ones(1)  # a previous epoch's
    assert method.prepare(None, _epoch(2, "window_sde")) == {} and method._old_means is None and step.calls == []
    with pytest.raises(ValueError, match=r"^method=grpo_guard needs Flow-GRPO SDE rollouts; the trajectory's sampler "
                                         r"is 'cps_sde'\. Use sampler=flow_sde \(or window_sde\)$"):
        GRPOGuard(beta_kl=0.0).prepare(None, _epoch(2, "cps_sde"))


@pytest.mark.parametrize("ratio_norm", [True, False])
def test_loss_uses_the_units_rows_their_stored_old_means_and_its_weight(monkeypatch, ratio_norm):
    monkeypatch.setattr(grpo_guard, "recompute_step", LinearStep(2.0))
    epoch = _epoch(2)
    method = GRPOGuard(clip_range=1e6, beta_kl=0.0, ratio_norm=ratio_norm)
    method.prepare(None, epoch)
    monkeypatch.setattr(grpo_guard, "recompute_step", LinearStep(2.1))  # θ has moved: μ_θ = 2.1 x_k + k
    rows, k = torch.tensor([3, 1]), 2
    loss, metrics = method.loss(None, TransitionUnit(epoch, rows, k, weight=1.5), reference=None)

    x_k, x_next = epoch.trajectory.latents[rows, k], epoch.trajectory.latents[rows, k + 1]
    mu_old, mu_new = 2.0 * x_k + k, 2.1 * x_k + k
    eps = (x_next - mu_old) / S
    if ratio_norm:
        log_rho = (eps * (mu_new - mu_old)).mean(dim=1)  # paper eq. 8: mean(ε Δμ)
    else:
        log_rho = _mean_log_prob(x_next, mu_new, S) - _mean_log_prob(x_next, mu_old, S)
    adv = epoch.advantages[rows]
    delta = 1 / (0.5 - 0.0)  # paper eq. 12: 1/Δt_k
    torch.testing.assert_close(loss, 1.5 * delta * (-adv * log_rho.exp()).mean(), rtol=1e-5, atol=1e-7)
    raw = _mean_log_prob(x_next, mu_new, S) - _mean_log_prob(x_next, mu_old, S)
    assert float(metrics["ratio_raw"]) == pytest.approx(float(raw.exp().mean()), rel=1e-5)
    bias = ((mu_new - mu_old) ** 2).mean(dim=1) / (2 * S ** 2) if ratio_norm else torch.zeros(2)
    assert float(metrics["ratio_bias"]) == pytest.approx(float(bias.mean()), rel=1e-5, abs=1e-12)
    assert float(metrics["grad_weight"]) == pytest.approx(delta)


@pytest.mark.parametrize("sampler", ["flow_sde", "window_sde"])
def test_the_flow_grpo_sde_samplers_are_accepted(tmp_path, sampler):
    cfg = compose_cfg(["recipe=tiny_grpo_guard", *online_overrides(tmp_path), f"sampler={sampler}"])
    GRPOGuard.check_config(cfg)


def test_another_sampler_is_refused_with_the_whole_message(tmp_path):
    cfg = compose_cfg(["recipe=tiny_grpo_guard", *online_overrides(tmp_path), "sampler=cps_sde"])
    with pytest.raises(ValueError, match=r"^method=grpo_guard reweights the Flow-GRPO SDE's steps, but sampler\.name="
                                         r"'cps_sde'\. Use sampler=flow_sde \(or window_sde\) with a flow model "
                                         r"\(model=tiny_sd3, sd35_medium, flux1_dev, wan21_t2v\)$"):
        GRPOGuard.check_config(cfg)


# ------------------------------------------------------------------ the policy, the reference and the alarm (mutation)


class Policy:
    """A stand-in policy whose step mean is μ = a · x_k + k; the reference swaps its `a` (`Reference.use`)."""

    def __init__(self, a: float):
        self.a = a


class Reference:
    """θ_ref: `use(policy)` sets the policy's slope to `a` for the block and records the policy it was given."""

    def __init__(self, a: float):
        self.a, self.used = a, []

    def use(self, policy):
        import contextlib

        @contextlib.contextmanager
        def swapped():
            self.used.append(policy)
            saved, policy.a = policy.a, self.a
            try:
                yield policy
            finally:
                policy.a = saved
        return swapped()


class PolicyStep:
    """`recompute_step` stand-in reading the slope of the policy it is given, with a per-row std (row ids are held in
    ``latents[:, 0, 0]``); records (policy, k, keyword arguments)."""

    def __init__(self, stds: torch.Tensor):
        self.stds, self.calls = stds, []

    def __call__(self, policy, trajectory, k, **kwargs):
        self.calls.append((policy, k, kwargs))
        rows = trajectory.latents[:, 0, 0].long()
        std = self.stds[rows].reshape(-1, 1)
        mean = policy.a * trajectory.latents[:, k] + k
        x_next = trajectory.latents[:, k + 1]
        d = (x_next - mean) / std
        log_prob = (-(d ** 2) / 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)
        return FlowStepOutput(prev_sample=x_next, mean=mean, std=std, log_prob=log_prob)


def test_loss_with_per_sample_stds_and_the_kl_to_the_reference_by_hand(monkeypatch):
    """Per-row step stds s_i (a `(B, 1)` std, as per-sample sigmas give): log ρ̂_i = mean(ε_i Δμ_i) (paper eq. 8),
    ``ratio_bias`` = mean_i mean(Δμ_i²) / (2 s_i²); the KL term is Flow-GRPO's released ``kl_form="code"``:
    mean_i mean((μ_θ − μ_ref)²) / (2 σ_i²) with σ_i = s_i / √Δt_k. The policy and the reference reach every forward,
    and the objective's ``detach_unconditional`` reaches the policy's (not μ_old's)."""
    stds = torch.tensor([0.4, 0.25, 0.5, 0.3, 0.6])
    step = PolicyStep(stds)
    monkeypatch.setattr(grpo_guard, "recompute_step", step)
    monkeypatch.setattr(policy_gradient, "recompute_step", step)  # (the KL's reference forward)
    epoch = _epoch(2)
    traj, k = epoch.trajectory, 2
    mu_old_all = 2.0 * traj.latents[:, k] + k
    d = (traj.latents[:, k + 1] - mu_old_all) / stds[:, None]
    traj.log_probs[:, k] = (-(d ** 2) / 2 - torch.log(stds)[:, None] - 0.5 * math.log(2 * math.pi)).mean(dim=1)
    policy, reference = Policy(2.0), Reference(1.9)
    method = GRPOGuard(clip_range=1e6, beta_kl=0.3)
    method.prepare(policy, epoch)
    assert all(p is policy and kw == {} for p, _, kw in step.calls)  # μ_old: θ_old's forward
    policy.a, step.calls = 2.1, []
    rows = torch.tensor([3, 1])
    loss, metrics = method.loss(policy, TransitionUnit(epoch, rows, k, weight=1.0), reference=reference)

    x_k, x_next, s = traj.latents[rows, k], traj.latents[rows, k + 1], stds[rows]
    mu_old, mu_new, mu_ref = 2.0 * x_k + k, 2.1 * x_k + k, 1.9 * x_k + k
    eps = (x_next - mu_old) / s[:, None]
    rho = (eps * (mu_new - mu_old)).mean(dim=1).exp()
    dt = 0.5 - 0.0
    sigma_t = s / math.sqrt(dt)
    kl = (((mu_new - mu_ref) ** 2).mean(dim=1) / (2 * sigma_t ** 2)).mean()
    expected = (1 / dt) * (-epoch.advantages[rows] * rho).mean() + 0.3 * kl
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(metrics["kl"], kl, rtol=1e-5, atol=1e-8)
    bias = (((mu_new - mu_old) ** 2).mean(dim=1) / (2 * s ** 2)).mean()
    assert float(metrics["ratio_bias"]) == pytest.approx(float(bias), rel=1e-5)
    assert [(p, kk) for p, kk, _ in step.calls] == [(policy, k), (policy, k)] and reference.used == [policy]
    assert step.calls[0][2] == {"detach_unconditional": True} and step.calls[1][2] == {}  # θ's; the reference's
    step.calls = []
    GRPOGuard(clip_range=1e6, beta_kl=0.0, detach_unconditional=False, ratio_norm=False)(
        policy, traj.index(rows), epoch.advantages[rows], k)
    assert step.calls[0][2] == {"detach_unconditional": False}


def test_loss_needs_the_reference_when_beta_kl_is_positive(monkeypatch):
    monkeypatch.setattr(grpo_guard, "recompute_step", PolicyStep(torch.full((B,), S)))
    epoch = _epoch(2)
    method = GRPOGuard(beta_kl=0.1)
    method.prepare(Policy(2.0), epoch)
    with pytest.raises(ValueError, match=r"^method.beta_kl > 0 needs a reference; the loop passed none\.$"):
        method.loss(Policy(2.0), TransitionUnit(epoch, torch.tensor([0, 1]), 2, weight=1.0), reference=None)


def test_ratio_norm_without_old_means_is_refused_with_the_whole_message(monkeypatch):
    monkeypatch.setattr(grpo_guard, "recompute_step", LinearStep(2.0))
    traj = _epoch(2).trajectory
    message = ("method.ratio_norm=true needs the rollout's step means μ_old; GRPOGuard.prepare stores them (pass "
               "old_mean when calling the objective directly)")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GRPOGuard(beta_kl=0.0)(None, traj, torch.ones(B), 0)


def test_the_consistency_alarm_compares_the_recomputed_and_stored_log_probs_in_the_first_update(monkeypatch):
    """In the epoch's first update (`checked_updates`), θ ≠ θ_old stops the run naming the transition and the largest
    |log π_θ − log π_old| of the unit, computed here from the two Gaussians."""
    from types import SimpleNamespace

    from diffalign.runtime.faults import RolloutMismatchError

    monkeypatch.setattr(grpo_guard, "recompute_step", LinearStep(2.0))
    epoch = _epoch(2)
    method = GRPOGuard(beta_kl=0.0, logprob_tolerance=1e-3)
    method.prepare(None, epoch)
    updates = method.checked_updates(SimpleNamespace(epoch=4), iter([["first"], ["second"]]))
    next(updates)
    rows, k = torch.tensor([3, 1]), 2
    method.loss(None, TransitionUnit(epoch, rows, k, weight=1.0), reference=None)  # θ = θ_old: no alarm
    monkeypatch.setattr(grpo_guard, "recompute_step", LinearStep(2.1))
    x_k, x_next = epoch.trajectory.latents[rows, k], epoch.trajectory.latents[rows, k + 1]
    worst = float((_mean_log_prob(x_next, 2.1 * x_k + k, S) - _mean_log_prob(x_next, 2.0 * x_k + k, S)).abs().max())
    assert worst > 1e-3
    with pytest.raises(RolloutMismatchError, match=rf"of epoch 4 \(transition 2\): max \|Δ log π\| = "
                                                   rf"{re.escape(f'{worst:.3g}')} > method\.logprob_tolerance=0\.001"):
        method.loss(None, TransitionUnit(epoch, rows, k, weight=1.0), reference=None)
