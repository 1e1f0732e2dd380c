"""The one unrolled denoising loop: sample a batch and record the trajectory and per-step log-probs.

The step rule follows the policy's scheduler: DDIM-η (`ddim_step`) for ε/v models with a `DDIMScheduler`, the
Flow-GRPO SDE (`flow_sde_step`, noise level a = `eta`; a = 0 is the Euler ODE of `FlowMatchEulerDiscreteScheduler`)
for rectified-flow models. With η = 0 and the same scheduler, steps, guidance and generators, the images equal those of
`StableDiffusionPipeline.__call__(..., eta=0.0, generator=...)` (pinned by tests/test_rollout.py); with η > 0 they
equal the pipeline's `eta=η` output too, since the per-step noise is drawn from the same generators in the same order. For
flow models with `eta=0` the images equal `StableDiffusion3Pipeline.__call__` with the same generators.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffalign.models.base import DiffusionPolicy, inference_lora
from diffalign.samplers.ddim_logprob import DDIMStepOutput, ddim_step
from diffalign.samplers.flow_sde import SDE_TYPES, FlowStepOutput, flow_step
from diffalign.types import PromptEmbeds, Trajectory

STOCHASTIC_SAMPLERS = ("ddim", "flow_sde", "dance_sde")  # trajectories with per-step log-probs (when eta > 0)


def _check_rollout_args(policy, prompts, num_inference_steps, generator, prompt_embeds, latents, sde_type):
    """`rollout`'s argument checks (the errors its docstring lists); returns (the policy's scheduler, whether it is a
    flow-matching one, the latents' shape `(B, C, h, w)`)."""
    batch_size = len(prompts)
    if num_inference_steps < 1:
        raise ValueError(f"`num_inference_steps` must be >= 1, got {num_inference_steps}.")
    if isinstance(generator, list) and len(generator) != batch_size:
        raise ValueError(
            f"Got a list of {len(generator)} generators for {batch_size} prompts; pass one generator per image"
            f" ({batch_size}) or a single generator."
        )
    if prompt_embeds is not None and len(prompt_embeds) != batch_size:
        raise ValueError(
            f"`prompt_embeds` has {len(prompt_embeds)} rows for {batch_size} prompts; pass one per prompt."
        )
    scheduler = policy.scheduler
    is_flow = isinstance(scheduler, FlowMatchEulerDiscreteScheduler)
    if not (is_flow or isinstance(scheduler, DDIMScheduler)):
        raise TypeError(f"`rollout` steps with DDIM or the flow SDE/ODE; the policy's scheduler is a "
                        f"{type(scheduler).__name__}.")
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sampler.sde_type={sde_type!r} must be one of {SDE_TYPES}")
    if sde_type != "flow_grpo" and not is_flow:
        raise ValueError(f"sampler.sde_type={sde_type!r} is a flow-matching SDE; this policy's scheduler is "
                         f"{type(scheduler).__name__}: use sampler=ddim (DDIM-η) for ε/v models")
    shape = (batch_size, *policy.latent_shape)
    if latents is not None and tuple(latents.shape) != shape:
        raise ValueError(f"`latents` must have shape {shape}, got {tuple(latents.shape)}.")
    return scheduler, is_flow, shape


def rollout(
    policy: DiffusionPolicy,
    prompts: list[str],
    *,
    num_inference_steps: int = 20,
    guidance_scale: float = 4.0,
    eta: float = 1.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    negative_prompts: list[str] | None = None,
    latents: torch.Tensor | None = None,
    prompt_embeds: PromptEmbeds | None = None,
    decode: bool = True,
    reduction: str = "mean",
    callback: Callable[[dict[str, Any]], None] | None = None,
    enable_grad: bool = False,
    sde_type: str = "flow_grpo",
    fuse_lora: bool = False,
) -> Trajectory:
    """Samples `len(prompts)` images and records the trajectory (DDPO, arXiv:2305.13301, §4.3; Flow-GRPO,
    arXiv:2505.05470, §4.1).

    Each step k draws x_{t'} ~ N(μ_θ(x_t), s_t² I) with `diffalign.samplers.ddim_logprob.ddim_step`
    (docs/methods/algorithms.md#ddim-step) and stores its log-probability; the model output is guided with
    `guidance_scale` exactly as the policy-gradient objective will recompute it (`recompute_log_probs`). Runs under
    `torch.no_grad()` unless `enable_grad=True` (backpropagation through the sampler).

    Args:
        policy (`DiffusionPolicy`): a policy whose `scheduler` is a `DDIMScheduler` (`StableDiffusionPolicy`) or a
            `FlowMatchEulerDiscreteScheduler` (`StableDiffusion3Policy`, `WanPolicy`).
        prompts (`list[str]`): `B` prompts, one per sample (repeat a prompt for several samples of it).
        num_inference_steps (`int`, defaults to 20): K ≥ 1 DDIM steps (`scheduler.set_timesteps(K)` is called).
        guidance_scale (`float`, defaults to 4.0): classifier-free guidance w ≥ 1 (1 disables it).
        eta (`float`, defaults to 1.0): DDIM noise level η, or the SDE noise level a for flow models (Flow-GRPO uses
            0.7); 0 gives the deterministic sampler, whose log-probs are 0.
        generator (`torch.Generator` or list of `B`, *optional*): noise source for the initial latents and every
            step; with one generator per image, image k depends only on generator k
            (docs/guides/field_cases.md#per-image-generators).
        negative_prompts (`list[str]`, *optional*): `B` negative prompts or one for all; default "".
        latents (`torch.Tensor`, *optional*): `(B, C, h, w)` initial noise (multiplied by `init_noise_sigma`, as the
            pipeline does); drawn with `randn_tensor` when not given.
        prompt_embeds (`PromptEmbeds`, *optional*): precomputed embeddings, `B` rows (with negatives if w > 1).
        decode (`bool`, defaults to True): decode the final latents to images.
        reduction (`str`, defaults to "mean"): log-prob reduction over latent elements, "mean" or "sum", or
            "per_position" (sum over channels; `log_probs` is then `(B, K, *grid)`, ViPO).
        callback (`Callable[[dict], None]`, *optional*): called after every step with ``{"i", "t", "x", "x_next",
            "model_output", "mean", "std", "log_prob"}`` (k-diffusion style).
        enable_grad (`bool`, defaults to False): keep the autograd graph through the whole loop.
        sde_type (`str`, defaults to "flow_grpo"): the flow models' SDE, "flow_grpo" (`flow_sde_step`, a = `eta`) or
            "dance" (DanceGRPO's, `dance_sde_step`, η = `eta`; ViPO's sampler). Ignored for DDIM.
        fuse_lora (`bool`, defaults to False): without gradients (`enable_grad=False`) an all-zero LoRA adapter is
            always skipped (bit-for-bit the same samples, at the bare denoiser's cost); with `fuse_lora` a non-zero
            one is fused into the weights for the rollout and restored exactly afterwards
            (`diffalign.models.base.inference_lora`: same samples up to float rounding). For evaluation and data
            preparation; policy-gradient rollouts keep it off, so their stored log-probs are the ones the
            training-time recomputation reproduces exactly.

    Returns:
        `Trajectory` with float32 `latents` `(B, K+1, C, h, w)` (``latents[:, 0]`` the initial noise), `timesteps`
        `(K,)` equal to `scheduler.timesteps`, `log_probs` `(B, K)` float32, `trainable` `(K,)` (False where the step
        std is 0), `images` `(B, 3, H, W)` in [0, 1] or `None`.

    Raises:
        ValueError: if `num_inference_steps < 1`, a generator list, `latents` or `prompt_embeds` does not match the
            batch.
        TypeError: if the policy's scheduler is neither a `DDIMScheduler` nor a `FlowMatchEulerDiscreteScheduler`.
    """
    # 1. check the arguments
    scheduler, is_flow, shape = _check_rollout_args(policy, prompts, num_inference_steps, generator, prompt_embeds,
                                                    latents, sde_type)

    denoiser = getattr(policy, "denoiser", None)
    lora_context = (inference_lora(denoiser, fuse=fuse_lora) if denoiser is not None and not enable_grad
                    else contextlib.nullcontext())
    with torch.set_grad_enabled(enable_grad), lora_context:
        # 2. encode the prompts (negatives only with guidance)
        if prompt_embeds is None:
            prompt_embeds = policy.encode_prompts(prompts, negative_prompts,
                                                  do_classifier_free_guidance=guidance_scale > 1)

        # 3. timesteps, e.g. [981, 961, ..., 1] for 50 SD steps
        device = policy.device
        scheduler.set_timesteps(num_inference_steps, device=device)
        timesteps = scheduler.timesteps
        sigmas = scheduler.sigmas.float() if is_flow else None

        # 4. initial noise, drawn as `StableDiffusionPipeline.prepare_latents` draws it
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=policy.dtype)
        latents = (latents.to(device) * getattr(scheduler, "init_noise_sigma", 1.0)).float()

        # 5. denoise, recording x_t, log π(x_{t'} | x_t) and the step std
        all_latents, log_probs, stds = [latents], [], []
        for i, t in enumerate(timesteps):
            model_output = policy.predict(latents, t, prompt_embeds, guidance_scale)
            if is_flow:
                step = flow_step(model_output, sigmas[i], sigmas[i + 1], latents, sde_type=sde_type, eta=eta,
                                 sigma_max=float(sigmas[1]), generator=generator, reduction=reduction)
            else:
                step = ddim_step(scheduler, model_output, t, latents, eta=eta, generator=generator,
                                 reduction=reduction)
            if callback is not None:
                callback({"i": i, "t": t, "x": latents, "x_next": step.prev_sample, "model_output": model_output,
                          "mean": step.mean, "std": step.std, "log_prob": step.log_prob})
            latents = step.prev_sample
            all_latents.append(latents)
            log_probs.append(step.log_prob)
            stds.append(torch.as_tensor(step.std).reshape(-1)[0])

        # 6. decode
        images = policy.decode(latents) if decode else None

    return Trajectory(
        latents=torch.stack(all_latents, dim=1), timesteps=timesteps.clone(), log_probs=torch.stack(log_probs, dim=1),
        trainable=torch.stack(stds) > 0, prompt_embeds=prompt_embeds, images=images, prompts=list(prompts),
        guidance_scale=guidance_scale, eta=eta, sigmas=None if sigmas is None else sigmas.cpu(),
        sampler=("flow_sde" if sde_type == "flow_grpo" else "dance_sde") if is_flow else "ddim",
    )


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

    The stored next latent is scored (not resampled), the guidance and η are the rollout's, and each step runs the
    same batch the rollout ran, so before any update the result equals `trajectory.log_probs[:, step_indices]` and
    the PPO ratio exp(new − old) is 1. Gradients flow to the trainable parameters unless called under
    `torch.no_grad()`; call it with one index at a time to backpropagate step by step.

    Args:
        policy (`DiffusionPolicy`): the policy that produced `trajectory` (possibly updated since).
        trajectory (`Trajectory`): a rollout with η > 0.
        step_indices (`Sequence[int]` or `torch.Tensor`): `S` step indices k in [0, K).
        guidance_scale (`float`, *optional*): defaults to `trajectory.guidance_scale`.
        reduction (`str`, defaults to "mean"): must be the reduction the rollout used.
        detach_unconditional (`bool`, defaults to False): stop gradients through the unconditional CFG branch
            (Flow-GRPO, ViPO; docs/methods/algorithms.md#classifier-free-guidance); the value is unchanged.

    Returns:
        `torch.Tensor` `(B, S)` float32; 0 at steps whose std is 0 (`trajectory.trainable[k]` False).

    Raises:
        ValueError: if the trajectory was sampled with η = 0 or an index is outside [0, K).
    """
    num_steps = len(trajectory.timesteps)
    indices = [int(k) for k in step_indices]
    if trajectory.eta <= 0:
        raise ValueError("The trajectory was sampled with eta=0 (deterministic), so it has no log-probs; use eta > 0.")
    if trajectory.sampler not in STOCHASTIC_SAMPLERS:
        raise ValueError(f"A {trajectory.sampler!r} trajectory is deterministic and has no log-probs; sample with the"
                         " DDIM-η or flow SDE rollout.")
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
) -> DDIMStepOutput | FlowStepOutput:
    """Re-evaluates stored transition `k` of every rollout in `trajectory` and returns the whole step output (mean,
    std and log-prob of the stored next latent) — what policy-gradient objectives with a KL term need
    (`recompute_log_probs` returns only the log-probs). Gradients flow unless called under `torch.no_grad()`.

    Returns:
        `DDIMStepOutput` or `FlowStepOutput` (`mean` `(B, C, h, w)`, `std`, `log_prob` `(B,)`).

    Raises:
        ValueError: as `recompute_log_probs`.
    """
    num_steps = len(trajectory.timesteps)
    if trajectory.eta <= 0 or trajectory.sampler not in STOCHASTIC_SAMPLERS:
        raise ValueError("The trajectory is deterministic (eta=0 or an ODE solver) and has no log-probs; sample with"
                         " the DDIM-η or flow SDE rollout and eta > 0.")
    if not 0 <= k < num_steps:
        raise ValueError(f"step index {k} must lie in [0, {num_steps}).")
    scheduler = policy.scheduler
    is_flow = trajectory.sampler in ("flow_sde", "dance_sde")
    if not is_flow and scheduler.num_inference_steps != num_steps:
        scheduler.set_timesteps(num_steps, device=policy.device)
    guidance_scale = trajectory.guidance_scale if guidance_scale is None else guidance_scale
    device = trajectory.latents.device
    sample, next_sample = trajectory.latents[:, k], trajectory.latents[:, k + 1]
    t = trajectory.timesteps[k].to(device)
    kwargs = {"detach_unconditional": True} if detach_unconditional else {}
    model_output = policy.predict(sample, t, trajectory.prompt_embeds, guidance_scale, **kwargs)
    if is_flow:
        sigmas = trajectory.sigmas.to(device)
        return flow_step(model_output, sigmas[k], sigmas[k + 1], sample,
                         sde_type="dance" if trajectory.sampler == "dance_sde" else "flow_grpo", eta=trajectory.eta,
                         sigma_max=float(sigmas[1]), prev_sample=next_sample, reduction=reduction)
    return ddim_step(scheduler, model_output, t, sample, eta=trajectory.eta, prev_sample=next_sample,
                     reduction=reduction)
