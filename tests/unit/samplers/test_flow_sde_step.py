"""The flow SDE steps' edges and the two samplers' wiring that tests/unit/samplers/test_flow_sampler.py leaves open,
found by mutation testing (docs/contributing.md#mutation-testing): the step from σ = 1 (Flow-GRPO's σ_max), DanceGRPO's
score at σ ≠ ½, per-sample sigmas, per-position log-probs, the noise drawn from the caller's generator (and none for a
deterministic step), float32 from float64 inputs, the defaults, and the messages."""

from __future__ import annotations

import math

import pytest
import torch

from diffalign.config.checks import ConfigError
from diffalign.samplers.base import Schedule
from diffalign.samplers.flow_sde import (
    DanceSDESampler,
    FlowSDESampler,
    dance_sde_step,
    flow_sde_step,
    gaussian_log_prob,
)

SHAPE = (2, 4, 3, 3)


def randn(seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_step_from_sigma_one_uses_sigma_max_by_hand():
    """Flow-GRPO's released ``sde_step_with_logprob`` puts σ_max = sigmas[1] for σ = 1 in σ_t = a sqrt(σ / (1 − σ)):
    a = 0.7, σ_max = σ_next = 0.9, x = 1, v̂ = 0.5: σ_t² = 0.49 / 0.1 = 4.9, Δ = −0.1,
    μ = 1·(1 + 4.9·(−0.1)/2) + 0.5·(1 + 0)·(−0.1) = 0.705, s = sqrt(4.9)·sqrt(0.1) = 0.7."""
    x, v = torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 0.5)
    out = flow_sde_step(v, 1.0, 0.9, x, sigma_max=0.9, prev_sample=x)  # a = 0.7 is the default
    assert out.mean.item() == pytest.approx(0.705, abs=1e-6)
    assert float(out.std) == pytest.approx(0.7, abs=1e-6)
    # and the sampler passes its schedule's second sigma as σ_max
    schedule = Schedule(None, torch.tensor([1000.0, 900.0, 500.0]), torch.tensor([1.0, 0.9, 0.5, 0.0]))
    step = FlowSDESampler().step(schedule, 0, v, x, prev_sample=x)
    assert float(step.std) == pytest.approx(0.7, abs=1e-6)
    assert step.log_prob.item() == pytest.approx(gaussian_log_prob(x, out.mean, out.std, "mean").item(), abs=1e-6)


def test_dance_step_by_hand_away_from_one_half():
    """x = 1, v̂ = 0.5, σ = 0.8 → 0.6, η = 0.3: x̂₀ = 1 − 0.8·0.5 = 0.6; g = −(1 − 0.2·0.6)/0.64 = −1.375; Δ = −0.2;
    μ = 1 − 0.2·0.5 − ½·0.09·(−1.375)·(−0.2) = 0.887625; s = 0.3·sqrt(0.2)."""
    x, v = torch.ones(1, 1, 1, 1), torch.full((1, 1, 1, 1), 0.5)
    out = dance_sde_step(v, 0.8, 0.6, x, noise_level=0.3, prev_sample=x)
    assert out.mean.item() == pytest.approx(0.887625, abs=1e-6)
    assert float(out.std) == pytest.approx(0.3 * math.sqrt(0.2), abs=1e-6)
    default = dance_sde_step(v, 0.8, 0.6, x, prev_sample=x)  # η = 0.25 (the ViPO Wan script) by default
    assert float(default.std) == pytest.approx(0.25 * math.sqrt(0.2), abs=1e-6)


def test_per_sample_sigmas_match_scalar_calls_and_scalars_keep_a_scalar_std():
    x, v = randn(0), randn(1)
    sigma, sigma_next = torch.tensor([0.8, 0.5]), torch.tensor([0.6, 0.3])
    for step in (flow_sde_step, dance_sde_step):
        both = step(v, sigma, sigma_next, x, noise_level=0.5, prev_sample=x)
        assert both.std.shape == (2, 1, 1, 1) and both.log_prob.shape == (2,)
        for i in range(2):
            one = step(v[i:i + 1], float(sigma[i]), float(sigma_next[i]), x[i:i + 1], noise_level=0.5,
                       prev_sample=x[i:i + 1])
            assert one.std.shape == ()  # FlowStepOutput: 0-dim for scalar sigmas
            torch.testing.assert_close(both.mean[i:i + 1], one.mean)
            torch.testing.assert_close(both.log_prob[i:i + 1], one.log_prob)


def test_float64_sigmas_and_std_still_give_float32():
    x, v = randn(0), randn(1)
    out = flow_sde_step(v, torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64), x,
                        prev_sample=x)
    assert {t.dtype for t in (out.prev_sample, out.mean, out.std, out.log_prob)} == {torch.float32}
    assert gaussian_log_prob(x, v, torch.full((2, 1, 1, 1), 0.3, dtype=torch.float64)).dtype == torch.float32


def test_per_position_and_default_reductions():
    """ViPO's per-position log-prob `(B, h, w)` is Σ_c log N (torch.distributions); the default is the mean."""
    x, mu = randn(0), randn(1)
    std = torch.tensor(0.3)
    density = torch.distributions.Normal(mu, std).log_prob(x)
    per_position = gaussian_log_prob(x, mu, std, "per_position")
    assert per_position.shape == (2, 3, 3)
    torch.testing.assert_close(per_position, density.sum(dim=1))
    torch.testing.assert_close(gaussian_log_prob(x, mu, std), density.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"^`reduction` must be 'mean', 'sum' or 'per_position', got 'max'.$"):
        gaussian_log_prob(x, mu, std, "max")
    # the step passes its reduction on
    step = flow_sde_step(randn(2), 0.8, 0.6, randn(3), prev_sample=x, reduction="sum")
    expected = torch.distributions.Normal(step.mean, step.std).log_prob(x).sum(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob, expected)


def test_a_zero_std_row_has_zero_log_prob_and_a_finite_gradient():
    """The safe std keeps log(0) and 0/0 out of the graph: a deterministic row contributes 0 and no NaN gradient."""
    mean = randn(1).requires_grad_(True)
    std = torch.tensor([0.0, 0.5]).view(2, 1, 1, 1)
    log_prob = gaussian_log_prob(randn(0), mean, std)
    assert log_prob[0].item() == 0.0
    log_prob.sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.equal(mean.grad[0], torch.zeros(4, 3, 3))


def test_drawn_samples_come_from_the_callers_generator():
    """x_{k+1} = μ + s z with z the float32 draw of the generator passed in (the global RNG is not used), for both
    steps and through both samplers."""
    x, v = randn(0), randn(1)
    z = randn(7)
    schedule = Schedule(None, torch.tensor([800.0, 600.0]), torch.tensor([0.8, 0.6, 0.0]))
    for sampler, step in ((FlowSDESampler(noise_level=0.5), flow_sde_step),
                          (DanceSDESampler(noise_level=0.5), dance_sde_step)):
        torch.manual_seed(0)
        out = step(v, 0.8, 0.6, x, noise_level=0.5, generator=torch.Generator().manual_seed(7))
        assert torch.equal(out.prev_sample, out.mean + out.std * z)
        torch.manual_seed(1)
        via = sampler.step(schedule, 0, v, x, generator=torch.Generator().manual_seed(7))
        assert torch.equal(via.prev_sample, out.prev_sample)
        scored = sampler.step(schedule, 0, v, x, prev_sample=out.prev_sample, reduction="sum")
        assert scored.log_prob.shape == (2,) and scored.std.item() == pytest.approx(out.std.item())
        torch.testing.assert_close(scored.log_prob, step(v, 0.8, 0.6, x, noise_level=0.5, prev_sample=out.prev_sample,
                                                         reduction="sum").log_prob)


def test_a_deterministic_step_draws_no_noise():
    """a = 0 draws nothing (as `FlowMatchEulerDiscreteScheduler.step`), so a rollout's later steps see the same
    random stream."""
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    out = flow_sde_step(randn(1), 0.8, 0.6, randn(0), noise_level=0.0, generator=generator)
    assert torch.equal(generator.get_state(), state) and torch.equal(out.prev_sample, out.mean)


def test_step_arguments_are_refused_in_one_line():
    x = randn(0)
    for step in (flow_sde_step, dance_sde_step):
        with pytest.raises(ValueError, match=r"^`noise_level` must be >= 0, got -0.1.$"):
            step(x, 0.8, 0.6, x, noise_level=-0.1)
        with pytest.raises(ValueError, match=r"^Got 3 generators for a batch of 2; pass one per sample.$"):
            step(x, 0.8, 0.6, x, noise_level=0.5, generator=[torch.Generator() for _ in range(3)])
    with pytest.raises(ValueError, match=r"^sigma = 1 needs `sigma_max` \(the schedule's second sigma\) for the SDE's "
                                         r"noise scale.$"):
        flow_sde_step(x, 1.0, 0.9, x)
    with pytest.raises(ValueError, match=r"^dance_sde_step needs sigma > 0 \(the last step ends at 0, it does not "
                                         r"start there\).$"):
        dance_sde_step(x, 0.0, 0.0, x)
    with pytest.raises(ValueError, match=r"^dance_sde_step integrates from sigma down to sigma_next < sigma; got "
                                         r"sigma_next >= sigma.$"):
        dance_sde_step(x, 0.5, 0.5, x)  # equal sigmas are refused too


@pytest.mark.parametrize(("sampler", "hint"), [(FlowSDESampler, "the flow SDE's noise scale; 0 is the Euler ODE"),
                                               (DanceSDESampler, "DanceGRPO's eta; 0 is the Euler ODE")])
def test_samplers_check_the_noise_level(sampler, hint):
    assert sampler(noise_level=0.0).noise_level == 0.0
    with pytest.raises(ConfigError, match=rf"^noise_level must be a number >= 0, got -0.1; {hint}$"):
        sampler(noise_level=-0.1)


def test_sampler_defaults_are_the_released_scripts():
    """Flow-GRPO config/grpo.py: a = 0.7, 10 steps, CFG 4.5; the ViPO Wan script: η = 0.25, 16 steps, CFG 5."""
    flow, dance = FlowSDESampler(), DanceSDESampler()
    assert (flow.noise_level, flow.num_inference_steps, flow.guidance_scale) == (0.7, 10, 4.5)
    assert (dance.noise_level, dance.num_inference_steps, dance.guidance_scale) == (0.25, 16, 5.0)
    # a sampler steps with its own noise level (DanceSDESampler's 0.25, not dance_sde_step's default by chance)
    schedule = Schedule(None, torch.tensor([800.0, 600.0]), torch.tensor([0.8, 0.6, 0.0]))
    x = randn(0)
    assert DanceSDESampler(noise_level=0.4).step(schedule, 0, x, x, prev_sample=x).std.item() == pytest.approx(
        0.4 * math.sqrt(0.2), abs=1e-6)
    assert FlowSDESampler(noise_level=0.4).step(schedule, 0, x, x, prev_sample=x).std.item() == pytest.approx(
        0.4 * math.sqrt(0.8 / 0.2) * math.sqrt(0.2), abs=1e-6)
