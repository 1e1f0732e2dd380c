"""DDPO_IS (Black et al., arXiv:2305.13301), docs/methods/algorithms.md#ddpo: PPO-clip over stored DDIM(η = 1)
transitions with advantages from per-prompt running reward statistics (`diffalign.advantages.PerPromptStatTracker`), no
KL; the training forward is guided with gradients through both branches."""

from __future__ import annotations

from dataclasses import dataclass

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.policy_gradient import LOGPROB_TOLERANCE, ClippedPolicyGradient


@config_schema("method", "ddpo")
@dataclass
class DDPOConfig:
    """Config of `DDPO` (``method=ddpo`` extends it); the one place its defaults are written (the method is built from
    it: `diffalign.methods.method_config`)."""

    _target_: str = "diffalign.objectives.ddpo.DDPO"
    clip_range: float = 1.0e-4
    beta_kl: float = 0.0
    timestep_fraction: float = 1.0
    timestep_selection: str = "random"  # below fraction 1 a random subset shared by the batch; per_sample: one per
                                        # sample (ddpo-pytorch); first: in order
    logprob_check: str = "stop"         # train/rollout consistency alarm (epoch's first update): stop|warn|off
    logprob_tolerance: float = LOGPROB_TOLERANCE  # max |recomputed - stored| log-prob (docs/guides/reliability.md)


class DDPO(ClippedPolicyGradient):
    """DDPO, built from `DDPOConfig` (``DDPO(config)`` or ``DDPO(**fields)``, `diffalign.methods.method_config`), whose
    defaults are ddpo-pytorch's `config/base.py`; the other arguments are `ClippedPolicyGradient`'s.

    With timestep_fraction 1 every stored transition of every sample is trained once per inner epoch, as in
    ddpo-pytorch (which permutes each sample's transitions with its own `torch.randperm` and trains the first
    ⌊K · timestep_fraction⌋); below 1 the trained subset is by default one random draw shared by the batch
    (`timestep_selection="random"`), and one per sample as ddpo-pytorch with `timestep_selection="per_sample"`."""

    def __init__(self, config: DDPOConfig | None = None, **fields):
        config = method_config(DDPOConfig, config, fields)
        super().__init__(clip_range=config.clip_range, beta_kl=config.beta_kl, kl_form="exact",
                         detach_unconditional=False,
                         advantage="per_prompt", timestep_fraction=config.timestep_fraction,
                         timestep_selection=config.timestep_selection, logprob_check=config.logprob_check,
                         logprob_tolerance=config.logprob_tolerance)
