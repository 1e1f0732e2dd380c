r"""GRPO-Guard (Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
Clipping", arXiv:2510.22319, §3), docs/methods/grpo_guard.md: Flow-GRPO with a normalised importance ratio and a
per-timestep gradient weight, so that PPO clipping bounds every denoising step alike and no step dominates the update.

**Why.** A Flow-GRPO step is Gaussian, x_{k+1} = μ_old + s_k ε with ε ~ N(0, I) and s_k = σ_t √Δt_k the step std
(`diffalign.samplers.flow_sde.flow_sde_step`). With Δμ = μ_θ − μ_old and log-probs averaged over the D latent
elements (Flow-GRPO's reduction) the log-ratio is

$$\log\rho_k=\tfrac1D\textstyle\sum\big(\varepsilon\,\Delta\mu/s_k-\Delta\mu^2/(2s_k^2)\big),$$

whose mean over ε is −‖Δμ‖²/(2 D s_k²) < 0 and whose spread scales with 1/s_k: the ratio is biased below 1, more so
at low-noise steps, so the upper clip 1 + ε_c rarely stops a positive-advantage update (the paper's "implicit
over-optimization": the proxy reward rises while the gold score falls).

**RatioNorm** (§3.2, paper eq. 8) removes the bias and the 1/s_k scale:

$$\log\hat\rho_k=s_k\Big(\log\rho_k+\frac{\|\Delta\mu\|^2}{2Ds_k^2}\Big)=\tfrac1D\textstyle\sum\varepsilon\,\Delta\mu,$$

centred on 0 with a spread that no longer depends on the step's noise level.

**Gradient reweighting** (§3.2, paper eq. 12). After RatioNorm, ∂ log ρ̂/∂v_θ = ε ∂μ/∂v = ε Δt_k (1 + a²/2) for the
Flow-GRPO SDE (σ_t = a √(t/(1−t)) makes the drift's (1 − t)σ_t²/(2t) the constant a²/2), so steps with a large Δt_k
would dominate; the clipped term of step k is multiplied by δ_k = 1/Δt_k (the constant 1 + a²/2 is absorbed in the
learning rate), equalising the gradient over timesteps.

Loss of transition k (the KL term unchanged from Flow-GRPO):

$$\mathcal L_k=\delta_k\operatorname{mean}_i\max\big(-A_i\hat\rho_{ik},\,-A_i\operatorname{clip}(\hat\rho_{ik},1-\epsilon_c,
1+\epsilon_c)\big)+\beta_{KL}\operatorname{mean}_iD_{KL}.$$

**Released code.** The authors' own release was not found in the reference index this was written from; the
formulas are the paper's as two public implementations that cite it compute them: Flow-Factory
(X-GenGroup/Flow-Factory, ``trainers/rl/grpo.py``, ``GRPOGuardTrainer._guard_ratio``: ``Δlogp · s + mse / (2 s)``
per sample, one exponentiation, RatioNorm only) and TeleBoost (``recipe/teleboost/algorithms/grpo_guard.py``:
``compute_ratio_norm_bias`` and ``δ = 1/Δt`` for Flow-GRPO). tests/unit/objectives/test_grpo_guard.py checks ρ̂ and δ
against an independent hand computation (ε recovered from the stored sample) on small tensors.

**μ_old.** The released implementations store the rollout's step mean μ_old with the trajectory; diffalign's
rollouts store log-probs only, so `GRPOGuard.prepare` recomputes μ_old once per epoch, before the first update (θ is
still θ_old then: the same forward the train/rollout consistency alarm compares), at the cost of one extra
no-gradient forward per trained transition per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffalign.config.schemas import config_schema
from diffalign.methods import method_config
from diffalign.objectives.policy_gradient import LOGPROB_TOLERANCE, ClippedPolicyGradient, TransitionUnit
from diffalign.samplers.rollout import recompute_step
from diffalign.types import Trajectory

GRAD_REWEIGHTS = ("inverse_dt", "none")
GUARD_SAMPLERS = ("flow_sde", "window_sde")
"""The samplers whose trained steps are Flow-GRPO SDE steps (`diffalign.samplers.flow_sde.flow_sde_step`), the step
the reweighting δ_k = 1/Δt_k is derived for."""


@config_schema("method", "grpo_guard")
@dataclass
class GRPOGuardConfig:
    """Config of `GRPOGuard` (``method=grpo_guard`` extends it); the one place its defaults are written (the method is
    built from it: `diffalign.methods.method_config`): the Flow-GRPO ones are the released Flow-GRPO GenEval defaults
    (GRPO-Guard changes only the ratio and the weight)."""

    _target_: str = "diffalign.objectives.grpo_guard.GRPOGuard"
    clip_range: float = 1.0e-4
    beta_kl: float = 0.04
    kl_form: str = "code"
    detach_unconditional: bool = True
    timestep_fraction: float = 0.99
    timestep_selection: str = "first"
    ratio_norm: bool = True             # RatioNorm, paper eq. 8
    grad_reweight: str = "inverse_dt"   # inverse_dt: δ_k = 1/Δt_k (paper eq. 12); none: δ_k = 1 (Flow-Factory)
    logprob_check: str = "stop"
    logprob_tolerance: float = LOGPROB_TOLERANCE


def guard_log_ratio(new_log_prob: torch.Tensor, old_log_prob: torch.Tensor, new_mean: torch.Tensor,
                    old_mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    r"""RatioNorm's log ρ̂ = s (log π_θ − log π_old + ‖μ_θ − μ_old‖² / (2 D s²)) (arXiv:2510.22319 eq. 8).

    Args:
        new_log_prob (`torch.Tensor`): `(B,)` log π_θ(x_{k+1} | x_k), mean-reduced over the D latent elements.
        old_log_prob (`torch.Tensor`): `(B,)` the rollout's, same reduction.
        new_mean (`torch.Tensor`): `(B, ...)` μ_θ (carries the gradient).
        old_mean (`torch.Tensor`): `(B, ...)` μ_old, the rollout policy's step mean.
        std (`torch.Tensor` or `float`): the step std s > 0, a scalar or `(B, 1, ..., 1)`.

    Returns:
        `(B,)` float32 log ρ̂ (equal to the element mean of ε · (μ_θ − μ_old), ε the rollout's standard normal draw).
    """
    batch = new_log_prob.shape[0]
    s = torch.as_tensor(std, device=new_log_prob.device).float().reshape(-1)
    s = s.expand(batch) if s.numel() == 1 else s.reshape(batch)
    mse = (new_mean.float() - old_mean.float()).pow(2).reshape(batch, -1).mean(dim=1)
    return s * (new_log_prob.float() - old_log_prob.float()) + mse / (2 * s)


def grad_weight(sigmas: torch.Tensor, k: int, form: str = "inverse_dt") -> float:
    """δ_k of the gradient reweighting (arXiv:2510.22319 eq. 12): 1/Δt_k with Δt_k = σ_k − σ_{k+1}, or 1.

    Args:
        sigmas (`torch.Tensor`): `(K+1,)` the trajectory's noise levels, decreasing.
        k (`int`): the transition.
        form (`str`): "inverse_dt" or "none".

    Raises:
        ValueError: for an unknown form or Δt_k ≤ 0.
    """
    if form not in GRAD_REWEIGHTS:
        raise ValueError(f"method.grad_reweight={form!r} must be one of {GRAD_REWEIGHTS}.")
    if form == "none":
        return 1.0
    dt = float(sigmas[k] - sigmas[k + 1])
    if dt <= 0:
        raise ValueError(f"transition {k} has Δt = σ_k − σ_k+1 = {dt:g} ≤ 0; the flow schedule must decrease.")
    return 1.0 / dt


class GRPOGuard(ClippedPolicyGradient):
    """GRPO-Guard: Flow-GRPO (`diffalign.objectives.flow_grpo.FlowGRPO`, same defaults) with RatioNorm and gradient
    reweighting (module docstring). Flow models with Flow-GRPO SDE steps only: ``sampler=flow_sde``, or
    ``sampler=window_sde`` (MixGRPO's window, whose trained steps are Flow-GRPO SDE steps; the two compose as in
    Flow-Factory's GRPO trainer); the reweighting's δ is derived for the Flow-GRPO SDE, as in the released
    implementations, so CPS and DanceGRPO's SDE are refused. The other arguments are `ClippedPolicyGradient`'s, with
    `FlowGRPO`'s defaults.

    Built from `GRPOGuardConfig`, the one place its defaults are written: ``GRPOGuard(config)`` or
    ``GRPOGuard(**fields)`` (the fields not given keep their `GRPOGuardConfig` defaults;
    `diffalign.methods.method_config`).

    Fields:
        ratio_norm (`bool`): clip ρ̂ (`guard_log_ratio`) instead of ρ.
        grad_reweight (`str`): δ_k (`grad_weight`), "inverse_dt" or "none".

    Raises:
        ValueError: as `ClippedPolicyGradient`, or for an unknown `grad_reweight`.
    """

    def __init__(self, config: GRPOGuardConfig | None = None, **fields):
        config = method_config(GRPOGuardConfig, config, fields)
        super().__init__(clip_range=config.clip_range, beta_kl=config.beta_kl, kl_form=config.kl_form,
                         detach_unconditional=config.detach_unconditional, advantage="group",
                         timestep_fraction=config.timestep_fraction, timestep_selection=config.timestep_selection,
                         logprob_check=config.logprob_check, logprob_tolerance=config.logprob_tolerance)
        if config.grad_reweight not in GRAD_REWEIGHTS:
            raise ValueError(f"method.grad_reweight={config.grad_reweight!r} must be one of {GRAD_REWEIGHTS}.")
        self.ratio_norm, self.grad_reweight = bool(config.ratio_norm), config.grad_reweight
        self._old_means: torch.Tensor | None = None

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """Raises ValueError unless the rollouts' trained steps are Flow-GRPO SDE ones (`GUARD_SAMPLERS`) with a
        noise level > 0."""
        super().check_config(cfg, num_processes)
        if cfg.sampler.get("name") not in GUARD_SAMPLERS:
            raise ValueError(f"method=grpo_guard reweights the Flow-GRPO SDE's steps, but sampler.name="
                             f"{cfg.sampler.get('name')!r}. Use sampler=flow_sde (or window_sde) with a flow model "
                             "(model=tiny_sd3, sd35_medium, flux1_dev, wan21_t2v)")

    def prepare(self, policy, epoch) -> dict[str, float]:
        """μ_old of every stored transition of the epoch, recomputed without gradients before the first update
        (θ = θ_old), in minibatches of ``trainer.batch_size`` rows; stored for `loss`.

        Raises:
            ValueError: if the trajectory's trained steps are not Flow-GRPO SDE ones (its sampler is not in
                `GUARD_SAMPLERS`).
        """
        traj = epoch.trajectory
        if traj.sampler not in GUARD_SAMPLERS:
            raise ValueError(f"method=grpo_guard needs Flow-GRPO SDE rollouts; the trajectory's sampler is "
                             f"{traj.sampler!r}. Use sampler=flow_sde (or window_sde)")
        self._old_means = None
        if not self.ratio_norm:
            return {}
        rows = torch.arange(traj.latents.shape[0])
        means = torch.zeros_like(traj.latents[:, 1:])
        with torch.no_grad():
            for start in range(0, len(rows), max(1, epoch.batch_size)):
                idx = rows[start:start + max(1, epoch.batch_size)]
                mb = traj.index(idx)
                for k in range(len(traj.timesteps)):
                    if bool(traj.trainable[k]):
                        means[idx.to(means.device), k] = recompute_step(policy, mb, k).mean.to(means)
        self._old_means = means
        return {}

    def loss(self, policy, unit: TransitionUnit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one unit: `__call__` on rows ``unit.rows`` at transition ``unit.k`` with their stored μ_old,
        times ``unit.weight``."""
        mb = unit.epoch.trajectory.index(unit.rows)
        old_mean = None if self._old_means is None else self._old_means[unit.rows.to(self._old_means.device), unit.k]
        loss, metrics = self(policy, mb, unit.epoch.advantages[unit.rows].to(mb.latents.device), unit.k,
                             reference=reference, old_mean=old_mean)
        return unit.weighted(loss), metrics

    def __call__(self, policy, trajectory: Trajectory, advantages: torch.Tensor, k: int, *, reference=None,
                 old_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of transition `k` of every rollout in `trajectory` (a minibatch).

        Args:
            trajectory (`Trajectory`): `B` Flow-GRPO SDE rollouts with stored `log_probs` `(B, K)` and `sigmas`.
            advantages (`torch.Tensor`): `(B,)`.
            k (`int`): the transition index.
            reference (`ReferenceStrategy`, *optional*): needed when `beta_kl > 0`.
            old_mean (`torch.Tensor`, *optional*): `(B, ...)` μ_old of transition `k` (`prepare`); required with
                `ratio_norm`.

        Returns:
            (scalar loss, detached metrics: `ClippedPolicyGradient`'s, ``ratio`` the mean ρ̂, plus ``ratio_raw``
            (mean ρ), ``ratio_bias`` (mean ‖Δμ‖²/(2 D s²), the negative bias of log ρ that RatioNorm removes) and
            ``grad_weight`` (δ_k)).

        Raises:
            ValueError: with `ratio_norm` and no `old_mean`.
        """
        step = recompute_step(policy, trajectory, k, detach_unconditional=self.detach_unconditional)
        old = trajectory.log_probs[:, k].to(step.log_prob.device)
        self.check_logprobs(step.log_prob, old, k)
        raw = step.log_prob - old
        bias = torch.zeros_like(raw)
        if self.ratio_norm:
            if old_mean is None:
                raise ValueError("method.ratio_norm=true needs the rollout's step means μ_old; GRPOGuard.prepare "
                                 "stores them (pass old_mean when calling the objective directly)")
            log_ratio = guard_log_ratio(step.log_prob, old, step.mean, old_mean.to(step.mean.device), step.std)
            s = torch.as_tensor(step.std).float().reshape(-1).to(raw.device)
            bias = ((step.mean.detach().float() - old_mean.to(step.mean.device).float()).pow(2)
                    .reshape(len(raw), -1).mean(dim=1) / (2 * s ** 2))
        else:
            log_ratio = raw
        weight = grad_weight(trajectory.sigmas, k, self.grad_reweight)
        loss, metrics = self.clipped_loss(policy, trajectory, advantages, k, step, log_ratio, weight=weight,
                                          reference=reference)
        metrics.update({"ratio_raw": torch.exp(raw.detach()).mean(), "ratio_bias": bias.detach().mean(),
                        "grad_weight": torch.tensor(weight)})
        return loss, metrics
