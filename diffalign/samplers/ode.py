"""Deterministic ODE rollouts with diffusers' solvers (DGPO's rollout sampler, docs/methods/algorithms.md#dgpo).

DGPO samples its groups with Flow-DPM-Solver (diffusers `DPMSolverMultistepScheduler` with flow sigmas and shift 3,
10 steps) and no noise; for ε-models the matching choice is DPM-Solver++ 2M
(docs/methods/algorithms.md#dgpo-on-eps-models-and-video). Solvers:

* ``"dpm_solver"`` — `DPMSolverMultistepScheduler` (flow: ``use_flow_sigmas=True, prediction_type="flow_prediction",
  flow_shift=<the policy scheduler's shift>``; ε/v models: DPM-Solver++ from the policy scheduler's config);
* ``"euler"`` — flow models only: the Euler ODE (`FlowMatchEulerDiscreteScheduler`, the SD3 pipeline's sampler);
* ``"ddim"`` — ε/v models only: DDIM with η = 0.

No log-probabilities exist for these samplers; the returned `Trajectory` has zero `log_probs` and `trainable` all
False, `sampler` set to the option name (``dpm_ode``, ``euler_ode``; ``ddim`` with noise 0 for the DDIM solver).

The options ``sampler=dpm_ode`` (`DPMSolverSampler`) and ``sampler=euler_ode`` (`EulerODESampler`) run `ode_rollout`.
``sampler=ode`` (`PipelineODESampler`, the default of evaluation and the monitors) is the deterministic sampler of the
policy's own diffusers pipeline, for either family: DDIM with η = 0 for ε/v models, the Euler ODE for flow models.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from diffalign.models.base import DiffusionPolicy, inference_lora
from diffalign.samplers.base import Sampler, randn_tensor, register_sampler
from diffalign.samplers.ddim_logprob import DDIMSampler
from diffalign.samplers.flow_sde import FlowSDESampler
from diffalign.types import PromptEmbeds, Trajectory

SOLVERS = ("dpm_solver", "euler", "ddim")
OPTION_NAMES = {"dpm_solver": "dpm_ode", "euler": "euler_ode", "ddim": "ddim"}
"""Solver → the sampler option it runs (`Trajectory.sampler`)."""


def make_solver(policy: DiffusionPolicy, solver: str):
    """A fresh diffusers scheduler implementing `solver` for `policy`'s family (see the module docstring).

    Raises:
        ValueError: for an unknown solver or one that does not fit the model family.
    """
    if solver not in SOLVERS:
        raise ValueError(f"`solver` must be one of {SOLVERS}, got {solver!r}.")
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler  # (on first use: see samplers.base.randn_tensor)

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
    fuse_lora: bool = False,
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
        fuse_lora (`bool`, defaults to False): an all-zero LoRA adapter is always skipped (bit for bit the same
            samples, at the bare denoiser's cost); with `fuse_lora` a non-zero one is fused into the weights for the
            rollout and restored afterwards (`diffalign.models.base.inference_lora`; outputs equal up to float
            rounding).

    Returns:
        `Trajectory` with float32 `latents` `(B, K+1, C, h, w)`, the solver's `timesteps` `(K,)`, zero `log_probs`,
        `sampler` = the option name (`OPTION_NAMES`), `sigmas` for flow models, `images` `(B, 3, H, W)` or `None`.

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
    denoiser = getattr(policy, "denoiser", None)
    # an all-zero adapter is skipped (bit for bit the same samples), a non-zero one fused only with `fuse_lora`
    with inference_lora(denoiser, fuse=fuse_lora) if denoiser is not None else contextlib.nullcontext():
        return _solve(policy, prompts, scheduler, num_inference_steps, guidance_scale, solver, generator, latents,
                      prompt_embeds, decode, shape)


def _solve(policy, prompts, scheduler, num_inference_steps, guidance_scale, solver, generator, latents, prompt_embeds,
           decode, shape) -> Trajectory:
    """`ode_rollout`'s loop, after its checks."""
    batch_size, device = len(prompts), policy.device
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
        noise=0.0,
        sigmas=scheduler.sigmas.float().cpu() if is_flow else None,
        sampler=OPTION_NAMES[solver],
    )


@dataclass
class _ODESampler(Sampler):
    """Base of the deterministic options: `sample` runs `ode_rollout` with the class's ``solver``."""

    solver: ClassVar[str] = ""

    def sample(self, policy, prompts, *, generator=None, latents=None, negative_prompts=None, prompt_embeds=None,
               decode=True, reduction="mean", callback=None, enable_grad=False, fuse_lora=False) -> Trajectory:
        """`ode_rollout` with the sampler's solver, steps and guidance (`Sampler.sample`'s arguments; an ODE solver
        takes no negative prompts, step callback or gradients, and stores no log-probs, so `reduction` has no effect).

        Raises:
            ValueError: for `negative_prompts`, `callback` or `enable_grad`, and `ode_rollout`'s errors.
        """
        if negative_prompts is not None or callback is not None or enable_grad:
            raise ValueError(f"sampler={self.name} (an ODE solver) takes no negative_prompts, callback or enable_grad")
        self.fits(policy)
        return ode_rollout(policy, prompts, num_inference_steps=self.num_inference_steps,
                           guidance_scale=self.guidance_scale, solver=self.solver, generator=generator,
                           latents=latents, prompt_embeds=prompt_embeds, decode=decode, fuse_lora=fuse_lora)


@register_sampler
@dataclass
class DPMSolverSampler(_ODESampler):
    """``sampler=dpm_ode``: deterministic DPM-Solver rollouts (DGPO's; flow DPM-Solver with the model's shift for flow
    models, DPM-Solver++ 2M for ε/v models), no log-probs; 10 steps, CFG 4.5."""

    name: str = "dpm_ode"
    model_family: str = "any"
    num_inference_steps: int = 10
    guidance_scale: float = 4.5

    solver: ClassVar[str] = "dpm_solver"


@register_sampler
@dataclass
class EulerODESampler(_ODESampler):
    """``sampler=euler_ode``: the flow Euler ODE (`FlowMatchEulerDiscreteScheduler`, the SD3 pipeline's sampler), flow
    models only, no log-probs; 10 steps, CFG 4.5."""

    name: str = "euler_ode"
    model_family: str = "flow"
    num_inference_steps: int = 10
    guidance_scale: float = 4.5

    solver: ClassVar[str] = "euler"


@register_sampler
@dataclass
class PipelineODESampler(Sampler):
    """``sampler=ode``: the deterministic sampler each family's diffusers pipeline runs by default, for ε/v and flow
    models alike (model_family "any"); 20 steps, CFG 4.0. No log-probs.

    It steps with `for_policy`: ``ddim`` with η = 0 for an ε/v model (`StableDiffusionPipeline.__call__`'s default
    ``eta=0.0``), ``flow_sde`` with noise_level 0 for a flow model (the Euler step x + (σ_{k+1} − σ_k) v̂ of
    `FlowMatchEulerDiscreteScheduler.step`, the `StableDiffusion3Pipeline` / `FluxPipeline` sampler); the trajectory's
    ``sampler`` names that sampler (``ddim`` / ``flow_sde``, noise 0). Why an option of its own rather than a fixed
    ``ddim`` default: evaluation, the reward-hacking monitors and a recipe's reference samples must work for whichever
    model the run loads, and a fixed ε-model sampler would refuse every flow model unless each recipe overrode it.
    Why ``flow_sde`` at noise 0 rather than ``euler_ode``: it is the step rule the evaluation has always sampled flow
    models with, so its images (and every metric) are unchanged bit for bit, and it equals the pipeline's Euler ODE.
    The images are those of the pipelines with the same steps, guidance and generators
    (tests/unit/evaluation/test_eval_sampler.py, tests/unit/samplers/test_rollout.py)."""

    name: str = "ode"
    model_family: str = "any"
    num_inference_steps: int = 20
    guidance_scale: float = 4.0

    def for_policy(self, policy) -> Sampler:
        """The sampler that steps `policy`: `DDIMSampler` (η = 0) for an ε/v model, `FlowSDESampler` (noise_level 0)
        for a flow model (``policy.prediction_type == "flow"``), with this sampler's steps and guidance."""
        if policy.prediction_type == "flow":
            return FlowSDESampler(num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale,
                                  noise_level=0.0)
        return DDIMSampler(num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale, eta=0.0)

    def sample(self, policy, prompts, **kwargs) -> Trajectory:
        """``for_policy(policy).sample(policy, prompts, **kwargs)`` (`Sampler.sample`'s arguments, shapes and
        errors); the trajectory's ``sampler`` is ``ddim`` or ``flow_sde`` with noise 0."""
        return self.for_policy(policy).sample(policy, prompts, **kwargs)
