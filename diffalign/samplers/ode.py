"""Deterministic ODE rollouts with diffusers' solvers (DGPO's rollout sampler, docs/methods/algorithms.md#dgpo).

DGPO samples its groups with Flow-DPM-Solver (diffusers `DPMSolverMultistepScheduler` with flow sigmas and shift 3,
10 steps) and no noise; for ε-models the matching choice is DPM-Solver++ 2M
(docs/methods/algorithms.md#dgpo-on-eps-models-and-video). Solvers:

* ``"dpm_solver"`` — `DPMSolverMultistepScheduler` (flow: ``use_flow_sigmas=True, prediction_type="flow_prediction",
  flow_shift=<the policy scheduler's shift>``; ε/v models: DPM-Solver++ from the policy scheduler's config);
* ``"euler"`` — flow models only: the Euler ODE (`FlowMatchEulerDiscreteScheduler`, the SD3 pipeline's sampler);
* ``"ddim"`` — ε/v models only: DDIM with η = 0.

No log-probabilities exist for these samplers; the returned `Trajectory` has zero `log_probs` and `trainable` all
False, `sampler` set to the solver's name.
"""

from __future__ import annotations

import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffalign.models.base import DiffusionPolicy
from diffalign.types import PromptEmbeds, Trajectory

SOLVERS = ("dpm_solver", "euler", "ddim")


def make_solver(policy: DiffusionPolicy, solver: str):
    """A fresh diffusers scheduler implementing `solver` for `policy`'s family (see the module docstring).

    Raises:
        ValueError: for an unknown solver or one that does not fit the model family.
    """
    if solver not in SOLVERS:
        raise ValueError(f"`solver` must be one of {SOLVERS}, got {solver!r}.")
    is_flow = policy.prediction_type == "flow"
    config = policy.scheduler.config
    if solver == "dpm_solver":
        if is_flow:  # (FLUX's resolution-dependent shift exp(μ) is its scheduler's `effective_shift`)
            shift = getattr(policy.scheduler, "effective_shift", None) or config.get("shift", 1.0)
            return DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                               flow_shift=float(shift),
                                               num_train_timesteps=config.num_train_timesteps)
        return DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++", solver_order=2)
    if solver == "euler":
        if not is_flow:
            raise ValueError("solver='euler' is the flow-matching ODE; for ε/v models use 'ddim' or 'dpm_solver'.")
        return type(policy.scheduler).from_config(config)  # (FLUX's subclass keeps FluxPipeline's schedule)
    if is_flow:
        raise ValueError("solver='ddim' needs an ε/v model; for flow models use 'euler' or 'dpm_solver'.")
    return DDIMScheduler.from_config(config)


@torch.no_grad()
def ode_rollout(
    policy: DiffusionPolicy,
    prompts: list[str],
    *,
    num_inference_steps: int = 10,
    guidance_scale: float = 4.5,
    solver: str = "dpm_solver",
    generator: torch.Generator | list[torch.Generator] | None = None,
    latents: torch.Tensor | None = None,
    prompt_embeds: PromptEmbeds | None = None,
    decode: bool = True,
) -> Trajectory:
    """Samples `len(prompts)` images with a deterministic ODE solver (no gradients).

    Args:
        policy (`DiffusionPolicy`): an SD-family or flow-matching policy.
        prompts (`list[str]`): `B` prompts (repeat a prompt for a group).
        num_inference_steps (`int`, defaults to 10): solver steps K ≥ 1 (DGPO: 10).
        guidance_scale (`float`, defaults to 4.5): rollout CFG scale w ≥ 1 (DGPO mode 1: 4.5; CFG-free mode: 1).
        solver (`str`, defaults to "dpm_solver"): see the module docstring.
        generator: initial-noise source (one per image for per-image reproducibility).
        latents (`torch.Tensor`, *optional*): `(B, C, h, w)` initial noise (scaled by the solver's
            `init_noise_sigma`).
        prompt_embeds (`PromptEmbeds`, *optional*): `B` rows (with negatives when w > 1).
        decode (`bool`, defaults to True): decode the final latents to images in [0, 1].

    Returns:
        `Trajectory` with float32 `latents` `(B, K+1, C, h, w)`, the solver's `timesteps` `(K,)`, zero `log_probs`,
        `sampler` = `solver`, `sigmas` for flow models, `images` `(B, 3, H, W)` or `None`.

    Raises:
        ValueError: for `num_inference_steps < 1`, a bad solver, or inputs whose batch does not match `prompts`.
    """
    batch_size = len(prompts)
    if num_inference_steps < 1:
        raise ValueError(f"`num_inference_steps` must be >= 1, got {num_inference_steps}.")
    if isinstance(generator, list) and len(generator) != batch_size:
        raise ValueError(f"Got {len(generator)} generators for {batch_size} prompts; pass one per image.")
    shape = (batch_size, *policy.latent_shape)
    if latents is not None and tuple(latents.shape) != shape:
        raise ValueError(f"`latents` must have shape {shape}, got {tuple(latents.shape)}.")
    scheduler = make_solver(policy, solver)
    device = policy.device
    if prompt_embeds is None:
        prompt_embeds = policy.encode_prompts(prompts, do_classifier_free_guidance=guidance_scale > 1)
    if len(prompt_embeds) != batch_size:
        raise ValueError(f"`prompt_embeds` has {len(prompt_embeds)} rows for {batch_size} prompts.")
    scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = scheduler.timesteps
    if latents is None:
        latents = randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
    latents = (latents.to(device).float() * getattr(scheduler, "init_noise_sigma", 1.0)).float()
    all_latents = [latents]
    for t in timesteps:
        model_output = policy.predict(latents, t, prompt_embeds, guidance_scale)
        latents = scheduler.step(model_output, t, latents, return_dict=False)[0].float()
        all_latents.append(latents)
    images = policy.decode(latents) if decode else None
    is_flow = policy.prediction_type == "flow"
    return Trajectory(
        latents=torch.stack(all_latents, dim=1),
        timesteps=timesteps.clone().cpu(),
        log_probs=torch.zeros(batch_size, len(timesteps)),
        trainable=torch.zeros(len(timesteps), dtype=torch.bool),
        prompt_embeds=prompt_embeds,
        images=images,
        prompts=list(prompts),
        guidance_scale=guidance_scale,
        eta=0.0,
        sigmas=scheduler.sigmas.float().cpu() if is_flow else None,
        sampler=solver,
    )
