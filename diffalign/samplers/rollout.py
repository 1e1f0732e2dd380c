"""Sampling a batch with a `Sampler` and re-scoring the stored transitions of a trajectory.

`rollout` is ``sampler.sample(policy, prompts, ...)`` (`diffalign.samplers.base.Sampler.sample`: the one unrolled
denoising loop, which records the trajectory and per-step log-probs); `recompute_log_probs` / `recompute_step`
re-evaluate stored transitions under the policy's current parameters with the step rule of the sampler that produced
them (``trajectory.sampler``). With DDIM η = 0 and the same scheduler, steps, guidance and generators the images equal
those of `StableDiffusionPipeline.__call__(..., eta=0.0, generator=...)` (pinned by tests/unit/samplers/test_rollout.py); for flow
models with ``sampler=flow_sde`` at noise_level 0 they equal `StableDiffusion3Pipeline.__call__`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffalign.models.base import DiffusionPolicy
from diffalign.samplers.base import Sampler, StepOutput, sampler_class
from diffalign.types import Trajectory


def rollout(policy: DiffusionPolicy, prompts: list[str], sampler: Sampler, **kwargs) -> Trajectory:
    """Samples `len(prompts)` images with `sampler` and records the trajectory: ``sampler.sample(policy, prompts,
    **kwargs)`` (generator, latents, negative_prompts, prompt_embeds, decode, reduction, callback, enable_grad,
    fuse_lora; `diffalign.samplers.base.Sampler.sample` documents them, their shapes and errors)."""
    return sampler.sample(policy, prompts, **kwargs)


def recompute_log_probs(
    policy: DiffusionPolicy,
    trajectory: Trajectory,
    step_indices: Sequence[int] | torch.Tensor,
    *,
    guidance_scale: float | None = None,
    reduction: str = "mean",
    detach_unconditional: bool = False,
) -> torch.Tensor:
    """Re-evaluates log π_θ(x_{k+1} | x_k) of stored transitions with the policy's current parameters.

    The stored next latent is scored (not resampled), the guidance and noise are the rollout's, and each step runs the
    same batch the rollout ran, so before any update the result equals `trajectory.log_probs[:, step_indices]` and
    the PPO ratio exp(new − old) is 1. Gradients flow to the trainable parameters unless called under
    `torch.no_grad()`; call it with one index at a time to backpropagate step by step.

    Args:
        policy (`DiffusionPolicy`): the policy that produced `trajectory` (possibly updated since).
        trajectory (`Trajectory`): a rollout of a sampler with log-probs and a noise > 0.
        step_indices (`Sequence[int]` or `torch.Tensor`): `S` step indices k in [0, K).
        guidance_scale (`float`, *optional*): defaults to `trajectory.guidance_scale`.
        reduction (`str`, defaults to "mean"): must be the reduction the rollout used.
        detach_unconditional (`bool`, defaults to False): stop gradients through the unconditional CFG branch
            (Flow-GRPO, ViPO; docs/methods/algorithms.md#classifier-free-guidance); the value is unchanged.

    Returns:
        `torch.Tensor` `(B, S)` float32; 0 at steps whose std is 0 (`trajectory.trainable[k]` False).

    Raises:
        ValueError: if the trajectory is deterministic (noise 0, or an ODE solver) or an index is outside [0, K).
    """
    num_steps = len(trajectory.timesteps)
    indices = [int(k) for k in step_indices]
    _stochastic_sampler(trajectory)
    if any(k < 0 or k >= num_steps for k in indices):
        raise ValueError(f"`step_indices` {indices} must lie in [0, {num_steps}) for a {num_steps}-step trajectory.")
    log_probs = [
        recompute_step(policy, trajectory, k, guidance_scale=guidance_scale, reduction=reduction,
                       detach_unconditional=detach_unconditional).log_prob
        for k in indices
    ]
    return torch.stack(log_probs, dim=1)


def recompute_step(
    policy: DiffusionPolicy,
    trajectory: Trajectory,
    k: int,
    *,
    guidance_scale: float | None = None,
    reduction: str = "mean",
    detach_unconditional: bool = False,
) -> StepOutput:
    """Re-evaluates stored transition `k` of every rollout in `trajectory` and returns the whole step output (mean,
    std and log-prob of the stored next latent) — what policy-gradient objectives with a KL term need
    (`recompute_log_probs` returns only the log-probs). Gradients flow unless called under `torch.no_grad()`.

    Returns:
        The sampler's step output, e.g. `DDIMStepOutput` or `FlowStepOutput` (`mean`, `std`, `log_prob` `(B,)`).

    Raises:
        ValueError: as `recompute_log_probs`.
    """
    num_steps = len(trajectory.timesteps)
    sampler = _stochastic_sampler(trajectory)
    if not 0 <= k < num_steps:
        raise ValueError(f"step index {k} must lie in [0, {num_steps}).")
    schedule = sampler.stored_schedule(policy, trajectory)
    guidance_scale = trajectory.guidance_scale if guidance_scale is None else guidance_scale
    sample, next_sample = trajectory.latents[:, k], trajectory.latents[:, k + 1]
    kwargs = {"detach_unconditional": True} if detach_unconditional else {}
    model_output = policy.predict(sample, schedule.timesteps[k], trajectory.prompt_embeds, guidance_scale, **kwargs)
    return sampler.step(schedule, k, model_output, sample, prev_sample=next_sample, reduction=reduction)


def _stochastic_sampler(trajectory: Trajectory) -> Sampler:
    """The sampler that produced `trajectory` (`Sampler.for_trajectory`). Raises ValueError for a deterministic one
    (an ODE solver, or a noise of 0), which has no log-probs."""
    cls = sampler_class(trajectory.sampler)
    if not cls.log_probs or trajectory.noise <= 0:
        raise ValueError(f"The trajectory is deterministic (sampler={trajectory.sampler}, noise {trajectory.noise}) and "
                         "has no log-probs; sample with a stochastic sampler (sampler=ddim with sampler.eta > 0, or a "
                         "flow SDE with sampler.noise_level > 0).")
    return cls.for_trajectory(trajectory)
