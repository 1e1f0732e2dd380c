"""Coefficients-preserving sampling (CPS; Wang & Yu, arXiv:2509.05952), a flow-model SDE with per-step log-probs:
``sampler=cps_sde`` (docs/guides/samplers.md#cps_sde).

A rectified-flow sample at noise level σ is x = (1 − σ) x₀ + σ ε. From x_k at σ_k and the (guided) velocity v̂, the
step to σ_{k+1} < σ_k predicts

    x̂₀ = x_k − σ_k v̂,      x̂₁ = x_k + (1 − σ_k) v̂          (the clean sample and the noise)

and re-noises x̂₀ so that the coefficients of x₀ and of the total noise stay those of σ_{k+1} (the coefficient of
noise is split between the predicted noise x̂₁ and fresh noise z, with the squares summing to σ_{k+1}²):

    s   = σ_{k+1} · sin(a π / 2)                             (a = ``noise_level`` in [0, 1])
    μ_θ = (1 − σ_{k+1}) x̂₀ + sqrt(σ_{k+1}² − s²) x̂₁        (= (1 − σ_{k+1}) x̂₀ + σ_{k+1} cos(a π / 2) x̂₁)
    x_{k+1} = μ_θ + s z,   z ~ N(0, I).

a = 0 is the deterministic DDIM-like step (for a flow model the Euler step x_k + (σ_{k+1} − σ_k) v̂), a = 1 puts no
predicted noise back (s = σ_{k+1}). The last step (σ_{k+1} = 0) has s = 0: it returns x̂₀ and has no log-prob
(``Trajectory.trainable`` False there). The step is the ``sde_type="cps"`` branch of ``sde_step_with_logprob`` in
Flow-GRPO's released code (``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``, default a = 0.8 in MixGRPO's copy),
re-derived and pinned by tests/unit/samplers/test_samplers.py.

One difference: the released code scores x_{k+1} with −‖x_{k+1} − μ_θ‖² averaged over elements ("remove all
constants"), so its PPO ratio has no 1/(2 s²) factor; here, as for every other sampler, the log-prob is the Gaussian
log N(x_{k+1}; μ_θ, s² I) (`diffalign.samplers.flow_sde.gaussian_log_prob`), whose ratio is that of the transition
density. The two differ by the per-step factor 1/(2 s²) inside the exponent (and a constant that cancels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from diffalign.config.checks import number
from diffalign.samplers.base import FlowSampler, register_sampler
from diffalign.samplers.flow_sde import FlowStepOutput, float32_step_inputs, sample_and_score


def cps_step(
    model_output: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    sample: torch.Tensor,
    *,
    noise_level: float = 0.8,
    generator: torch.Generator | list[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    reduction: str = "mean",
) -> FlowStepOutput:
    """One CPS step σ → σ_next (σ_next < σ) with its Gaussian log-probability (module docstring). All arithmetic in
    float32.

    Args:
        model_output (`torch.Tensor`): `(B, ...)` the (guided) velocity v̂(x, σ).
        sigma (`float` or `torch.Tensor`): σ, a scalar or `(B,)` in [0, 1].
        sigma_next (`float` or `torch.Tensor`): σ_next, a scalar or `(B,)` in [0, 1], σ_next < σ.
        sample (`torch.Tensor`): `(B, ...)` x at σ.
        noise_level (`float`, defaults to 0.8): a in [0, 1]; s = σ_next · sin(a π / 2).
        generator: noise source for drawing x_{k+1}; a list must have one generator per sample.
        prev_sample (`torch.Tensor`, *optional*): `(B, ...)` an x_{k+1} to score instead of drawing one.
        reduction (`str`): "mean", "sum" or "per_position" (`gaussian_log_prob`).

    Returns:
        `FlowStepOutput` (std s a scalar or `(B, 1, ..., 1)`; log-prob 0 where s = 0).

    Raises:
        ValueError: for a noise level outside [0, 1], σ_next ≥ σ, or a generator list of the wrong size.
    """
    if not 0 <= noise_level <= 1:
        raise ValueError(f"`noise_level` must be in [0, 1], got {noise_level}.")
    x, v, s, s_next = float32_step_inputs(model_output, sigma, sigma_next, sample)
    if bool((s_next >= s).any()):
        raise ValueError("cps_step integrates from sigma down to sigma_next < sigma; got sigma_next >= sigma.")
    std = s_next * math.sin(noise_level * math.pi / 2)
    x0 = x - s * v
    x1 = x + (1 - s) * v
    mean = (1 - s_next) * x0 + torch.sqrt((s_next**2 - std**2).clamp_min(0)) * x1
    return sample_and_score(mean, std, generator, prev_sample, reduction)


@register_sampler
@dataclass
class CPSSampler(FlowSampler):
    """``sampler=cps_sde``: coefficients-preserving sampling for flow models with per-step log-probs (`cps_step`);
    10 steps and CFG 4.5 as ``flow_sde``, a = 0.8 (the released default of the ``cps`` SDE type).

    Attributes:
        noise_level (`float`): a in [0, 1]; the step std is σ_{k+1} · sin(a π / 2) (0: deterministic).
    """

    name: str = "cps_sde"
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.8

    noise_field: ClassVar[str] = "noise_level"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        super().check()
        number(vars(self), "noise_level", "", ge=0, le=1,
               hint="CPS's a: the step std is sigma_next * sin(a * pi / 2); 0 is deterministic")

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        sigmas = schedule.sigmas
        return cps_step(model_output, sigmas[k], sigmas[k + 1], sample, noise_level=self.noise_level,
                        generator=generator, prev_sample=prev_sample, reduction=reduction)
