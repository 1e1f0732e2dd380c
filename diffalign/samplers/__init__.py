"""Samplers: one `Sampler` per option of the ``sampler`` config group (`diffalign.samplers.base`), their step rules
with log-probabilities, and the group rollouts of the online loop. Importing the package registers the built-in
options (each file registers its own)."""

from diffalign.samplers import cps, ddim_logprob, flow_sde, ode, window_sde  # noqa: F401 (register the options)
from diffalign.samplers.base import SAMPLERS, Sampler, build_sampler, register_sampler
from diffalign.samplers.ddim_logprob import DDIMStepOutput, ddim_step, ddim_variance
from diffalign.samplers.rollout import recompute_log_probs, rollout

__all__ = ["SAMPLERS", "DDIMStepOutput", "Sampler", "build_sampler", "ddim_step", "ddim_variance",
           "recompute_log_probs", "register_sampler", "rollout"]
