"""The ``sampler`` node's checks, run before any model loads (`diffalign.config.validation`): building the `Sampler`
(`diffalign.samplers.base.build_sampler`) checks a registered option, integer steps, a guidance scale of at least 1
and the sampler's own noise parameter; then an online method's sampler must be of the model's family.

Each sampler option names itself and says which models it steps (``model_family``):

=============  ===========================  ===========================================================
sampler=       ``model_family``             what it runs
=============  ===========================  ===========================================================
ddim           eps (ε- and v-prediction)    DDIM-η (`ddim_step`), η = ``eta``: DDPO, Flow-GRPO/ViPO on ε-models
flow_sde       flow (rectified flow)        the Flow-GRPO SDE (`flow_sde_step`), a = ``noise_level``
dance_sde      flow                         DanceGRPO's SDE (`dance_sde_step`), η = ``noise_level``
cps_sde        flow                         coefficients-preserving sampling (`cps_step`), ``noise_level``
window_sde     flow                         MixGRPO's windowed Flow-GRPO SDE, ODE outside the window
dpm_ode        any                          DPM-Solver(++) for either family (`diffalign.samplers.ode`)
euler_ode      flow                         the flow Euler ODE
ode            any                          the family's pipeline default: DDIM η = 0 / the flow Euler ODE
=============  ===========================  ===========================================================

The rollout steps with the sampler's own rule, so without the family check ``model=tiny_sd3 sampler=ddim`` would
fail only once the model has loaded. The same holds for the sampler nodes of evaluation and the monitors
(``eval.sampler``, ``monitor.sampler``; `check_sampler_node`).
"""

from __future__ import annotations

from diffalign.config.checks import ConfigError, node_check
from diffalign.samplers.base import SAMPLERS, build_sampler, sampler_names

FAMILY_SAMPLERS = {"eps": "sampler=ddim (DDIM-eta) or sampler=dpm_ode",
                   "flow": "sampler=flow_sde, sampler=dance_sde, sampler=cps_sde, sampler=window_sde, "
                           "sampler=euler_ode or sampler=dpm_ode"}


def samplers_of_family(family: str) -> list[str]:
    """The registered options that step `family` ("eps" or "flow") models (those of family "any" included)."""
    sampler_names()
    return [name for name, cls in SAMPLERS.items() if cls.model_family in (family, "any")]


@node_check("sampler")
def check_sampler_config(cfg, *, flow_matching: bool | None, online: bool) -> None:
    """Checks ``cfg.sampler``.

    Args:
        flow_matching (`bool` or None): the model's ``flow_matching`` class attribute (True: a rectified-flow model,
            False: an ε/v model, None: the model does not say, so the family is not checked).
        online (`bool`): the method samples its training data with this sampler (the online loop); only then must
            the sampler fit the model's family (a preference method does not roll out with it).

    Raises:
        ConfigError: naming the field and the fix.
    """
    if cfg.get("sampler") is None:
        return
    sampler = build_sampler(cfg.sampler, "sampler")
    family = sampler.model_family
    if not online or flow_matching is None or family == "any":
        return
    model_family = "flow" if flow_matching else "eps"
    if family != model_family:
        model = cfg.model._target_
        kind = "a rectified-flow model" if flow_matching else "an eps/v-prediction model"
        raise ConfigError(f"the sampler steps {'rectified-flow' if family == 'flow' else 'eps/v-prediction'} models "
                          f"(sampler.model_family={family}, sampler={sampler.describe()}) but model={model} is {kind}: "
                          f"the rollout would fail once the model has loaded. Use {FAMILY_SAMPLERS[model_family]}")


@node_check("sampler_node")
def check_sampler_node(node, where: str, *, flow_matching: bool | None, model: str | None = None) -> None:
    """Checks a sampler node other than the run's ``sampler`` (``eval.sampler``, ``monitor.sampler``): its fields
    (`build_sampler`) and, when the model says its family, that the sampler steps it.

    Args:
        node (`DictConfig`, `dict` or `Sampler`): the sampler node (None: not set, refused).
        where (`str`): its path, e.g. ``eval.sampler``, named in the errors.
        flow_matching (`bool` or None): the model's ``flow_matching`` class attribute (None: not checked).
        model (`str`, *optional*): the model's ``_target_``, named in the error.

    Raises:
        ConfigError: naming ``<where>.<field>`` (or ``<where>``), the value and the fix.
    """
    sampler = build_sampler(node, where)
    if flow_matching is None or sampler.model_family in ("any", "flow" if flow_matching else "eps"):
        return
    kind = "a rectified-flow model" if flow_matching else "an eps/v-prediction model"
    others = ", ".join(n for n in samplers_of_family("flow" if flow_matching else "eps") if n != "ode")
    raise ConfigError(f"{where}: sampler={sampler.name} steps {sampler.model_family} models (model_family="
                      f"{sampler.model_family}) but model={model} is {kind}; use sampler@{where}=ode (the default: "
                      f"the pipeline's deterministic sampler for either family) or one of {others}")
