"""MixGRPO's windowed SDE (Li et al., arXiv:2507.21802): Flow-GRPO's SDE inside a sliding window of steps, the Euler
ODE elsewhere; only the window's transitions have log-probs and are trained: ``sampler=window_sde``
(docs/guides/samplers.md#window_sde).

Rollout of K steps in epoch e: steps k in the window W(e) = [l, min(l + w, K − 2)) are drawn with `flow_sde_step`
(noise level a = ``noise_level``, per-step log-probs); every other step is the deterministic Euler step
x_k + (σ_{k+1} − σ_k) v̂ (std 0, ``Trajectory.trainable`` False), so a policy-gradient method trains only W(e)
(`diffalign.objectives.policy_gradient.transition_plan` draws among the trainable steps).

The window start l follows the "progressive" schedule of MixGRPO's released code (``GRPOTrainingStates`` in
Tencent-Hunyuan/MixGRPO, with ``--prog_overlap --roll_back`` as its FLUX script runs it): it starts at 0, moves by
``window_stride`` (``prog_overlap_step``, 1) after every ``shift_interval`` (``iters_per_group``, 25) iterations, and
rolls back to 0 once it passes ``max_timesteps = K − 2``; the window end is clipped at K − 2 (so the last two steps
are never in a window). One iteration there is one sampling-and-training round, an online epoch here:

    l(e) = ((e // shift_interval) mod n) · window_stride,   n = ⌈(K − 2) / window_stride⌉.

One deviation: the released cycle also visits l = K − 2, whose window [K − 2, K − 2) is empty (a round that trains
nothing); n above skips it. The released script's values are w = 4 (``group_size``), K = 25, a = 0.7 (``eta`` with
``--flow_grpo_sampling``), CFG 0 on guidance-distilled FLUX (the defaults here keep ``flow_sde``'s CFG 4.5 for models
with classifier-free guidance). MixGRPO-Flash's higher-order ODE solver after the window (``dpm_apply_strategy=post``)
is not implemented: outside the window this sampler takes first-order Euler steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from diffalign.config.checks import ConfigError, integer, number
from diffalign.samplers.base import FlowSampler, register_sampler
from diffalign.samplers.flow_sde import flow_sde_step


def window_start(epoch: int, num_inference_steps: int, *, shift_interval: int, window_stride: int) -> int:
    """The window's first step l in `epoch` (module docstring).

    Raises:
        ValueError: for `num_inference_steps < 3`, a negative epoch, or an interval / stride below 1.
    """
    if num_inference_steps < 3 or epoch < 0 or shift_interval < 1 or window_stride < 1:
        raise ValueError(f"window_start needs num_inference_steps >= 3, epoch >= 0, shift_interval >= 1 and "
                         f"window_stride >= 1; got {num_inference_steps}, {epoch}, {shift_interval}, {window_stride}")
    end = num_inference_steps - 2
    positions = -(-end // window_stride)
    return (epoch // shift_interval) % positions * window_stride


@register_sampler
@dataclass
class WindowSDESampler(FlowSampler):
    """``sampler=window_sde``: the Flow-GRPO SDE inside MixGRPO's sliding window, the Euler ODE outside it.

    Attributes:
        noise_level (`float`): the SDE's a ≥ 0 inside the window (MixGRPO: 0.7).
        window_size (`int`): w ≥ 1 steps per window (MixGRPO: 4).
        shift_interval (`int`): epochs ≥ 1 before the window moves (MixGRPO: 25 iterations).
        window_stride (`int`): steps ≥ 1 the window moves by (MixGRPO: 1).
        window_start (`int` or None): pins the window's first step l in [0, K − 3]; None follows the schedule
            (`window_start`; l = 0 outside an online loop).
    """

    name: str = "window_sde"
    num_inference_steps: int = 25
    guidance_scale: float = 4.5
    noise_level: float = 0.7
    window_size: int = 4
    shift_interval: int = 25
    window_stride: int = 1
    window_start: int | None = None

    noise_field: ClassVar[str] = "noise_level"
    log_probs: ClassVar[bool] = True

    def check(self) -> None:
        values = vars(self)
        super().check()
        integer(values, "num_inference_steps", "", ge=3, hint="the window ends 2 steps before the last (MixGRPO)")
        number(values, "noise_level", "", ge=0, hint="the SDE's noise scale inside the window; 0 is the Euler ODE")
        integer(values, "window_size", "", ge=1)
        integer(values, "shift_interval", "", ge=1, hint="epochs before the window moves (MixGRPO: 25)")
        integer(values, "window_stride", "", ge=1, hint="steps the window moves by (MixGRPO: 1)")
        integer(values, "window_start", "", ge=0, nullable=True)
        if self.window_start is not None and self.window_start > self.num_inference_steps - 3:
            raise ConfigError(f"window_start={self.window_start} must be <= num_inference_steps - 3 = "
                              f"{self.num_inference_steps - 3} (the window ends at step K - 2); or null to follow "
                              "the schedule")

    @property
    def window(self) -> range:
        """The steps with noise and log-probs: [l, min(l + w, K − 2))."""
        start = self.window_start or 0
        return range(start, min(start + self.window_size, self.num_inference_steps - 2))

    def describe(self) -> str:
        where = "scheduled" if self.window_start is None else f"[{self.window.start}, {self.window.stop})"
        return f"window_sde noise_level={self.noise_level} window={self.window_size} {where}"

    def at_epoch(self, epoch: int) -> WindowSDESampler:
        if self.window_start is not None:
            return self
        return dataclasses.replace(self, window_start=window_start(
            epoch, self.num_inference_steps, shift_interval=self.shift_interval, window_stride=self.window_stride))

    def step(self, schedule, k, model_output, sample, *, generator=None, prev_sample=None, reduction="mean"):
        # a stored trajectory says which steps were in its window (its trainable mask); a rollout asks the window
        noisy = bool(schedule.trainable[k]) if schedule.trainable is not None else k in self.window
        sigmas = schedule.sigmas
        return flow_sde_step(model_output, sigmas[k], sigmas[k + 1], sample,
                             noise_level=self.noise_level if noisy else 0.0, sigma_max=float(sigmas[1]),
                             generator=generator, prev_sample=prev_sample, reduction=reduction)
