"""GRPO-Guard (arXiv:2510.22319, diffalign/objectives/grpo_guard.py) checked against its formulas computed by hand.

The authors' own code was not found in the reference index; the formulas checked are the paper's (§3.2: RatioNorm,
eq. 8; gradient reweighting, eq. 12) as the two public implementations that cite it compute them (Flow-Factory's
``GRPOGuardTrainer._guard_ratio``: ``Δlogp · s + mse / (2 s)``; TeleBoost's ``compute_ratio_norm_bias`` and
``δ = 1/Δt``). The hand computations here do not use that form: they recover the rollout's standard-normal draw
ε = (x_{k+1} − μ_old)/s from the stored sample and use log ρ̂ = mean(ε · Δμ), the identity RatioNorm is built on."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_cfg, online_overrides
from safetensors.torch import load_file

from diffalign.objectives import grpo_guard
from diffalign.objectives.grpo_guard import GRPOGuard, grad_weight, guard_log_ratio
from diffalign.samplers.flow_sde import FlowStepOutput, flow_sde_step
from diffalign.types import Trajectory


@pytest.fixture(autouse=True)
def _release_locks(release_run_locks):
    """Every test here releases the run locks it took (`conftest.release_run_locks`)."""


def _gaussian_mean_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """log N(x; mean, std² I) averaged over the non-batch elements, written out by hand."""
    d = (x - mean).reshape(len(x), -1)
    return (-(d ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=1)


def test_ratio_norm_is_the_noise_projection_of_the_mean_shift():
    """With the sampler's own step (`flow_sde_step`, a = 0.7) the normalised log-ratio equals mean(ε · Δμ), ε the
    rollout's draw recovered from the stored sample — the identity of paper eq. 8 — while the raw log-ratio equals
    mean(ε · Δμ)/s − mean(Δμ²)/(2 s²)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 4, generator=g)
    v_old = torch.randn(3, 2, 4, 4, generator=g)
    v_new = v_old + 0.3 * torch.randn(3, 2, 4, 4, generator=g)
    old = flow_sde_step(v_old, 0.75, 0.5, x, noise_level=0.7, sigma_max=0.9, generator=g)
    new = flow_sde_step(v_new, 0.75, 0.5, x, noise_level=0.7, sigma_max=0.9, prev_sample=old.prev_sample)
    s = float(old.std)
    eps = (old.prev_sample - old.mean) / s
    dmu = new.mean - old.mean
    by_hand = (eps * dmu).reshape(3, -1).mean(dim=1)
    got = guard_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, old.std)
    torch.testing.assert_close(got, by_hand, rtol=1e-4, atol=1e-6)
    raw = (eps * dmu).reshape(3, -1).mean(dim=1) / s - (dmu ** 2).reshape(3, -1).mean(dim=1) / (2 * s ** 2)
    torch.testing.assert_close(new.log_prob - old.log_prob, raw, rtol=1e-4, atol=1e-5)
    # a per-sample std (B, 1, 1, 1) is read row by row
    stds = torch.tensor([0.2, 0.5, 1.0]).reshape(3, 1, 1, 1)
    xs = old.mean + stds * eps
    lp_new = torch.stack([_gaussian_mean_log_prob(xs[i:i + 1], new.mean[i:i + 1], float(stds[i])) for i in range(3)])
    lp_old = torch.stack([_gaussian_mean_log_prob(xs[i:i + 1], old.mean[i:i + 1], float(stds[i])) for i in range(3)])
    torch.testing.assert_close(guard_log_ratio(lp_new.reshape(3), lp_old.reshape(3), new.mean, old.mean, stds),
                               by_hand, rtol=1e-4, atol=1e-6)


def test_the_raw_ratio_is_biased_below_one_and_the_normalised_one_is_not():
    """The paper's motivation (§3.1): over many elements the raw log-ratio sits at −‖Δμ‖²/(2 D s²) < 0, a bias that
    grows as s shrinks (low-noise steps); RatioNorm's is centred on 0 at every s."""
    g = torch.Generator().manual_seed(1)
    mu_old = torch.randn(1, 200_000, generator=g)
    dmu = 0.05 * torch.randn(1, 200_000, generator=g)
    for s in (0.5, 0.1, 0.02):
        x = mu_old + s * torch.randn(1, 200_000, generator=g)
        lp_new, lp_old = _gaussian_mean_log_prob(x, mu_old + dmu, s), _gaussian_mean_log_prob(x, mu_old, s)
        bias = float((dmu ** 2).mean()) / (2 * s ** 2)
        raw = float(lp_new - lp_old)
        normed = float(guard_log_ratio(lp_new, lp_old, mu_old + dmu, mu_old, s))
        assert raw == pytest.approx(-bias, rel=0.1)  # −5e-3, −0.125, −3.1 (noise mean(εΔμ)/s: ≤ 6e-3)
        assert abs(normed) < 5 * 0.05 / math.sqrt(200_000)  # mean(ε Δμ) has std 0.05/√D: 5 standard deviations


def test_gradient_weight_is_the_inverse_step_size():
    sigmas = torch.tensor([1.0, 0.75, 0.4, 0.0])
    assert grad_weight(sigmas, 0) == pytest.approx(4.0)
    assert grad_weight(sigmas, 1) == pytest.approx(1 / 0.35)
    assert grad_weight(sigmas, 2, "none") == 1.0
    with pytest.raises(ValueError, match="method.grad_reweight='sqrt' must be one of"):
        grad_weight(sigmas, 0, "sqrt")
    with pytest.raises(ValueError, match="method.grad_reweight='sqrt' must be one of"):
        GRPOGuard(grad_reweight="sqrt")


def _fake_step(monkeypatch, new_mean: torch.Tensor, x_next: torch.Tensor, s: float) -> None:
    """`recompute_step` replaced by a step whose mean is the leaf `new_mean` (log-prob by hand), so the loss's
    gradient with respect to μ_θ can be read off."""

    def fake(policy, trajectory, k, **kwargs):
        return FlowStepOutput(prev_sample=x_next, mean=new_mean, std=torch.tensor(s),
                              log_prob=_gaussian_mean_log_prob(x_next, new_mean, s))

    monkeypatch.setattr(grpo_guard, "recompute_step", fake)


@pytest.mark.parametrize("clip_range", [1e6, 0.02])
def test_loss_and_gradient_weights_match_the_hand_computation(monkeypatch, clip_range):
    """L = δ_k mean_i max(−A_i ρ̂_i, −A_i clip(ρ̂_i)) with δ_k = 1/Δt_k; where a row is not clipped its gradient with
    respect to μ_θ is −δ_k A_i ρ̂_i ε_i / (B D), where it is, 0 (derived by hand from log ρ̂ = mean(ε Δμ))."""
    g = torch.Generator().manual_seed(2)
    B, shape, s, k = 4, (2, 3, 3), 0.3, 1
    sigmas = torch.tensor([1.0, 0.75, 0.4, 0.0])
    mu_old = torch.randn(B, *shape, generator=g)
    eps = torch.randn(B, *shape, generator=g)
    x_next = mu_old + s * eps
    new_mean = (mu_old + 0.3 * torch.randn(B, *shape, generator=g)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    traj = Trajectory(latents=torch.zeros(B, 4, *shape), timesteps=sigmas[:3] * 1000,
                      log_probs=torch.zeros(B, 3).index_put_((torch.arange(B), torch.full((B,), k)),
                                                               _gaussian_mean_log_prob(x_next, mu_old, s)),
                      trainable=torch.ones(3, dtype=torch.bool), prompt_embeds=None, images=None, prompts=[""] * B,
                      guidance_scale=4.5, noise=0.7, sigmas=sigmas, sampler="flow_sde")
    _fake_step(monkeypatch, new_mean, x_next, s)
    method = GRPOGuard(clip_range=clip_range, beta_kl=0.0)
    loss, metrics = method(None, traj, adv, k, old_mean=mu_old)
    loss.backward()

    D = eps[0].numel()
    delta = 1 / 0.35
    log_rho = (eps * (new_mean.detach() - mu_old)).reshape(B, -1).mean(dim=1)
    rho = log_rho.exp()
    per_row = torch.maximum(-adv * rho, -adv * rho.clamp(1 - clip_range, 1 + clip_range))
    torch.testing.assert_close(loss.detach(), delta * per_row.mean(), rtol=1e-5, atol=1e-7)
    # a row is clipped when the clipped term is the larger one and differs: its gradient is 0
    active = (-adv * rho >= -adv * rho.clamp(1 - clip_range, 1 + clip_range)).float()
    expected = (-delta * adv * rho * active / (B * D)).reshape(B, 1, 1, 1) * eps
    torch.testing.assert_close(new_mean.grad, expected, rtol=1e-4, atol=1e-8)
    assert float(metrics["grad_weight"]) == pytest.approx(delta)
    bias = ((new_mean.detach() - mu_old) ** 2).reshape(B, -1).mean(dim=1) / (2 * s ** 2)
    assert float(metrics["ratio_bias"]) == pytest.approx(float(bias.mean()), rel=1e-5)
    if clip_range < 1:
        assert 0 < float(active.sum()) < B  # the case clips some rows and not others
        assert float(metrics["clipfrac"]) == pytest.approx(float(((rho - 1).abs() > clip_range).float().mean()))


def test_without_ratio_norm_and_reweighting_it_is_flow_grpo(monkeypatch):
    """ratio_norm=false, grad_reweight=none: the loss is Flow-GRPO's clipped surrogate on the raw ratio."""
    g = torch.Generator().manual_seed(3)
    B, s = 3, 0.4
    mu_old = torch.randn(B, 4, generator=g)
    x_next = mu_old + s * torch.randn(B, 4, generator=g)
    new_mean = mu_old + 0.05 * torch.randn(B, 4, generator=g)
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    traj = Trajectory(latents=torch.zeros(B, 3, 4), timesteps=sigmas[:2] * 1000,
                      log_probs=torch.stack([_gaussian_mean_log_prob(x_next, mu_old, s)] * 2, 1),
                      trainable=torch.ones(2, dtype=torch.bool), prompt_embeds=None, images=None, prompts=[""] * B,
                      guidance_scale=1.0, noise=0.7, sigmas=sigmas, sampler="flow_sde")
    _fake_step(monkeypatch, new_mean, x_next, s)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = GRPOGuard(clip_range=1e6, beta_kl=0.0, ratio_norm=False, grad_reweight="none")(None, traj, adv, 0)
    rho = (_gaussian_mean_log_prob(x_next, new_mean, s) - _gaussian_mean_log_prob(x_next, mu_old, s)).exp()
    torch.testing.assert_close(loss, (-adv * rho).mean(), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="method.ratio_norm=true needs the rollout's step means"):
        GRPOGuard(beta_kl=0.0)(None, traj, adv, 0)


def test_the_tiny_recipe_trains_and_its_first_update_has_ratio_exactly_one(tmp_path, monkeypatch):
    """recipe=tiny_grpo_guard end to end (2 epochs × 2 updates, 4 steps): μ_old recomputed by `prepare` is the
    rollout's, so before the first update of each epoch log ρ̂ = 0 to float noise; the second update moves off 1;
    the LoRA moves."""
    seen: list[tuple[int, float]] = []
    original = GRPOGuard.clipped_loss

    def recorded(self, policy, trajectory, advantages, k, step, log_ratio, **kwargs):
        seen.append((len(seen), float(log_ratio.detach().abs().max())))
        return original(self, policy, trajectory, advantages, k, step, log_ratio, **kwargs)

    monkeypatch.setattr(GRPOGuard, "clipped_loss", recorded)
    out = tmp_path / "run"
    cfg = compose_cfg(["recipe=tiny_grpo_guard", *online_overrides(out), "online.updates_per_epoch=2",
                       "trainer.batch_size=4"])
    from diffalign.train import online

    results = online.train(cfg)
    assert results["global_step"] == 4
    # 8 rows, batch 4, 3 trained transitions (int(4 · 0.99)): 2 updates of 3 units each per epoch
    per_epoch = 6
    firsts = [v for i, v in seen if i % per_epoch < 3]
    seconds = [v for i, v in seen if i % per_epoch >= 3]
    assert len(seen) == 2 * per_epoch and max(firsts) <= 1e-6 and max(seconds) > 1e-6
    tail = results["history_tail"][-1]
    assert {"ratio_raw", "ratio_bias", "grad_weight"} <= set(tail) and tail["grad_weight"] > 1
    first = load_file(str(out / "checkpoint-2" / "pytorch_lora_weights.safetensors"))
    final = load_file(str(out / "final" / "pytorch_lora_weights.safetensors"))
    assert any(not torch.equal(first[key], final[key]) for key in first)


def test_on_the_windowed_sde_it_trains_only_the_window_with_ratio_one_at_each_epochs_first_update(tmp_path,
                                                                                                    monkeypatch):
    """``sampler=window_sde`` (MixGRPO's window, Flow-GRPO SDE steps inside it): 6 steps, window 2 moved every epoch,
    so epoch 0 trains steps {0, 1} and epoch 1 steps {1, 2} (l(e) = e, by the schedule's formula); μ_old is recomputed
    for the window's steps only, so each epoch's first update sees log ρ̂ = 0 to float noise, and δ_k = 1/Δt_k of the
    trajectory's own sigmas."""
    from diffalign.objectives import policy_gradient
    from diffalign.train import online

    events: list[tuple] = []
    plan, original = policy_gradient.transition_plan, GRPOGuard.clipped_loss

    def spy_plan(epoch, *args, **kwargs):
        for update in plan(epoch, *args, **kwargs):
            events.append(("update", epoch.epoch))
            yield update

    def spy_loss(self, policy, trajectory, advantages, k, step, log_ratio, **kwargs):
        dt = float(trajectory.sigmas[k] - trajectory.sigmas[k + 1])
        events.append(("unit", k, float(log_ratio.detach().abs().max()), kwargs["weight"] * dt))
        return original(self, policy, trajectory, advantages, k, step, log_ratio, **kwargs)

    monkeypatch.setattr(policy_gradient, "transition_plan", spy_plan)
    monkeypatch.setattr(GRPOGuard, "clipped_loss", spy_loss)
    cfg = compose_cfg(["recipe=tiny_grpo_guard", *online_overrides(tmp_path), "sampler=window_sde",
                       "sampler.num_inference_steps=6", "sampler.window_size=2", "sampler.shift_interval=1",
                       "method.timestep_fraction=1.0", "online.updates_per_epoch=2", "trainer.batch_size=4"])
    results = online.train(cfg)
    assert results["global_step"] == 4
    updates, epoch, trained = [], None, {0: set(), 1: set()}
    for event in events:
        if event[0] == "update":
            epoch = event[1]
            updates.append((epoch, []))
        else:
            trained[epoch].add(event[1])
            updates[-1][1].append(event[2])
            assert event[3] == pytest.approx(1.0)
    assert trained == {0: {0, 1}, 1: {1, 2}}
    assert [e for e, _ in updates] == [0, 0, 1, 1] and all(len(v) == 2 for _, v in updates)  # 4 rows x 2 steps each
    assert max(updates[0][1] + updates[2][1]) <= 1e-6 and max(updates[1][1] + updates[3][1]) > 1e-6


@pytest.mark.parametrize("sampler, match", [("dance_sde", "sampler.name='dance_sde'"),
                                            ("cps_sde", "sampler.name='cps_sde'"),
                                            ("dpm_ode", "it needs a stochastic sampler")])
def test_a_sampler_other_than_the_flow_grpo_sde_is_refused_before_any_model_loads(tmp_path, sampler, match):
    from diffalign.config.validation import validate_train_config

    cfg = compose_cfg(["recipe=tiny_grpo_guard", *online_overrides(tmp_path), f"sampler={sampler}"])
    with pytest.raises(ValueError, match=match):
        validate_train_config(cfg)
