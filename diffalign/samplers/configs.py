"""The ``sampler`` config group of the online methods' rollouts: one structured config per option, whose ``name`` is
the option's name (``sampler=ddim`` sets ``name: ddim``).

==============  ==========================================================  ===================================
option / name   step rule                                                   noise parameter
==============  ==========================================================  ===================================
``ddim``        DDIM-η with per-step log-probs, ε/v models                  ``eta``: DDIM's η (0: deterministic)
``flow_sde``    Flow-GRPO's SDE with log-probs, flow models                 ``noise_level``: Flow-GRPO's a (0.7)
``dance_sde``   DanceGRPO's SDE with log-probs, flow models (ViPO)          ``noise_level``: DanceGRPO's η (0.25)
``dpm_ode``     DPM-Solver (flow DPM-Solver / DPM-Solver++ 2M), no log-probs none
``euler_ode``   the flow Euler ODE, no log-probs                            none
==============  ==========================================================  ===================================

(docs/methods/algorithms.md#ddim-step, #flow-grpo-sde, #dancegrpo-sde; `diffalign.samplers.rollout`,
`diffalign.samplers.ode`). ``eta`` is DDIM's η only, as in diffusers' ``DDIMScheduler.step(eta=...)``; the flow SDEs'
noise scales are ``noise_level`` (the name of Flow-GRPO's released config, ``sample.noise_level``).
"""

from __future__ import annotations

from dataclasses import dataclass

from diffalign.config.schemas import config_schema

STOCHASTIC = ("ddim", "flow_sde", "dance_sde")
"""Samplers that draw noise at every step and store per-step log-probs (`diffalign.samplers.rollout.rollout`)."""
ODE_SOLVERS = {"dpm_ode": "dpm_solver", "euler_ode": "euler"}
"""Deterministic samplers → their `diffalign.samplers.ode` solver."""
SAMPLERS = (*STOCHASTIC, *ODE_SOLVERS)
FLOW_SDES = {"flow_sde": "flow_grpo", "dance_sde": "dance"}
"""Flow-model SDEs → the ``sde_type`` of `diffalign.samplers.rollout.rollout`."""


@config_schema("sampler", "ddim")
@dataclass
class DDIMSamplerConfig:
    """``sampler=ddim``: DDIM-η rollouts with per-step log-probs for ε/v models (η = 1: DDPO's ancestral rollouts,
    η = 0: deterministic DDIM)."""

    name: str = "ddim"
    model_family: str = "eps"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    eta: float = 1.0


@config_schema("sampler", "flow_sde")
@dataclass
class FlowSDESamplerConfig:
    """``sampler=flow_sde``: Flow-GRPO's SDE for flow models, σ_t = a·sqrt(t / (1 − t)) with a = ``noise_level``
    (Flow-GRPO config/grpo.py: 0.7, 10 steps, CFG 4.5); a = 0 is the Euler ODE."""

    name: str = "flow_sde"
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.7


@config_schema("sampler", "dance_sde")
@dataclass
class DanceSDESamplerConfig:
    """``sampler=dance_sde``: DanceGRPO's SDE for flow models (ViPO's released sampler), step std
    η·sqrt(σ_k − σ_{k+1}) with η = ``noise_level`` (the ViPO Wan script: 0.25, 16 steps, CFG 5.0)."""

    name: str = "dance_sde"
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 16
    guidance_scale: float = 5.0
    noise_level: float = 0.25


@config_schema("sampler", "dpm_ode")
@dataclass
class DPMSolverSamplerConfig:
    """``sampler=dpm_ode``: deterministic DPM-Solver rollouts (DGPO's; flow DPM-Solver with the model's shift for
    flow models, DPM-Solver++ 2M for ε/v models), no log-probs; 10 steps, CFG 4.5."""

    name: str = "dpm_ode"
    model_family: str = "any"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5


@config_schema("sampler", "euler_ode")
@dataclass
class EulerSamplerConfig:
    """``sampler=euler_ode``: the flow Euler ODE (`FlowMatchEulerDiscreteScheduler`, the SD3 pipeline's sampler),
    flow models only, no log-probs; 10 steps, CFG 4.5."""

    name: str = "euler_ode"
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5


def noise_scale(sampler) -> float:
    """The per-step noise scale of a ``sampler`` node: ``eta`` (``ddim``), ``noise_level`` (flow SDEs), 0 for the
    ODE solvers (no noise, no log-probs).

    Raises:
        ValueError: for a name outside `SAMPLERS`.
    """
    name = sampler.get("name")
    if name not in SAMPLERS:
        raise ValueError(f"sampler.name={name!r} must be one of {SAMPLERS} (the sampler options)")
    if name == "ddim":
        return float(sampler.get("eta", 0.0))
    return float(sampler.noise_level) if name in FLOW_SDES else 0.0


def describe(sampler) -> str:
    """A short label of a ``sampler`` node for the logs, e.g. ``flow_sde noise_level=0.7``."""
    name = sampler.get("name")
    if name == "ddim":
        return f"ddim eta={sampler.eta}"
    return f"{name} noise_level={sampler.noise_level}" if name in FLOW_SDES else str(name)
