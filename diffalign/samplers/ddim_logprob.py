# Mirrors `diffusers.schedulers.scheduling_ddim.DDIMScheduler.step` (diffusers==0.42.1), written against the installed
# package and pinned by tests/unit/samplers/test_ddim_logprob.py, with these differences:
# - It returns the Gaussian transition's mean, std and the log-probability of `prev_sample`
# (docs/methods/algorithms.md#ddim-step; DDPO, arXiv:2305.13301, eq. 4 with the DDIM posterior of arXiv:2010.02502, eq.
# 12 and 16).
# - `prev_sample` may be given, in which case it is scored instead of sampled (the policy-gradient contract).
# - All arithmetic runs in float32 whatever the input dtype (fp16/bf16 inputs are upcast;
#   docs/guides/field_cases.md#half-precision-nans).
# - `timestep` may be a scalar or one timestep per sample, shape `(B,)`.
# - A list of generators must have one generator per sample (diffusers' `randn_tensor` would silently use the first B).
# - Where the std is 0 (eta = 0, or the final step of a schedule whose final alpha is 1) the log-prob is 0 instead of
#   NaN/inf (docs/guides/field_cases.md#log-prob-at-the-last-denoising-step).
# - `thresholding` (dynamic thresholding) and `use_clipped_model_output` are not supported; `clip_sample` is.
# - No `variance_noise` argument and no `return_dict`; `prediction_type` may override the scheduler config.
"""DDIM step with a per-step Gaussian log-probability, for policy-gradient objectives (DDPO, GRPO-style)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from diffalign.config.checks import number
from diffalign.samplers.base import Sampler, Schedule, randn_tensor, register_sampler

if TYPE_CHECKING:
    from diffusers import DDIMScheduler

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
REDUCTIONS = ("mean", "sum", "per_position")
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class DDIMStepOutput:
    """Output of `ddim_step`. Every tensor is float32.

    Attributes:
        prev_sample: `(B, ...)` the sample x_{t'} after the step (drawn, or the `prev_sample` that was passed in).
        mean: `(B, ...)` the mean μ_θ of the Gaussian transition; gradients flow to the model only through it.
        std: `(B, 1, ..., 1)` (or 0-dim for a scalar timestep) the std s_t = η·sqrt(variance), broadcastable to the
            sample; it does not depend on the model.
        log_prob: `(B,)` log N(prev_sample; mean, std² I), reduced over every non-batch element by `reduction`
            ("mean": nats per element, the DDPO convention; "sum": nats per sample). 0 where `std == 0`.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


def _alphas(scheduler: DDIMScheduler, timestep: torch.Tensor | int, device: torch.device, ndim: int):
    """Returns (ᾱ_t, ᾱ_{t'}) as float32 tensors broadcastable to a sample with `ndim` dims."""
    if scheduler.num_inference_steps is None:
        raise ValueError("`scheduler.num_inference_steps` is None: call `scheduler.set_timesteps(N)` before stepping.")
    # Keep the schedule on the sample's device, as `DDIMScheduler.add_noise` does, so no step copies host->device.
    if scheduler.alphas_cumprod.device != device:
        scheduler.alphas_cumprod = scheduler.alphas_cumprod.to(device)
    if scheduler.final_alpha_cumprod.device != device:
        scheduler.final_alpha_cumprod = scheduler.final_alpha_cumprod.to(device)
    final_alpha_cumprod = scheduler.final_alpha_cumprod.to(torch.float32)
    t = torch.as_tensor(timestep, device=device)
    if t.ndim > 1:
        raise ValueError(f"`timestep` must be a scalar or have shape (B,), got shape {tuple(t.shape)}.")
    t = t.long()
    prev_t = t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps
    alphas_cumprod = scheduler.alphas_cumprod.to(torch.float32)
    alpha_prod_t = alphas_cumprod[t]
    alpha_prod_t_prev = torch.where(prev_t >= 0, alphas_cumprod[prev_t.clamp(min=0)], final_alpha_cumprod)
    if t.ndim == 1:
        shape = (-1,) + (1,) * (ndim - 1)
        alpha_prod_t, alpha_prod_t_prev = alpha_prod_t.view(shape), alpha_prod_t_prev.view(shape)
    return alpha_prod_t, alpha_prod_t_prev


def ddim_variance(scheduler: DDIMScheduler, timestep: torch.Tensor | int) -> torch.Tensor:
    """Variance of the DDIM posterior at η = 1 (DDIM arXiv:2010.02502, eq. 16; `DDIMScheduler._get_variance`).

    variance = (1 - ᾱ_{t'}) / (1 - ᾱ_t) · (1 - ᾱ_t / ᾱ_{t'}), with t' = t - num_train_timesteps // N and
    ᾱ_{t'} = `scheduler.final_alpha_cumprod` when t' < 0. The step's std is η·sqrt(variance).

    Args:
        scheduler (`DDIMScheduler`): a scheduler on which `set_timesteps(N)` has been called.
        timestep (`int` or `torch.Tensor`): a scalar or `(B,)` timesteps from `scheduler.timesteps`.

    Returns:
        `torch.Tensor` float32, shape of `timestep`, ≥ 0 (e.g. 4.2635e-4 at t = 1 of a 50-step SD1.5 schedule with
        `set_alpha_to_one=False`; exactly 0 there with `set_alpha_to_one=True`).

    Raises:
        ValueError: if `set_timesteps` was not called or `timestep` has more than one dimension.
    """
    device = timestep.device if isinstance(timestep, torch.Tensor) else scheduler.alphas_cumprod.device
    alpha_prod_t, alpha_prod_t_prev = _alphas(scheduler, timestep, device, ndim=1)
    beta_prod_t, beta_prod_t_prev = 1 - alpha_prod_t, 1 - alpha_prod_t_prev
    return (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)


def _check_step_args(scheduler, model_output, sample, prev_sample, generator, prediction_type, reduction, eta
                     ) -> None:
    """`ddim_step`'s argument checks (the ValueErrors its docstring lists)."""
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"`prediction_type` must be one of {PREDICTION_TYPES}, got {prediction_type!r}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"`reduction` must be one of {REDUCTIONS}, got {reduction!r}.")
    if eta < 0:
        raise ValueError(f"`eta` must be >= 0, got {eta}.")
    if scheduler.config.thresholding:
        raise ValueError("`scheduler.config.thresholding=True` is not supported by `ddim_step`; set it to False.")
    if model_output.shape != sample.shape:
        raise ValueError(
            f"`model_output` shape {tuple(model_output.shape)} must equal `sample` shape {tuple(sample.shape)}."
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"`prev_sample` shape {tuple(prev_sample.shape)} must equal `sample` shape {tuple(sample.shape)}."
        )
    if isinstance(generator, list) and len(generator) != sample.shape[0]:
        raise ValueError(
            f"Got a list of {len(generator)} generators for a batch of {sample.shape[0]} samples; pass one generator"
            " per sample."
        )


def ddim_step(
    scheduler: DDIMScheduler,
    model_output: torch.Tensor,
    timestep: torch.Tensor | int,
    sample: torch.Tensor,
    *,
    eta: float = 0.0,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    prediction_type: str | None = None,
    reduction: str = "mean",
) -> DDIMStepOutput:
    """One DDIM step x_t → x_{t'} with the log-probability of the transition (docs/methods/algorithms.md#ddim-step).

    With N = `scheduler.num_inference_steps`, t' = t − num_train_timesteps // N and ᾱ_{t'} = `final_alpha_cumprod` if
    t' < 0:

        x̂0 = (x_t − sqrt(1 − ᾱ_t) ε̂) / sqrt(ᾱ_t)                         (clipped if `config.clip_sample`)
        s_t = η · sqrt((1 − ᾱ_{t'}) / (1 − ᾱ_t)) · sqrt(1 − ᾱ_t / ᾱ_{t'})
        μ   = sqrt(ᾱ_{t'}) x̂0 + sqrt(1 − ᾱ_{t'} − s_t²) ε̂,      x_{t'} = μ + s_t z,  z ~ N(0, I)
        log π = −(x_{t'} − μ)² / (2 s_t²) − log s_t − ½ log 2π           (per element, then reduced)

    For `v_prediction`, x̂0 = sqrt(ᾱ_t) x_t − sqrt(1 − ᾱ_t) v̂ and ε̂ = sqrt(ᾱ_t) v̂ + sqrt(1 − ᾱ_t) x_t; for `sample`,
    x̂0 is the model output. With the same generator(s), `prev_sample` equals `DDIMScheduler.step(model_output,
    timestep, sample, eta=eta, generator=generator).prev_sample` for float32 inputs (bitwise in our tests). The noise is
    drawn with `randn_tensor` in `model_output.dtype`, as diffusers does, then upcast.

    Deterministic steps: where s_t = 0 (η = 0, or the last step when ᾱ_{t'} = 1, i.e. `set_alpha_to_one=True`) the
    transition is a point mass; `log_prob` is then defined as 0 (not −inf/NaN) and such steps must be excluded from
    policy-gradient training (`Trajectory.trainable`). No returned tensor contains NaN or inf for finite inputs.

    Args:
        scheduler (`DDIMScheduler`):
            Supplies `alphas_cumprod`, `final_alpha_cumprod`, `num_inference_steps` (call `set_timesteps` first) and
            the `prediction_type` / `clip_sample` / `clip_sample_range` config.
        model_output (`torch.Tensor`): `(B, ...)` the (guided) model prediction, any float dtype.
        timestep (`int` or `torch.Tensor`): the current timestep t, a scalar or `(B,)` int.
        sample (`torch.Tensor`): `(B, ...)` the current sample x_t.
        eta (`float`, defaults to 0.0): DDIM noise level η ≥ 0 (1.0 = DDPM-like ancestral sampling).
        generator (`torch.Generator` or list of `B` generators, *optional*): noise source when sampling.
        prev_sample (`torch.Tensor`, *optional*): `(B, ...)` an x_{t'} to score instead of sampling one.
        prediction_type (`str`, *optional*): "epsilon", "v_prediction" or "sample"; defaults to the scheduler's.
        reduction (`str`, defaults to "mean"): "mean" or "sum" over all non-batch elements of the log-prob, or
            "per_position": the sum over the channel dim 1 only, `(B, *grid)` (ViPO's per-position log-prob).

    Returns:
        `DDIMStepOutput` with float32 `prev_sample`, `mean`, `std`, `log_prob` `(B,)`.

    Raises:
        ValueError: for an unknown `prediction_type`/`reduction`, η < 0, mismatched shapes, a generator list whose
            length is not B, `thresholding=True` in the scheduler config, or when `set_timesteps` was not called.
    """
    # 1. validate
    prediction_type = prediction_type or scheduler.config.prediction_type
    _check_step_args(scheduler, model_output, sample, prev_sample, generator, prediction_type, reduction, eta)

    # 2. alphas (float32, broadcastable to the sample)
    alpha_prod_t, alpha_prod_t_prev = _alphas(scheduler, timestep, sample.device, sample.ndim)
    beta_prod_t = 1 - alpha_prod_t
    model_output_f, sample_f = model_output.float(), sample.float()

    # 3. predicted x0 and epsilon
    if prediction_type == "epsilon":
        pred_original_sample = (sample_f - beta_prod_t ** (0.5) * model_output_f) / alpha_prod_t ** (0.5)
        pred_epsilon = model_output_f
    elif prediction_type == "sample":
        pred_original_sample = model_output_f
        pred_epsilon = (sample_f - alpha_prod_t ** (0.5) * pred_original_sample) / beta_prod_t ** (0.5)
    else:  # v_prediction
        pred_original_sample = (alpha_prod_t**0.5) * sample_f - (beta_prod_t**0.5) * model_output_f
        pred_epsilon = (alpha_prod_t**0.5) * model_output_f + (beta_prod_t**0.5) * sample_f

    # 4. clip x0
    if scheduler.config.clip_sample:
        clip = scheduler.config.clip_sample_range
        pred_original_sample = pred_original_sample.clamp(-clip, clip)

    # 5. std s_t = eta * sqrt(variance)
    beta_prod_t_prev = 1 - alpha_prod_t_prev
    variance = (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev)
    std_dev_t = eta * variance ** (0.5)

    # 6. mean: sqrt(ᾱ_{t'}) x̂0 + sqrt(1 - ᾱ_{t'} - s²) ε̂
    pred_sample_direction = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5) * pred_epsilon
    mean = alpha_prod_t_prev ** (0.5) * pred_original_sample + pred_sample_direction

    # 7. sample x_{t'} unless given
    if prev_sample is None:
        if eta > 0:
            noise = randn_tensor(
                model_output.shape, generator=generator, device=model_output.device, dtype=model_output.dtype
            )
            prev_sample = mean + std_dev_t * noise.float()
        else:
            prev_sample = mean
    prev_sample = prev_sample.float()

    # 8. log N(prev_sample; mean, s²), 0 where s == 0 (deterministic step)
    std_dev_t = torch.as_tensor(std_dev_t, dtype=torch.float32, device=sample.device)
    stochastic = std_dev_t > 0
    safe_std = torch.where(stochastic, std_dev_t, torch.ones_like(std_dev_t))
    log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - LOG_SQRT_2PI
    log_prob = torch.where(stochastic, log_prob, torch.zeros_like(log_prob))
    dims = (1,) if reduction == "per_position" else tuple(range(1, sample.ndim))  # per_position: channels only (ViPO)
    log_prob = log_prob.mean(dim=dims) if reduction == "mean" else log_prob.sum(dim=dims)
    return DDIMStepOutput(prev_sample=prev_sample, mean=mean, std=std_dev_t, log_prob=log_prob)


@register_sampler
@dataclass
class DDIMSampler(Sampler):
    """``sampler=ddim``: DDIM-η rollouts with per-step log-probs for ε/v models (`ddim_step`; η = 1: DDPO's ancestral
    rollouts, η = 0: deterministic DDIM, whose log-probs are 0). With η = 0 and the same steps, guidance and
    generators the images equal `StableDiffusionPipeline.__call__(..., eta=0.0)`'s, with η > 0 its ``eta=η`` output
    (the per-step noise is drawn from the same generators in the same order; tests/unit/samplers/test_rollout.py).

    Attributes:
        eta (`float`): DDIM's η ≥ 0 (default 1.0), as in diffusers' ``DDIMScheduler.step(eta=...)``.
    """

    name: str = "ddim"
    model_family: str = "eps"
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    eta: float = 1.0

    noise_field: ClassVar[str] = "eta"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        number(vars(self), "eta", "", ge=0, hint="DDIM's eta; 0 is deterministic DDIM")

    def schedule(self, policy) -> Schedule:
        from diffusers import DDIMScheduler

        scheduler = policy.scheduler
        if not isinstance(scheduler, DDIMScheduler):
            raise TypeError(f"sampler=ddim steps with a DDIMScheduler; the policy's scheduler is a "
                            f"{type(scheduler).__name__}")
        scheduler.set_timesteps(self.num_inference_steps, device=policy.device)
        return Schedule(scheduler, scheduler.timesteps)

    def stored_schedule(self, policy, trajectory) -> Schedule:
        scheduler = policy.scheduler
        num_steps = len(trajectory.timesteps)
        if scheduler.num_inference_steps != num_steps:
            scheduler.set_timesteps(num_steps, device=policy.device)
        return Schedule(scheduler, trajectory.timesteps.to(trajectory.latents.device), None, trajectory.trainable)

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        return ddim_step(schedule.scheduler, model_output, schedule.timesteps[k], sample, eta=self.eta,
                         generator=generator, prev_sample=prev_sample, reduction=reduction)
