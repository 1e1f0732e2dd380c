"""Evaluation and the reward-hacking monitors sample with a sampler node (``eval.sampler``, ``monitor.sampler``), by
default ``sampler=ode``: for an ε model and a flow model their images are those of the model's own diffusers pipeline
(`StableDiffusionPipeline` with its default η = 0, `StableDiffusion3Pipeline`'s Euler ODE) with the same steps,
guidance and per-image generators, computed here by the pipelines themselves."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_cfg
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

from diffalign.evaluation.generation import EvalConfig, eval_config_from, image_seed, sample_images
from diffalign.evaluation.monitors import HackingMonitor
from diffalign.models.tiny_flow import TINY_MAX_SEQUENCE_LENGTH, build_tiny_flow_pipeline
from diffalign.samplers.ode import PipelineODESampler
from diffalign.samplers.rollout import rollout
from diffalign.types import RewardOutput

ROWS = [{"prompt": "a red circle"}, {"prompt": "two blue squares"}]
JOBS = [(0, 0), (1, 0), (0, 3), (1, 3)]  # (prompt index, seed)
MONITOR_ORDER = [0, 2, 1, 3]  # the monitor samples by prompt, each prompt's seeds together: JOBS in that order
STEPS, GUIDANCE = 4, 4.0


class RecordingReward:
    """A reward that keeps the images it scores (the monitor returns only metrics)."""

    def __init__(self):
        self.images = []

    def __call__(self, images, prompts, metadata=None):
        self.images.append(images.float().clone())
        return RewardOutput(scores=images.float().flatten(1).mean(1))


def flow_policy():
    from diffalign.models.sd3 import StableDiffusion3Policy

    pipe = build_tiny_flow_pipeline(seed=3)
    return StableDiffusion3Policy(pipe, lora_rank=4, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH), pipe


def pipeline_images(pipe, jobs, **kwargs):
    """The pipeline's images of `jobs`, each from ``torch.Generator().manual_seed(image_seed(seed, prompt))``."""
    gens = [torch.Generator().manual_seed(image_seed(s, p)) for p, s in jobs]
    return pipe([ROWS[p]["prompt"] for p, _ in jobs], num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                generator=gens, output_type="pt", **kwargs).images


def test_the_default_eval_and_monitor_sampler_is_ode_with_the_pipeline_settings():
    cfg = compose_cfg([])
    for node in (cfg.monitor.sampler, compose_cfg([], name="evaluate").eval.sampler):
        assert dict(node) == {"name": "ode", "model_family": "any", "num_inference_steps": 20, "guidance_scale": 4.0}
    # tiny_dpo (the default recipe) evaluates at 10 steps; a field is overridden in place, another option selected
    assert eval_config_from(cfg.eval).sampler == PipelineODESampler(num_inference_steps=10)
    ddim = eval_config_from(compose_cfg(["sampler@eval.sampler=ddim", "eval.sampler.eta=0.5"]).eval).sampler
    assert (ddim.name, ddim.eta, ddim.num_inference_steps) == ("ddim", 0.5, 10)


def test_eval_and_monitor_images_of_an_eps_model_are_the_sd_pipelines(tiny_policy):
    pipe = tiny_policy.to_pipeline()
    assert isinstance(pipe.scheduler, DDIMScheduler)
    expected = pipeline_images(pipe, JOBS)  # (StableDiffusionPipeline's default eta is 0.0)
    cfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": STEPS, "guidance_scale": GUIDANCE})
    torch.testing.assert_close(sample_images(tiny_policy, JOBS, ROWS, cfg, use_reference=False), expected,
                               rtol=0, atol=1e-5)
    reward = RecordingReward()
    HackingMonitor({"r": reward}, ROWS, [0, 3], every=1, sampler=cfg.sampler).measure(tiny_policy)
    torch.testing.assert_close(reward.images[0], expected[MONITOR_ORDER], rtol=0, atol=1e-5)
    # the adapter matters, so the comparison could fail
    assert (sample_images(tiny_policy, JOBS, ROWS, cfg, use_reference=True) - expected).abs().max() > 1e-3


def test_eval_and_monitor_images_of_a_flow_model_are_the_sd3_pipelines():
    policy, pipe = flow_policy()
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    expected = pipeline_images(pipe, JOBS, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)
    cfg = EvalConfig(sampler={"name": "ode", "num_inference_steps": STEPS, "guidance_scale": GUIDANCE})
    torch.testing.assert_close(sample_images(policy, JOBS, ROWS, cfg, use_reference=True), expected,
                               rtol=0, atol=1e-4)
    reward = RecordingReward()
    with policy.reference():
        HackingMonitor({"r": reward}, ROWS, [0, 3], every=1, sampler=cfg.sampler).measure(policy)
    torch.testing.assert_close(reward.images[0], expected[MONITOR_ORDER], rtol=0, atol=1e-4)
    # the steps matter, so the comparison could fail
    fewer = EvalConfig(sampler={"name": "ode", "num_inference_steps": STEPS - 1, "guidance_scale": GUIDANCE})
    assert (sample_images(policy, JOBS, ROWS, fewer, use_reference=True) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("flow", [False, True])
def test_ode_steps_with_the_family_sampler_and_the_trajectory_names_it(tiny_policy, flow):
    policy = flow_policy()[0] if flow else tiny_policy
    sampler = PipelineODESampler(num_inference_steps=3, guidance_scale=2.0)
    stepping = sampler.for_policy(policy)
    assert (stepping.name, stepping.noise, stepping.num_inference_steps, stepping.guidance_scale) == (
        "flow_sde" if flow else "ddim", 0.0, 3, 2.0)
    trajectory = rollout(policy, ["a red circle"], sampler, generator=torch.Generator().manual_seed(0), decode=False)
    assert trajectory.sampler == stepping.name and trajectory.noise == 0.0 and not trajectory.trainable.any()
    with pytest.raises(ValueError, match="deterministic"):  # no log-probs to re-score
        from diffalign.samplers.rollout import recompute_log_probs

        recompute_log_probs(policy, trajectory, [0])
