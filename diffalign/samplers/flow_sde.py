"""Flow-GRPO's SDE step for rectified-flow models, with its Gaussian log-probability
(docs/methods/algorithms.md#flow-grpo-sde).

Flow-GRPO (Liu et al., arXiv:2505.05470, eq. 9–10; the `sde_step_with_logprob` of the released code) turns the
flow ODE into an SDE with the same marginals. With t ≡ σ integrated from 1 to 0, an Euler–Maruyama step from σ_k to
σ_{k+1} (Δ = σ_{k+1} − σ_k < 0) and noise level a:

    σ_t = a · sqrt(σ_k / (1 − σ_k))            (σ_k = 1 in the denominator is replaced by σ_max = sigmas[1])
    μ_θ = x · (1 + σ_t² Δ / (2 σ_k)) + v̂ · (1 + σ_t² (1 − σ_k) / (2 σ_k)) · Δ
    s   = σ_t · sqrt(−Δ),   x_{k+1} = μ_θ + s z.

With a = 0 it is the deterministic Euler step x + Δ v̂ of `FlowMatchEulerDiscreteScheduler.step` (pinned by
tests/unit/samplers/test_flow_sampler.py). All arithmetic runs in float32.

`dance_sde_step` is DanceGRPO's parametrisation, the one ViPO's released code samples with
(docs/methods/algorithms.md#dancegrpo-sde; DanceGRPO, arXiv:2505.07818; `ziqi-nox/ViPO`): with x̂₀ = x − σ_k v̂ and the
score estimate g = −(x − (1 − σ_k) x̂₀) / σ_k²,

    μ_θ = x + Δ v̂ − ½ η² g Δ,   s = η · sqrt(σ_k − σ_{k+1})

(η = 0.3 for FLUX, 0.25 for Wan in the released scripts; η = 0 is again the Euler step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from diffalign.config.checks import number
from diffalign.samplers.base import FlowSampler, randn_tensor, register_sampler

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class FlowStepOutput:
    """Output of `flow_sde_step` (all float32).

    Attributes:
        prev_sample: `(B, ...)` x_{k+1} (drawn, or the one passed in).
        mean: `(B, ...)` μ_θ; gradients reach the model only through it.
        std: 0-dim or `(B, 1, ..., 1)` the step std s (independent of the model).
        log_prob: `(B,)` log N(prev_sample; μ_θ, s² I) reduced over non-batch elements ("mean" or "sum"), or
            `(B, *grid)` summed over the channel dim 1 only ("per_position", ViPO); 0 where s = 0.
    """

    prev_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """log N(x; mean, std² I) per sample, reduced over every non-batch element
    (docs/methods/algorithms.md#step-log-probabilities): −(x − μ)² / (2 s²) − log s − ½ log 2π per element; 0 where std
    = 0 (a deterministic step has no density).

    Args:
        x (`torch.Tensor`): `(B, ...)` the sample scored.
        mean (`torch.Tensor`): `(B, ...)` the Gaussian's mean.
        std (`torch.Tensor`): broadcastable to `x`, ≥ 0.
        reduction (`str`): "mean" (nats per element, the DDPO/Flow-GRPO convention), "sum", or "per_position"
            (sum over the channel dim 1 only, keeping the latent grid: ViPO's per-position log-prob,
            docs/methods/algorithms.md#vipo).

    Returns:
        `(B,)` float32, or `(B, *x.shape[2:])` for "per_position".

    Raises:
        ValueError: for another `reduction`.
    """
    if reduction not in ("mean", "sum", "per_position"):
        raise ValueError(f"`reduction` must be 'mean', 'sum' or 'per_position', got {reduction!r}.")
    x, mean = x.float(), mean.float()
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device)
    safe = torch.where(std > 0, std, torch.ones_like(std))
    elem = -((x - mean) ** 2) / (2 * safe**2) - torch.log(safe) - LOG_SQRT_2PI
    elem = torch.where(std > 0, elem, torch.zeros_like(elem))
    if reduction == "per_position":
        return elem.sum(dim=1)
    dims = tuple(range(1, x.ndim))
    return elem.mean(dim=dims) if reduction == "mean" else elem.sum(dim=dims)


def float32_step_inputs(model_output, sigma, sigma_next, sample):
    """(x, v̂, σ, σ_next) in float32; `(B,)` sigmas shaped `(B, 1, ..., 1)` to broadcast over the sample."""
    x = sample.float()
    v = model_output.float()
    shape = (-1,) + (1,) * (x.ndim - 1)
    s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=x.device)
    return x, v, (s.view(shape) if s.ndim else s), (s_next.view(shape) if s_next.ndim else s_next)


def sample_and_score(mean: torch.Tensor, std: torch.Tensor, generator, prev_sample: torch.Tensor | None,
                      reduction: str) -> FlowStepOutput:
    """Draws x_{k+1} ~ N(mean, std²) (mean itself where std is 0 everywhere) unless `prev_sample` is given, and scores
    it (`gaussian_log_prob`). Raises ValueError for a generator list without one generator per sample."""
    if prev_sample is None:
        if isinstance(generator, list) and len(generator) != mean.shape[0]:
            raise ValueError(f"Got {len(generator)} generators for a batch of {mean.shape[0]}; pass one per sample.")
        if bool((std > 0).any()):
            noise = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
            prev_sample = mean + std * noise
        else:
            prev_sample = mean
    log_prob = gaussian_log_prob(prev_sample, mean, std, reduction)
    return FlowStepOutput(prev_sample=prev_sample.float(), mean=mean, std=std, log_prob=log_prob)


def flow_sde_step(
    model_output: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float = 0.7,
    sigma_max: float | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> FlowStepOutput:
    """One Flow-GRPO SDE step σ → σ_next (σ_next < σ) with its log-probability; see the module docstring.

    Args:
        model_output (`torch.Tensor`): `(B, ...)` the (guided) velocity v̂(x, σ).
        sigma (`float` or `torch.Tensor`): σ, a scalar or `(B,)` in [0, 1].
        sigma_next (`float` or `torch.Tensor`): σ_next, a scalar or `(B,)` in [0, 1], σ_next < σ.
        sample (`torch.Tensor`): `(B, ...)` x at σ.
        noise_level (`float`, defaults to 0.7): a ≥ 0 (0.7 is Flow-GRPO's default; 0 gives the Euler ODE step).
        sigma_max (`float`, *optional*): replaces σ = 1 in the denominator of σ_t (the schedule's second sigma in the
            released code); required when σ = 1 and `noise_level > 0`.
        generator: noise source for drawing x_{k+1}; a list must have one generator per sample.
        prev_sample (`torch.Tensor`, *optional*): `(B, ...)` an x_{k+1} to score instead of drawing one.
        reduction (`str`): log-prob reduction, "mean", "sum" or "per_position" (`gaussian_log_prob`).

    Returns:
        `FlowStepOutput`.

    Raises:
        ValueError: for `noise_level < 0`, σ = 1 with a > 0 and no `sigma_max`, or a generator list of the wrong size.
    """
    if noise_level < 0:
        raise ValueError(f"`noise_level` must be >= 0, got {noise_level}.")
    x, v, s, s_next = float32_step_inputs(model_output, sigma, sigma_next, sample)
    dt = s_next - s
    if noise_level == 0:
        mean = x + dt * v
        std = torch.zeros_like(s * s_next)
    else:
        if bool((s >= 1).any()) and sigma_max is None:
            raise ValueError("sigma = 1 needs `sigma_max` (the schedule's second sigma) for the SDE's noise scale.")
        denom = 1 - torch.where(s >= 1, torch.as_tensor(sigma_max if sigma_max is not None else 0.0,
                                                        dtype=torch.float32, device=x.device), s)
        std_dev_t = noise_level * torch.sqrt(s / denom)
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        std = std_dev_t * torch.sqrt(-dt)
    return sample_and_score(mean, std, generator, prev_sample, reduction)



def dance_sde_step(
    model_output: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float = 0.25,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> FlowStepOutput:
    """One DanceGRPO SDE step σ → σ_next (σ_next < σ, σ > 0) with its log-probability (module docstring;
    docs/methods/algorithms.md#dancegrpo-sde).

    Args:
        model_output (`torch.Tensor`): `(B, ...)` the (guided) velocity v̂(x, σ).
        sigma (`float` or `torch.Tensor`): σ > 0, a scalar or `(B,)` in [0, 1].
        sigma_next (`float` or `torch.Tensor`): σ_next, a scalar or `(B,)` in [0, 1], σ_next < σ.
        sample (`torch.Tensor`): `(B, ...)` x at σ.
        noise_level (`float`, defaults to 0.25): DanceGRPO's η ≥ 0 (ViPO-Wan 0.25, ViPO-FLUX 0.3; 0 gives the Euler
            ODE step).
        generator: noise source for drawing x_{k+1}; a list must have one generator per sample.
        prev_sample (`torch.Tensor`, *optional*): `(B, ...)` an x_{k+1} to score instead of drawing one.
        reduction (`str`): log-prob reduction, "mean", "sum" or "per_position" (`gaussian_log_prob`).

    Returns:
        `FlowStepOutput` (std s = η sqrt(σ − σ_next), a scalar or `(B, 1, ..., 1)`).

    Raises:
        ValueError: for `noise_level < 0`, σ ≤ 0, σ_next ≥ σ, or a generator list of the wrong size.
    """
    if noise_level < 0:
        raise ValueError(f"`noise_level` must be >= 0, got {noise_level}.")
    x, v, s, s_next = float32_step_inputs(model_output, sigma, sigma_next, sample)
    if bool((s <= 0).any()):
        raise ValueError("dance_sde_step needs sigma > 0 (the last step ends at 0, it does not start there).")
    if bool((s_next >= s).any()):
        raise ValueError("dance_sde_step integrates from sigma down to sigma_next < sigma; got sigma_next >= sigma.")
    dt = s_next - s
    x0 = x - s * v
    score = -(x - (1 - s) * x0) / s**2
    mean = x + dt * v - 0.5 * noise_level**2 * score * dt
    std = noise_level * torch.sqrt(s - s_next)
    return sample_and_score(mean, std, generator, prev_sample, reduction)


@register_sampler
@dataclass
class FlowSDESampler(FlowSampler):
    """``sampler=flow_sde``: Flow-GRPO's SDE for flow models with per-step log-probs (`flow_sde_step`), a =
    ``noise_level`` (Flow-GRPO config/grpo.py: 0.7, 10 steps, CFG 4.5); a = 0 is the Euler ODE, whose images equal
    `StableDiffusion3Pipeline.__call__`'s with the same generators (tests/unit/samplers/test_flow_sampler.py).

    Attributes:
        noise_level (`float`): a ≥ 0 (Flow-GRPO's ``sample.noise_level``).
    """

    name: str = "flow_sde"
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.7

    noise_field: ClassVar[str] = "noise_level"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        number(vars(self), "noise_level", "", ge=0, hint="the flow SDE's noise scale; 0 is the Euler ODE")

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        sigmas = schedule.sigmas
        return flow_sde_step(model_output, sigmas[k], sigmas[k + 1], sample, noise_level=self.noise_level,
                             sigma_max=float(sigmas[1]), generator=generator, prev_sample=prev_sample,
                             reduction=reduction)


@register_sampler
@dataclass
class DanceSDESampler(FlowSampler):
    """``sampler=dance_sde``: DanceGRPO's SDE for flow models with per-step log-probs (`dance_sde_step`; ViPO's
    released sampler), step std η·sqrt(σ_k − σ_{k+1}) with η = ``noise_level`` (the ViPO Wan script: 0.25, 16 steps,
    CFG 5.0).

    Attributes:
        noise_level (`float`): η ≥ 0 (0 is the Euler ODE).
    """

    name: str = "dance_sde"
    num_inference_steps: int = 16
    guidance_scale: float = 5.0
    noise_level: float = 0.25

    noise_field: ClassVar[str] = "noise_level"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        number(vars(self), "noise_level", "", ge=0, hint="DanceGRPO's eta; 0 is the Euler ODE")

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        sigmas = schedule.sigmas
        return dance_sde_step(model_output, sigmas[k], sigmas[k + 1], sample, noise_level=self.noise_level,
                              generator=generator, prev_sample=prev_sample, reduction=reduction)
