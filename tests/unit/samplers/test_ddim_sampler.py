"""`sampler=ddim` (`DDIMSampler`) without a model: its defaults, its check, the schedule it sets on the policy's
scheduler, the schedule of a stored trajectory and the step it delegates to `ddim_step` — the wiring that the rollout
tests (tests/unit/samplers/test_rollout.py) cover only through whole rollouts, found by mutation testing
(docs/contributing.md#mutation-testing)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from diffalign.config.checks import ConfigError
from diffalign.samplers.ddim_logprob import DDIMSampler, ddim_step


def policy_with(scheduler):
    return SimpleNamespace(scheduler=scheduler, device=torch.device("cpu"))


def test_defaults_are_ddpos_ancestral_rollouts():
    """η = 1 (DDPO's rollouts), 20 steps and CFG 4 unless set; η = 0 is deterministic and stores no log-probs."""
    sampler = DDIMSampler()
    assert (sampler.name, sampler.model_family, sampler.num_inference_steps, sampler.guidance_scale, sampler.eta) == (
        "ddim", "eps", 20, 4.0, 1.0)
    assert sampler.stochastic and sampler.describe() == "ddim eta=1.0"
    assert not DDIMSampler(eta=0.0).stochastic


def test_check_names_eta_and_the_fix():
    DDIMSampler(eta=0.0)  # the boundary is allowed
    message = r"^eta must be a number >= 0, got -0.1; DDIM's eta; 0 is deterministic DDIM$"
    with pytest.raises(ConfigError, match=message):
        DDIMSampler(eta=-0.1)


def test_schedule_sets_the_steps_on_the_policys_ddim_scheduler():
    """diffusers' "leading" spacing of 1000 training steps into 20: 950, 900, ..., 0."""
    scheduler = DDIMScheduler()
    schedule = DDIMSampler(num_inference_steps=20).schedule(policy_with(scheduler))
    assert schedule.scheduler is scheduler and scheduler.num_inference_steps == 20
    assert schedule.timesteps.tolist() == list(range(950, -1, -50))
    assert schedule.sigmas is None and schedule.trainable is None


def test_schedule_refuses_another_scheduler():
    with pytest.raises(TypeError, match=r"^sampler=ddim steps with a DDIMScheduler; the policy's scheduler is a "
                                        r"FlowMatchEulerDiscreteScheduler$"):
        DDIMSampler().schedule(policy_with(FlowMatchEulerDiscreteScheduler()))


def test_stored_schedule_is_the_trajectorys_and_resets_the_step_count():
    """A trajectory sampled with 10 steps is re-scored with a 10-step scheduler (t' = t − 100), whatever the scheduler
    was last set to; its own timesteps and trainable mask are used."""
    scheduler = DDIMScheduler()
    scheduler.set_timesteps(50)
    trajectory = SimpleNamespace(timesteps=torch.arange(900, -1, -100), latents=torch.zeros(1, 11, 4, 2, 2),
                                 trainable=torch.tensor([True] * 9 + [False]))
    schedule = DDIMSampler().stored_schedule(policy_with(scheduler), trajectory)
    assert scheduler.num_inference_steps == 10
    assert torch.equal(schedule.timesteps, trajectory.timesteps) and schedule.trainable is trajectory.trainable
    assert schedule.scheduler is scheduler and schedule.sigmas is None
    calls = []
    scheduler.set_timesteps = lambda *args, **kwargs: calls.append(args)  # already 10 steps: left as it is
    DDIMSampler().stored_schedule(policy_with(scheduler), trajectory)
    assert calls == []


def test_step_is_ddim_step_with_the_samplers_eta():
    scheduler = DDIMScheduler()
    sampler = DDIMSampler(num_inference_steps=10, eta=0.7)
    schedule = sampler.schedule(policy_with(scheduler))
    gen = torch.Generator().manual_seed(0)
    out, sample, prev = (torch.randn(2, 4, 2, 2, generator=gen) for _ in range(3))
    got = sampler.step(schedule, 3, out, sample, prev_sample=prev, reduction="sum")
    expected = ddim_step(scheduler, out, schedule.timesteps[3], sample, eta=0.7, prev_sample=prev, reduction="sum")
    torch.testing.assert_close(got.log_prob, expected.log_prob)
    torch.testing.assert_close(got.mean, expected.mean)
    other_eta = ddim_step(scheduler, out, schedule.timesteps[3], sample, eta=1.0, prev_sample=prev, reduction="sum")
    assert not torch.allclose(got.log_prob, other_eta.log_prob)
    other_k = ddim_step(scheduler, out, schedule.timesteps[4], sample, eta=0.7, prev_sample=prev, reduction="sum")
    assert not torch.allclose(got.log_prob, other_k.log_prob)
    drawn = sampler.step(schedule, 3, out, sample, generator=torch.Generator().manual_seed(5))
    again = ddim_step(scheduler, out, schedule.timesteps[3], sample, eta=0.7,
                      generator=torch.Generator().manual_seed(5))
    assert torch.equal(drawn.prev_sample, again.prev_sample) and drawn.log_prob.shape == (2,)
