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

Old keys keep working until 0.3 with a `FutureWarning` (`diffalign.config.deprecation.migrate_config`): ``sampler.eta``
of a flow SDE becomes ``sampler.noise_level``, ``sampler.sde_type=dance`` selects ``dance_sde``, ``sampler.name=sde``
becomes ``ddim`` / ``flow_sde`` / ``dance_sde`` by the model's family, ``dpm_solver`` / ``euler`` become ``dpm_ode`` /
``euler_ode``, and ``sampler.eta`` of an ODE solver (which has no effect) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffalign.config.checks import target_attribute
from diffalign.config.schemas import config_schema, deprecated, deprecated_values

STOCHASTIC = ("ddim", "flow_sde", "dance_sde")
"""Samplers that draw noise at every step and store per-step log-probs (`diffalign.samplers.rollout.rollout`)."""
ODE_SOLVERS = {"dpm_ode": "dpm_solver", "euler_ode": "euler"}
"""Deterministic samplers → their `diffalign.samplers.ode` solver."""
SAMPLERS = (*STOCHASTIC, *ODE_SOLVERS)
FLOW_SDES = {"flow_sde": "flow_grpo", "dance_sde": "dance"}
"""Flow-model SDEs → the ``sde_type`` of `diffalign.samplers.rollout.rollout`."""


def _legacy_name(value: Any, node: dict, cfg) -> str | None:
    """The new ``sampler.name`` of a deprecated one: ``sde`` by the model's family (and the old ``sde_type``),
    ``dpm_solver`` / ``euler`` by the option they named; None for a current name.

    Raises:
        ValueError: for ``sde`` when the model does not say whether it is a flow model.
    """
    if value in ("dpm_solver", "euler"):
        return {"dpm_solver": "dpm_ode", "euler": "euler_ode"}[value]
    if value != "sde":
        return None
    if node.get("sde_type") == "dance":
        return "dance_sde"
    flow = target_attribute((cfg.get("model") or {}).get("_target_"), "flow_matching")
    if flow is None:
        raise ValueError("sampler.name=sde is deprecated, and model._target_ does not say whether it is a flow model; "
                         "select the sampler instead: sampler=ddim (eps/v models) or sampler=flow_sde (flow models)")
    return "flow_sde" if flow else "ddim"


def _sde_type_to_name(value: Any, node: dict, cfg) -> str:
    """The ``sampler.name`` meant by a deprecated ``sampler.sde_type``: ``dance`` → ``dance_sde``; ``flow_grpo``
    (the old default, which only flow models read) → ``flow_sde`` for a flow SDE option, else the option's name.

    Raises:
        ValueError: for another value.
    """
    if value not in ("flow_grpo", "dance"):
        raise ValueError(f"sampler.sde_type={value!r} must be one of ('flow_grpo', 'dance') (a deprecated key: select "
                         "the SDE with sampler=flow_sde or sampler=dance_sde)")
    if value == "dance":
        return "dance_sde"
    name = node.get("name")
    return "flow_sde" if name in FLOW_SDES else name


_NAME_NOTE = "; select the SDE with sampler=flow_sde or sampler=dance_sde"


@config_schema("sampler", "ddim")
@dataclass
class DDIMSamplerConfig:
    """``sampler=ddim``: DDIM-η rollouts with per-step log-probs for ε/v models (η = 1: DDPO's ancestral rollouts,
    η = 0: deterministic DDIM)."""

    name: str = deprecated_values(_legacy_name, "ddim")
    model_family: str = "eps"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 20
    guidance_scale: float = 4.0
    eta: float = 1.0
    sde_type: str | None = deprecated("name", convert=_sde_type_to_name, note=_NAME_NOTE)


@config_schema("sampler", "flow_sde")
@dataclass
class FlowSDESamplerConfig:
    """``sampler=flow_sde``: Flow-GRPO's SDE for flow models, σ_t = a·sqrt(t / (1 − t)) with a = ``noise_level``
    (Flow-GRPO config/grpo.py: 0.7, 10 steps, CFG 4.5); a = 0 is the Euler ODE."""

    name: str = deprecated_values(_legacy_name, "flow_sde")
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    eta: float | None = deprecated("noise_level", note=" (a flow SDE's noise scale is sampler.noise_level)")
    sde_type: str | None = deprecated("name", convert=_sde_type_to_name, note=_NAME_NOTE)


@config_schema("sampler", "dance_sde")
@dataclass
class DanceSDESamplerConfig:
    """``sampler=dance_sde``: DanceGRPO's SDE for flow models (ViPO's released sampler), step std
    η·sqrt(σ_k − σ_{k+1}) with η = ``noise_level`` (the ViPO Wan script: 0.25, 16 steps, CFG 5.0)."""

    name: str = deprecated_values(_legacy_name, "dance_sde")
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 16
    guidance_scale: float = 5.0
    noise_level: float = 0.25
    eta: float | None = deprecated("noise_level", note=" (a flow SDE's noise scale is sampler.noise_level)")
    sde_type: str | None = deprecated("name", convert=_sde_type_to_name, note=_NAME_NOTE)


@config_schema("sampler", "dpm_ode")
@dataclass
class DPMSolverSamplerConfig:
    """``sampler=dpm_ode``: deterministic DPM-Solver rollouts (DGPO's; flow DPM-Solver with the model's shift for
    flow models, DPM-Solver++ 2M for ε/v models), no log-probs; 10 steps, CFG 4.5."""

    name: str = deprecated_values(_legacy_name, "dpm_ode")
    model_family: str = "any"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    eta: float | None = deprecated(note="an ODE solver draws no noise, so it had no effect")
    sde_type: str | None = deprecated(note="an ODE solver draws no noise, so it had no effect")


@config_schema("sampler", "euler_ode")
@dataclass
class EulerSamplerConfig:
    """``sampler=euler_ode``: the flow Euler ODE (`FlowMatchEulerDiscreteScheduler`, the SD3 pipeline's sampler),
    flow models only, no log-probs; 10 steps, CFG 4.5."""

    name: str = deprecated_values(_legacy_name, "euler_ode")
    model_family: str = "flow"  # the models it steps: eps | flow | any (diffalign/samplers/checks.py)
    num_inference_steps: int = 10
    guidance_scale: float = 4.5
    eta: float | None = deprecated(note="an ODE solver draws no noise, so it had no effect")
    sde_type: str | None = deprecated(note="an ODE solver draws no noise, so it had no effect")


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
        return float(sampler.get("eta", 0.0))  # (0 for an old ``name: ddim`` ODE option, which had no eta)
    return float(sampler.noise_level) if name in FLOW_SDES else 0.0


def describe(sampler) -> str:
    """A short label of a ``sampler`` node for the logs, e.g. ``flow_sde noise_level=0.7``."""
    name = sampler.get("name")
    if name == "ddim":
        return f"ddim eta={sampler.eta}"
    return f"{name} noise_level={sampler.noise_level}" if name in FLOW_SDES else str(name)
