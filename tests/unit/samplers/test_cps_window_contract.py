"""CPS (``sampler=cps_sde``) and MixGRPO's window (``sampler=window_sde``): the edges of their steps and schedules,
the sampler's `step` passing its settings on, and the whole text of their refusals (found by mutation testing,
docs/contributing.md#mutation-testing). Expected values are computed by hand from CPS's step (Wang & Yu,
arXiv:2509.05952; the ``cps`` branch of Flow-GRPO's released ``sde_step_with_logprob``) and from MixGRPO's released
window schedule (``GRPOTrainingStates``, re-derived in tests/unit/samplers/test_samplers.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffalign.config.checks import ConfigError
from diffalign.samplers.cps import CPSSampler, cps_step


def _gaussian(x: torch.Tensor, mean: torch.Tensor, std: float, reduce: str) -> torch.Tensor:
    """log N(x; mean, std² I) per row, written out element by element, then averaged or summed."""
    per = (-(x - mean) ** 2 / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)).reshape(len(x), -1)
    return per.mean(dim=1) if reduce == "mean" else per.sum(dim=1)


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
    z = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    sampler = CPSSampler(noise_level=0.5)
    torch.manual_seed(123)  # the global stream differs from the generator's
    out = sampler.step(schedule, 1, v, x, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(out.prev_sample, mean + s * z, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.log_prob, _gaussian(mean + s * z, mean, s, "mean"), rtol=1e-5, atol=1e-5)
    scored = sampler.step(schedule, 1, v, x, prev_sample=mean + 0.1, reduction="sum")
    torch.testing.assert_close(scored.log_prob, _gaussian(mean + 0.1, mean, s, "sum"), rtol=1e-5, atol=1e-4)
