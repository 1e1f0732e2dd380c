"""Step rules with log-probabilities and the unrolled rollout loop."""

from diffalign.samplers.ddim_logprob import DDIMStepOutput, ddim_step, ddim_variance
from diffalign.samplers.rollout import recompute_log_probs, rollout

__all__ = ["DDIMStepOutput", "ddim_step", "ddim_variance", "recompute_log_probs", "rollout"]
