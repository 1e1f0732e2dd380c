"""Flow-matching policy and samplers: SDE step vs diffusers, log-prob constant, pipeline parity, ratio = 1."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import step_sampler
from diffusers import FlowMatchEulerDiscreteScheduler

from diffalign.models.tiny_flow import TINY_MAX_SEQUENCE_LENGTH, build_tiny_flow_pipeline, build_tiny_flow_policy
from diffalign.samplers.flow_sde import dance_sde_step, flow_sde_step, gaussian_log_prob
from diffalign.samplers.ode import ode_rollout
from diffalign.samplers.rollout import recompute_log_probs, recompute_step, rollout


def test_sde_step_with_zero_noise_equals_flow_match_euler_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=gen)
    v = torch.randn(3, 4, 8, 8, generator=gen)
    for i, t in enumerate(scheduler.timesteps):
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        out = flow_sde_step(v, scheduler.sigmas[i], scheduler.sigmas[i + 1], x, noise_level=0.0)
        torch.testing.assert_close(out.prev_sample, expected, rtol=0, atol=1e-6)
        assert torch.all(out.log_prob == 0)  # a deterministic step has no density


def test_log_prob_of_the_mean_is_the_gaussian_normalising_constant():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    v = torch.randn(2, 4, 8, 8, generator=gen)
    sigma, sigma_next, a = 0.8, 0.6, 0.7
    out = flow_sde_step(v, sigma, sigma_next, x, noise_level=a, generator=gen)
    at_mean = flow_sde_step(v, sigma, sigma_next, x, noise_level=a, prev_sample=out.mean)
    # s = a sqrt(σ/(1−σ)) sqrt(σ − σ_next), by hand
    s = a * math.sqrt(sigma / (1 - sigma)) * math.sqrt(sigma - sigma_next)
    expected = -math.log(s) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(at_mean.log_prob, torch.full((2,), expected), rtol=0, atol=1e-5)
    # and the mean by the closed form of docs/methods/algorithms.md#flow-grpo-sde
    st2 = a**2 * sigma / (1 - sigma)
    dt = sigma_next - sigma
    mean = x * (1 + st2 / (2 * sigma) * dt) + v * (1 + st2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(out.mean, mean, rtol=1e-6, atol=1e-6)


def test_gaussian_log_prob_matches_torch_distributions():
    gen = torch.Generator().manual_seed(2)
    x, mu = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 4, generator=gen)
    std = torch.tensor(0.3)
    ref = torch.distributions.Normal(mu, std).log_prob(x)
    torch.testing.assert_close(gaussian_log_prob(x, mu, std, "mean"), ref.mean(dim=(1, 2, 3)))
    torch.testing.assert_close(gaussian_log_prob(x, mu, std, "sum"), ref.sum(dim=(1, 2, 3)))


def test_sigma_one_needs_sigma_max():
    x = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="sigma_max"):
        flow_sde_step(x, 1.0, 0.9, x, noise_level=0.7)


def test_flow_rollout_with_zero_noise_equals_the_sd3_pipeline():
    pipe = build_tiny_flow_pipeline(seed=3)
    from diffalign.models.sd3 import StableDiffusion3Policy

    policy = StableDiffusion3Policy(pipe, lora_rank=4, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)
    prompts = ["a red circle", "two blue squares"]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    traj = rollout(policy, prompts, step_sampler(policy, num_inference_steps=6, guidance_scale=4.5, noise=0.0),
                   generator=gens, decode=False)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with policy.reference():  # a fresh LoRA is exactly zero, but compare against the bare transformer anyway
        expected = pipe(prompts, num_inference_steps=6, guidance_scale=4.5, generator=gens, output_type="latent",
                        max_sequence_length=TINY_MAX_SEQUENCE_LENGTH).images
    torch.testing.assert_close(traj.latents[:, -1], expected, rtol=1e-5, atol=1e-5)
    assert traj.sampler == "flow_sde" and traj.sigmas.shape == (7,)


@pytest.mark.parametrize("family", ["flow", "dance", "ddim"])
def test_recomputed_log_probs_give_ratio_one_before_any_update(family):
    sde_type = "dance" if family == "dance" else None
    if family in ("flow", "dance"):
        policy, eta = build_tiny_flow_policy(seed=0), 0.7 if family == "flow" else 0.3
    else:
        from diffalign.models.tiny_random import build_tiny_random_policy

        policy, eta = build_tiny_random_policy(seed=0), 1.0
    # make the adapter non-zero so the check covers the LoRA path
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
    sampler = step_sampler(policy, num_inference_steps=5, guidance_scale=4.5, noise=eta, sde_type=sde_type)
    traj = rollout(policy, ["a red circle", "a green triangle", "one yellow square"], sampler, generator=gens,
                   decode=False)
    assert traj.sampler == {"flow": "flow_sde", "dance": "dance_sde", "ddim": "ddim"}[family]
    with torch.no_grad():
        new = recompute_log_probs(policy, traj, range(5))
    ratio = torch.exp(new - traj.log_probs)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-5)
    # the minibatch path of the objectives (index + recompute_step) agrees too
    with torch.no_grad():
        step = recompute_step(policy, traj.index([2, 0]), 3, detach_unconditional=True)
    torch.testing.assert_close(step.log_prob, traj.log_probs[[2, 0], 3], rtol=0, atol=1e-5)


def test_ode_rollouts_are_deterministic_and_flag_no_log_probs():
    policy = build_tiny_flow_policy(seed=0)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    a = ode_rollout(policy, ["a red circle"] * 2, num_inference_steps=4, solver="dpm_solver", latents=noise)
    b = ode_rollout(policy, ["a red circle"] * 2, num_inference_steps=4, solver="dpm_solver", latents=noise)
    assert torch.equal(a.latents, b.latents) and a.sampler == "dpm_ode" and not a.trainable.any()
    assert a.images.shape == (2, 3, 32, 32) and 0 <= a.images.min() and a.images.max() <= 1
    with pytest.raises(ValueError, match="deterministic"):
        recompute_log_probs(policy, a, [0])
    with pytest.raises(ValueError, match="flow"):
        ode_rollout(policy, ["a"], solver="ddim")


def test_dance_sde_step_by_hand():
    """DanceGRPO's step (docs/methods/algorithms.md#dancegrpo-sde) at x = 1, v̂ = 0.5, σ = 0.5 → 0.25, η = 0.3, by
    hand: x̂₀ = 1 − 0.5·0.5 = 0.75; g = −(1 − 0.5·0.75)/0.25 = −2.5; Δ = −0.25;
    μ = 1 + (−0.25)(0.5) − ½(0.09)(−2.5)(−0.25) = 0.846875; s = 0.3·sqrt(0.25) = 0.15."""
    x, v = torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 0.5)
    out = dance_sde_step(v, 0.5, 0.25, x, noise_level=0.3, prev_sample=torch.full((1, 1, 1, 1), 0.846875 + 0.15))
    assert out.mean.item() == pytest.approx(0.846875, abs=1e-6)
    assert float(out.std) == pytest.approx(0.15, abs=1e-7)
    # one standard deviation from the mean: −½ − log 0.15 − ½ log 2π
    assert out.log_prob.item() == pytest.approx(-0.5 - math.log(0.15) - 0.5 * math.log(2 * math.pi), abs=1e-5)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        dance_sde_step(v, 0.25, 0.5, x, noise_level=0.3)
    with pytest.raises(ValueError, match="sigma > 0"):
        dance_sde_step(v, 0.0, 0.0, x, noise_level=0.3)


def test_dance_sde_step_with_zero_eta_equals_flow_match_euler_step():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(8)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=gen)
    v = torch.randn(2, 4, 8, 8, generator=gen)
    for i, t in enumerate(scheduler.timesteps):
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        out = dance_sde_step(v, scheduler.sigmas[i], scheduler.sigmas[i + 1], x, noise_level=0.0)
        torch.testing.assert_close(out.prev_sample, expected, rtol=0, atol=1e-6)
        assert torch.all(out.log_prob == 0)


def test_dance_sde_is_refused_for_an_eps_model_and_checked_up_front(tmp_path):
    from conftest import compose_cfg

    from diffalign.config.validation import validate_train_config
    from diffalign.models.tiny_random import build_tiny_random_policy

    with pytest.raises(ValueError, match="sampler=dance_sde steps rectified-flow models, but the policy is an eps"):
        rollout(build_tiny_random_policy(seed=0), ["a red circle"],
                step_sampler(build_tiny_random_policy(seed=0), num_inference_steps=2, sde_type="dance"))
    with pytest.raises(ValueError, match="sampler.model_family=flow.* is an eps/v-prediction model"):
        validate_train_config(compose_cfg([f"output_dir={tmp_path}", "model=tiny_random", "method=vipo",
                                           "sampler=dance_sde"]))
    with pytest.raises(ValueError, match="sampler.model_family=eps.* is a rectified-flow model"):
        validate_train_config(compose_cfg([f"output_dir={tmp_path}", "model=tiny_sd3", "method=vipo",
                                           "sampler=ddim"]))
    validate_train_config(compose_cfg([f"output_dir={tmp_path}", "model=tiny_sd3", "method=vipo",
                                       "sampler=dance_sde"]))


def test_ode_rollout_skips_only_a_zero_adapter_unless_asked_to_fuse(monkeypatch):
    """As the step samplers (tests/unit/evaluation/test_performance.py): an all-zero LoRA is switched off for the ODE
    rollout (bit for bit the adapted samples, at the bare denoiser's cost), a trained one runs unfused unless
    `fuse_lora`; the images of the adapted model itself (no context at all) are the reference."""
    import contextlib
    import sys

    from conftest import perturb_lora_

    from diffalign.models.base import inference_lora

    ode_module = sys.modules["diffalign.samplers.ode"]
    policy = build_tiny_flow_policy(seed=0)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    seen = []

    @contextlib.contextmanager
    def spy(denoiser, fuse=True):
        with inference_lora(denoiser, fuse=fuse) as what:
            seen.append((what, all(layer.disable_adapters for layer in _lora_layers(denoiser))))
            yield what

    def run(**kwargs):
        return ode_rollout(policy, ["a red circle"] * 2, num_inference_steps=3, latents=noise, **kwargs)

    def as_adapted(**kwargs):  # the adapted model as it is, no folding
        with monkeypatch.context() as m:
            m.setattr(ode_module, "inference_lora", lambda denoiser, fuse=True: contextlib.nullcontext("none"))
            return run(**kwargs)

    monkeypatch.setattr(ode_module, "inference_lora", spy)
    zero = run()
    assert torch.equal(zero.latents, as_adapted().latents) and torch.equal(zero.images, as_adapted().images)
    perturb_lora_(policy, std=0.05)
    trained, fused = run(), run(fuse_lora=True)
    assert seen == [("skipped", True), ("unchanged", False), ("fused", True)]
    assert torch.equal(trained.latents, as_adapted().latents)
    assert not torch.equal(trained.latents, zero.latents)  # the trained adapter does act
    torch.testing.assert_close(fused.latents, trained.latents, rtol=0, atol=1e-4)
    assert not any(layer.disable_adapters for layer in _lora_layers(policy.denoiser))  # switched back on


def _lora_layers(denoiser):
    from peft.tuners.lora import LoraLayer

    return [m for m in denoiser.modules() if isinstance(m, LoraLayer)]
