"""Flow-GRPO (Liu et al., arXiv:2505.05470), docs/methods/algorithms.md#flow-grpo: group-normalised advantages, the
clipped ratio over stored SDE transitions (Flow-GRPO SDE, noise level a = 0.7), and a KL to the frozen base; the
training forward is guided with the unconditional branch detached. On ε-models it is DDPO + KL with the DDIM-η
Gaussian."""

from __future__ import annotations

from dataclasses import dataclass

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.policy_gradient import LOGPROB_TOLERANCE, ClippedPolicyGradient


@config_schema("method", "flow_grpo")
@dataclass
class FlowGRPOConfig:
    """Config of `FlowGRPO` (``method=flow_grpo`` extends it); the one place its defaults are written (the method is
    built from it: `diffalign.methods.method_config`): the released GenEval config's ([CODE] =
    yifan123/flow_grpo)."""

    _target_: str = "diffalign.objectives.flow_grpo.FlowGRPO"
    clip_range: float = 1.0e-4
    beta_kl: float = 0.04               # GenEval/OCR; 0.01 PickScore [CODE]
    kl_form: str = "code"               # code: mean||mu - mu_ref||^2 / (2 sigma_t^2) without |dt| [CODE]; exact: / (2 s^2)
    detach_unconditional: bool = True
    timestep_fraction: float = 0.99     # int(10 * 0.99) = 9 of 10 transitions [CODE]
    timestep_selection: str = "first"   # first: transitions 0..8 in order [CODE scripts/train_sd3.py]; random: a random 9
                                        # for the batch; per_sample: a random 9 per sample (DanceGRPO)
    logprob_check: str = "stop"         # train/rollout consistency alarm (epoch's first update): stop|warn|off
    logprob_tolerance: float = LOGPROB_TOLERANCE  # max |recomputed - stored| log-prob (docs/guides/reliability.md)


class FlowGRPO(ClippedPolicyGradient):
    """Flow-GRPO, built from `FlowGRPOConfig` (``FlowGRPO(config)`` or ``FlowGRPO(**fields)``,
    `diffalign.methods.method_config`), whose defaults are the released GenEval config (`config/grpo.py`); the
    arguments are `ClippedPolicyGradient`'s. Per-group advantages (the `global_std` switch lives in
    `online.advantage_std`); the trained transitions are the first ones in order (`timestep_selection="first"`,
    `scripts/train_sd3.py`; "random" is diffalign's alternative)."""

    def __init__(self, config: FlowGRPOConfig | None = None, **fields):
        config = method_config(FlowGRPOConfig, config, fields)
        super().__init__(clip_range=config.clip_range, beta_kl=config.beta_kl, kl_form=config.kl_form,
                         detach_unconditional=config.detach_unconditional, advantage="group",
                         timestep_fraction=config.timestep_fraction, timestep_selection=config.timestep_selection,
                         logprob_check=config.logprob_check, logprob_tolerance=config.logprob_tolerance)
