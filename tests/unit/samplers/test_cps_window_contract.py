"""CPS (``sampler=cps_sde``) and MixGRPO's window (``sampler=window_sde``): the edges of their steps and schedules,
the sampler's `step` passing its settings on, and the whole text of their refusals (found by mutation testing,
docs/contributing.md#mutation-testing). Expected values are computed by hand from CPS's step (Wang & Yu,
arXiv:2509.05952; the ``cps`` branch of Flow-GRPO's released ``sde_step_with_logprob``) and from MixGRPO's released
window schedule (``GRPOTrainingStates``, re-derived in tests/unit/samplers/test_samplers.py)."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from diffalign.config.checks import ConfigError
from diffalign.samplers.cps import CPSSampler, cps_step
from diffalign.samplers.window_sde import WindowSDESampler, window_start


def _gaussian(x: torch.Tensor, mean: torch.Tensor, std: float, reduce: str) -> torch.Tensor:
    """log N(x; mean, std² I) per row, written out element by element, then averaged or summed."""
    per = (-(x - mean) ** 2 / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).reshape(len(x), -1)
    return per.mean(dim=1) if reduce == "mean" else per.sum(dim=1)


def _assert_draws_and_scores(sampler, schedule, k, v, x, mean, s, sample_atol: float) -> None:
    """Step `k` of `sampler` draws mean + s·z with z from its generator (not the global stream), scores it with the
    hand-written Gaussian log-density (mean reduction), and scores a given sample (sum reduction)."""
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(123)  # the global stream differs from the generator's
    out = sampler.step(schedule, k, v, x, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out.prev_sample, mean + s * z, rtol=0, atol=sample_atol)
    torch.testing.assert_close(out.log_prob, _gaussian(mean + s * z, mean, s, "mean"), rtol=1e-5, atol=1e-5)
    scored = sampler.step(schedule, k, v, x, prev_sample=mean + 0.1, reduction="sum")
    torch.testing.assert_close(scored.log_prob, _gaussian(mean + 0.1, mean, s, "sum"), rtol=1e-5, atol=1e-4)


def test_cps_at_noise_level_one_puts_no_predicted_noise_back():
    # a = 1: s = sigma_next = 0.25 and mu = (1 - 0.25) x0-hat = 0.75 * (1 - 0.5 * 0.4) = 0.6 (the x1-hat term is 0)
    x, v = torch.full((1, 1, 1, 1), 1.0), torch.full((1, 1, 1, 1), 0.4)
    out = cps_step(v, 0.5, 0.25, x, noise_level=1.0, prev_sample=torch.full((1, 1, 1, 1), 0.7))
    assert out.mean.item() == pytest.approx(0.6, abs=1e-6) and float(out.std) == pytest.approx(0.25, abs=1e-7)
    assert out.log_prob.item() == pytest.approx(-0.01 / (2 * 0.0625) - math.log(0.25) - 0.5 * math.log(2 * math.pi),
                                                abs=1e-5)


def test_cps_step_refuses_a_step_that_does_not_go_down_with_the_whole_message():
    x = v = torch.ones(2, 1, 1, 1)
    for sigma, sigma_next in ((0.5, 0.5), (torch.tensor([0.5, 0.5]), torch.tensor([0.25, 0.5]))):
        with pytest.raises(ValueError, match=r"^cps_step integrates from sigma down to sigma_next < sigma; got "
                                             r"sigma_next >= sigma\.$"):
            cps_step(v, sigma, sigma_next, x)
    with pytest.raises(ValueError, match=r"^`noise_level` must be in \[0, 1\], got -0\.1\.$"):
        cps_step(v, 0.5, 0.25, x, noise_level=-0.1)


def test_cps_sampler_refuses_a_noise_level_above_one_with_its_hint():
    with pytest.raises(ConfigError, match=r"^noise_level must be a number in \[0, 1\], got 1\.2; CPS's a: the step std "
                                          r"is sigma_next \* sin\(a \* pi / 2\); 0 is deterministic$"):
        CPSSampler(noise_level=1.2).check()


def test_cps_sampler_step_passes_its_noise_level_generator_and_reduction():
    """`CPSSampler.step` at k = 1 of a 3-step schedule with a = 0.5 (not the default 0.8) equals the step by hand:
    s = 0.3 sin(π/4), μ = 0.7 x̂₀ + sqrt(0.3² − s²) x̂₁, x' = μ + s z with z the generator's draw."""
    schedule = SimpleNamespace(sigmas=torch.tensor([1.0, 0.6, 0.3, 0.0]))
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 1, 2, 2, generator=g), torch.randn(2, 1, 2, 2, generator=g)
    s = 0.3 * math.sin(0.5 * math.pi / 2)
    mean = 0.7 * (x - 0.6 * v) + math.sqrt(0.3 ** 2 - s ** 2) * (x + 0.4 * v)
    _assert_draws_and_scores(CPSSampler(noise_level=0.5), schedule, 1, v, x, mean, s, sample_atol=1e-6)


@pytest.mark.parametrize(("fields", "message"), [
    ({"num_inference_steps": 2}, ("num_inference_steps must be an integer >= 3, got 2; the window ends 2 steps before "
                                  "the last (MixGRPO)")),
    ({"noise_level": -0.1}, ("noise_level must be a number >= 0, got -0.1; the SDE's noise scale inside the window; 0 is "
                             "the Euler ODE")),
    ({"window_size": 0}, "window_size must be an integer >= 1, got 0"),
    ({"shift_interval": 0}, ("shift_interval must be an integer >= 1, got 0; epochs before the window moves (MixGRPO: "
                             "25)")),
    ({"window_stride": 0}, "window_stride must be an integer >= 1, got 0; steps the window moves by (MixGRPO: 1)"),
    ({"window_start": -1}, "window_start must be an integer >= 0 or null, got -1"),
    ({"num_inference_steps": 6, "window_start": 4}, ("window_start=4 must be <= num_inference_steps - 3 = 3 (the window "
                                                     "ends at step K - 2); or null to follow the schedule")),
])
def test_window_sde_refuses_each_bad_field_with_its_whole_message(fields, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        WindowSDESampler(**fields).check()


def test_window_sde_accepts_each_fields_edge():
    for fields in ({"num_inference_steps": 3}, {"noise_level": 0.0}, {"window_size": 1}, {"shift_interval": 1},
                   {"window_stride": 1}, {"window_start": None}, {"window_start": 0},
                   {"num_inference_steps": 6, "window_start": 3}):
        WindowSDESampler(**fields).check()


def test_window_start_refuses_each_bad_argument_alone_and_takes_three_steps():
    good = {"epoch": 0, "num_inference_steps": 25, "shift_interval": 25, "window_stride": 1}
    for name, bad in (("num_inference_steps", 2), ("epoch", -1), ("shift_interval", 0), ("window_stride", 0)):
        args = {**good, name: bad}
        got = ", ".join(str(args[n]) for n in ("num_inference_steps", "epoch", "shift_interval", "window_stride"))
        with pytest.raises(ValueError, match=r"^window_start needs num_inference_steps >= 3, epoch >= 0, "
                                             r"shift_interval >= 1 and window_stride >= 1; got " + got + "$"):
            window_start(args["epoch"], args["num_inference_steps"], shift_interval=args["shift_interval"],
                         window_stride=args["window_stride"])
    # K = 3: the windows end at K - 2 = 1, so the only non-empty one starts at 0, at every epoch
    assert [window_start(e, 3, shift_interval=1, window_stride=1) for e in range(4)] == [0, 0, 0, 0]


def test_window_sde_describes_a_scheduled_and_a_pinned_window():
    assert WindowSDESampler().describe() == "window_sde noise_level=0.7 window=4 scheduled"
    pinned = WindowSDESampler(num_inference_steps=6, window_size=2, window_start=3, noise_level=0.5)
    assert pinned.describe() == "window_sde noise_level=0.5 window=2 [3, 4)"  # clipped at K - 2 = 4


def test_window_sde_step_is_flow_grpos_sde_step_at_sigma_one_with_the_second_sigma_and_passes_its_arguments():
    """k = 0 (in the window [0, 1)) of sigmas 1, 0.8, 0.5, 0.2, 0 with a = 0.7: the released Flow-GRPO step replaces
    σ = 1 by σ_max = σ_1 = 0.8 in the denominator of σ_t = a sqrt(σ / (1 − σ)) = 0.7 sqrt(1 / 0.2), σ_t² = 2.45;
    Δt = −0.2, so μ = x (1 + σ_t² Δt / (2σ)) + v (1 + σ_t² (1 − σ) / (2σ)) Δt = 0.755 x − 0.2 v and
    s = σ_t sqrt(0.2) = 0.7.
    k = 1 (outside the window) is the Euler step x + (0.5 − 0.8) v with log-prob 0."""
    schedule = SimpleNamespace(sigmas=torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0]), trainable=None)
    sampler = WindowSDESampler(num_inference_steps=4, window_size=1, window_start=0, noise_level=0.7)
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(2, 1, 2, 2, generator=g), torch.randn(2, 1, 2, 2, generator=g)
    mean, s = 0.755 * x - 0.2 * v, 0.7
    _assert_draws_and_scores(sampler, schedule, 0, v, x, mean, s, sample_atol=1e-5)
    euler = sampler.step(schedule, 1, v, x)
    torch.testing.assert_close(euler.prev_sample, x - 0.3 * v, rtol=0, atol=1e-6)
    assert torch.equal(euler.log_prob, torch.zeros(2))
