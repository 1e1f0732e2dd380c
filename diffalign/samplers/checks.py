"""The ``sampler`` node's checks, run before any model loads (`diffalign.config.validation`): a known sampler option,
integer steps, a guidance scale of at least 1, a noise scale of at least 0, and a sampler of the model's family.

Each sampler option names itself and says which models it steps (``model_family``; `diffalign.samplers.configs`):

=============  ===========================  =========================================================
sampler=       ``model_family``             what it runs
=============  ===========================  =========================================================
ddim           eps (ε- and v-prediction)    DDIM-η (`ddim_step`), η = ``eta``: DDPO, Flow-GRPO/ViPO on ε-models
flow_sde       flow (rectified flow)        the Flow-GRPO SDE (`flow_sde_step`), a = ``noise_level``
dance_sde      flow                         DanceGRPO's SDE (`dance_sde_step`), η = ``noise_level``
dpm_ode        any                          DPM-Solver(++) for either family (`diffalign.samplers.ode`)
euler_ode      flow                         the flow Euler ODE
=============  ===========================  =========================================================

The rollout picks its step rule from the policy's scheduler, so without this check ``model=tiny_sd3 sampler=ddim``
would run the flow SDE with DDIM's η = 1 as its noise level, and ``model=tiny_sd sampler=flow_sde`` DDIM with η = 0.7.
"""

from __future__ import annotations

from diffalign.config.checks import ConfigError, choice, integer, node_check, number
from diffalign.samplers.configs import SAMPLERS, describe

SAMPLER_NAMES = SAMPLERS
MODEL_FAMILIES = ("eps", "flow", "any")
NAME_FAMILIES = {"ddim": "eps", "flow_sde": "flow", "dance_sde": "flow", "euler_ode": "flow", "dpm_ode": "any"}
"""The family each sampler option steps (its ``model_family`` default)."""
FAMILY_SAMPLERS = {"eps": "sampler=ddim (DDIM-eta) or sampler=dpm_ode",
                   "flow": "sampler=flow_sde, sampler=dance_sde, sampler=euler_ode or sampler=dpm_ode"}


def sampler_family(sampler) -> str | None:
    """The model family a sampler config steps: its ``model_family``, else what its name implies; None when it does
    not say."""
    family = sampler.get("model_family")
    return family if family is not None else NAME_FAMILIES.get(sampler.get("name"))


@node_check("sampler")
def check_sampler_config(cfg, *, flow_matching: bool | None, online: bool) -> None:
    """Checks ``cfg.sampler`` (after `diffalign.config.deprecation.migrate_config`; an unmigrated old ``eta`` alias of
    a flow SDE, still null, passes).

    Args:
        flow_matching (`bool` or None): the model's ``flow_matching`` class attribute (True: a rectified-flow model,
            False: an ε/v model, None: the model does not say, so the family is not checked).
        online (`bool`): the method samples its training data with this sampler (the online loop); only then must
            the sampler fit the model's family (a preference method does not roll out with it).

    Raises:
        ConfigError: naming the field and the fix.
    """
    sp, p = cfg.get("sampler"), "sampler"
    if sp is None:
        return
    choice(sp, "name", p, SAMPLER_NAMES, hint="select the sampler with sampler=<option>")
    choice(sp, "model_family", p, MODEL_FAMILIES, nullable=True)
    integer(sp, "num_inference_steps", p, ge=1)
    number(sp, "guidance_scale", p, ge=1, hint="classifier-free guidance w >= 1; 1 turns guidance off")
    number(sp, "eta", p, ge=0, nullable=sp.get("name") != "ddim",  # (a flow SDE's unmigrated old alias: null)
           hint="DDIM's eta; 0 is deterministic DDIM")
    number(sp, "noise_level", p, ge=0, hint="the flow SDE's noise scale; 0 is the Euler ODE")
    family = sampler_family(sp)
    if not online or flow_matching is None or family in (None, "any"):
        return
    model_family = "flow" if flow_matching else "eps"
    if family != model_family:
        model = cfg.model._target_
        kind = "a rectified-flow model" if flow_matching else "an eps/v-prediction model"
        raise ConfigError(f"the sampler steps {'rectified-flow' if family == 'flow' else 'eps/v-prediction'} models "
                          f"(sampler.model_family={family}, sampler={describe(sp)}) but model={model} is {kind}: the "
                          f"rollout would run another step rule with that noise scale. Use "
                          f"{FAMILY_SAMPLERS[model_family]}")
