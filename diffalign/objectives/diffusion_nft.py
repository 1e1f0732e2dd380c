r"""DiffusionNFT, negative-aware fine-tuning (Zheng et al., ICLR 2026; arXiv:2509.16117); see
docs/methods/diffusion_nft.md.

Online and likelihood-free: the old policy v_old samples a group of G clean images per prompt with *any* solver (an
ODE here, CFG-free), the rewards become optimality probabilities r ∈ [0, 1], and the training policy v_θ is fitted on
the forward process (the clean rollouts noised again, x_t = (1 − σ) x_0 + σ ε, target v = ε − x_0) through two
implicit policies (docs/methods/diffusion_nft.md (N2), the paper's policy-optimisation theorem)

$$v^+_\theta = (1-\beta)\,v_{old} + \beta\,v_\theta,\qquad v^-_\theta = (1+\beta)\,v_{old} - \beta\,v_\theta,$$
$$\mathcal L(\theta) = \mathbb E\big[\,r\,\|v^+_\theta(x_t) - v\|^2 + (1-r)\,\|v^-_\theta(x_t) - v\|^2\,\big],$$

with r = ½ + ½ clip(A / A_max, −1, 1) from the group advantage A (N3). As the released code (NVlabs/DiffusionNFT
``scripts/train_nft_sd3.py``) this module

- weights each branch adaptively in x_0 space (N4): ‖x̂_0 − x_0‖² / sg(mean |x̂_0 − x_0|) with x̂_0 = x_t − σ v±
  (``loss_weighting="adaptive"``; ``"uniform"`` is the plain velocity MSE of the equation above);
- scales the loss by A_max / β (the code's ``(r·pos + (1 − r)·neg) / beta · adv_clip_max``);
- trains each rollout on ⌊K · timestep_fraction⌋ of the K timesteps of the model's own K-step inference schedule
  (`training_schedule`), a permutation drawn *per sample*, with fresh noise per (sample, timestep);
- adds β_KL · mean ‖v_θ − v_ref‖² against the run's reference strategy (frozen base by default: the code's
  adapter-disabled transformer);
- keeps v_old in a second LoRA adapter ``"old"``, equal to θ at the start and soft-updated after every epoch
  θ_old ← η θ_old + (1 − η) θ with η = min(rate · max(0, s − flat), η_max) at optimizer step s (N5).

At θ = θ_old the gradient of L/β is (2r − 1)·∇‖v_θ − v‖² whatever β (docs/methods/diffusion_nft.md, "What β does"):
samples above their group mean are fitted, those below are pushed away, and β only weighs the proximal term β‖v_θ −
v_old‖² once θ has moved from θ_old. Every inferred choice and deviation is listed in docs/methods/diffusion_nft.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from diffalign.config.schemas import config_schema
from diffalign.methods import NOISE, TIMESTEPS, OnlineEpoch, method_config, split_updates, stream_seed
from diffalign.objectives.policy_gradient import trajectory_minibatches
from diffalign.reference.adapter import ReferenceAdapter
from diffalign.reference.old_policy import OLD_ADAPTER

LOSS_WEIGHTINGS = ("adaptive", "uniform")
WEIGHT_FLOOR = 1e-5  # the released code's clip(min=0.00001) of the adaptive weight


def optimality_probability(advantages: torch.Tensor, advantage_max: float) -> torch.Tensor:
    r"""The optimality probability r = ½ + ½ clip(A / A_max, −1, 1) (docs/methods/diffusion_nft.md (N3), the paper's
    "optimality reward" [REVIEW]; code ``clamp(adv, ±adv_clip_max) / adv_clip_max / 2 + 0.5``).

    Args:
        advantages (`torch.Tensor`): `(N,)` normalised rewards A = (r_raw − group mean) / Z (the loop's
            ``advantage="group"``; Z the group's or the epoch's std, ``online.advantage_std``).
        advantage_max (`float`): A_max > 0; A ≥ A_max maps to r = 1, A ≤ −A_max to r = 0.

    Returns:
        `torch.Tensor` `(N,)` float32 in [0, 1]; 0.5 for a sample at its group's mean.
    """
    return (0.5 + 0.5 * (advantages.float() / advantage_max).clamp(-1.0, 1.0)).clamp(0.0, 1.0)


def implicit_policies(v_theta: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The implicit positive and negative policies v⁺ = (1 − β) v_old + β v_θ and v⁻ = (1 + β) v_old − β v_θ
    (docs/methods/diffusion_nft.md (N2), the paper's policy-optimisation theorem). `v_old` is detached.

    Args: `v_theta`, `v_old` `(B, ...)` velocity predictions; `beta` β > 0.
    Returns: `(v_plus, v_minus)`, each `(B, ...)`; their mean is v_old.
    """
    v_old = v_old.detach()
    return (1.0 - beta) * v_old + beta * v_theta, (1.0 + beta) * v_old - beta * v_theta


def branch_loss(v_branch: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor, weighting: str) -> torch.Tensor:
    r"""One branch's per-sample regression loss (docs/methods/diffusion_nft.md (N1), (N4)).

    - ``"uniform"``: mean ‖v_branch − v‖² (the flow-matching loss with w(t) = 1).
    - ``"adaptive"``: mean ‖x̂_0 − x_0‖² / sg(max(mean |x̂_0 − x_0|, 1e-5)) with x̂_0 − x_0 = −σ (v_branch − v)
      (x̂_0 = x_t − σ v_branch and x_0 = x_t − σ v), the released code's self-normalised x_0 loss; the weight is
      computed in float64 as there.

    Args:
        v_branch (`torch.Tensor`): `(B, C, h, w)` v⁺ or v⁻.
        target (`torch.Tensor`): `(B, C, h, w)` the flow-matching target v = ε − x_0.
        sigma (`torch.Tensor`): `(B, 1, 1, 1)` noise level σ = t / 1000 of each row.
        weighting (`str`): "adaptive" or "uniform".

    Returns:
        `torch.Tensor` `(B,)` float32.
    """
    diff = v_branch.float() - target.float()
    dims = tuple(range(1, diff.ndim))
    if weighting == "uniform":
        return diff.square().mean(dim=dims)
    err = -sigma.float() * diff  # x̂_0 − x_0
    with torch.no_grad():
        weight = err.double().abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
    return (err.square() / weight).mean(dim=dims).float()


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor,
             r: torch.Tensor, beta: float, weighting: str = "adaptive") -> torch.Tensor:
    r"""The per-sample DiffusionNFT loss r ℓ(v⁺) + (1 − r) ℓ(v⁻) (docs/methods/diffusion_nft.md (N2), the paper's
    policy-optimisation theorem), unscaled (the method multiplies it by A_max / β, as the released code).

    Args:
        v_theta (`torch.Tensor`): `(B, C, h, w)` the training policy's velocity (with gradient).
        v_old (`torch.Tensor`): `(B, C, h, w)` the old policy's velocity on the same x_t (detached here).
        target (`torch.Tensor`): `(B, C, h, w)` v = ε − x_0.
        sigma (`torch.Tensor`): `(B, 1, 1, 1)` σ of each row (used by the adaptive weighting only).
        r (`torch.Tensor`): `(B,)` optimality probabilities in [0, 1] (`optimality_probability`).
        beta (`float`): β > 0.
        weighting (`str`, defaults to "adaptive"): see `branch_loss`.

    Returns:
        `torch.Tensor` `(B,)` float32.
    """
    v_plus, v_minus = implicit_policies(v_theta, v_old, beta)
    r = r.to(v_theta.device).float()
    return r * branch_loss(v_plus, target, sigma, weighting) + (1 - r) * branch_loss(v_minus, target, sigma, weighting)


def old_policy_decay(step: int, decay_max: float, decay_rate: float, flat_steps: int) -> float:
    r"""η of the soft update θ_old ← η θ_old + (1 − η) θ after `step` optimizer steps (docs/methods/diffusion_nft.md
    (N5); code ``return_decay``): 0 for the first `flat_steps` steps, then min(decay_rate · (step − flat_steps),
    decay_max).
    """
    if step < flat_steps:
        return 0.0
    return min(decay_rate * (step - flat_steps), decay_max)


class SoftUpdateOldPolicy:
    """DiffusionNFT's old (sampling) policy v_old: a second LoRA adapter ``"old"``, a copy of the policy's at the
    start, soft-updated once per epoch (`soft_update`, after the epoch's last optimizer step).

    Args:
        decay_max (`float`, defaults to 0.5): the η schedule's maximum (`old_policy_decay`).
        decay_rate (`float`, defaults to 0.001): its rate per step.
        flat_steps (`int`, defaults to 0): the steps before it rises.
    """

    def __init__(self, decay_max: float = 0.5, decay_rate: float = 0.001, flat_steps: int = 0):
        self.decay_max, self.decay_rate, self.flat_steps = decay_max, decay_rate, flat_steps
        self.adapter: ReferenceAdapter | None = None
        self.step = 0

    def setup(self, policy) -> None:
        """Adds the ``"old"`` adapter holding a copy of the policy's current adapter."""
        self.adapter = ReferenceAdapter(policy, adapter_name=OLD_ADAPTER)
        self.adapter.load(self.adapter.snapshot_policy(), "the policy's initial adapter")

    @contextlib.contextmanager
    def use(self, policy) -> Iterator[Any]:
        """Runs the block with v_old (the ``"old"`` adapter, eval mode)."""
        with self.adapter.activate():
            yield policy

    def after_update(self) -> None:
        """Counts optimizer steps (the η schedule's clock); θ_old changes only in `soft_update`."""
        self.step += 1

    def decay(self) -> float:
        return old_policy_decay(self.step, self.decay_max, self.decay_rate, self.flat_steps)

    def soft_update(self) -> float:
        """θ_old ← η θ_old + (1 − η) θ with η at the current step; returns η."""
        eta = self.decay()
        self.adapter.lerp_towards_policy(1.0 - eta)
        return eta

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "weights": {k: p.detach() for k, p in self.adapter.params.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.adapter.load(state["weights"], "the checkpoint's old policy")


@config_schema("method", "diffusion_nft")
@dataclass
class DiffusionNFTConfig:
    """Config of `DiffusionNFT` (``method=diffusion_nft`` extends it); the one place its defaults are written (the
    method is built from it: `diffalign.methods.method_config`): the released GenEval config's ([CODE] =
    NVlabs/DiffusionNFT ``config/nft.py`` / ``config/base.py``)."""

    _target_: str = "diffalign.objectives.diffusion_nft.DiffusionNFT"
    beta: float = 1.0                   # config.beta = 1.0 (GenEval, PickScore, HPSv2); 0.1 OCR, multi-reward [CODE]
    beta_kl: float = 1.0e-4             # config.train.beta = 0.0001, velocity L2 to the adapter-disabled base [CODE]
    advantage_max: float = 5.0          # train.adv_clip_max = 5: r = 1/2 + A / (2 * 5) [CODE]
    loss_weighting: str = "adaptive"    # x0-space self-normalised weighting [CODE] | uniform
    timestep_fraction: float = 0.99     # train.timestep_fraction: int(10 * 0.99) = 9 timesteps per sample [CODE]
    old_policy_decay_max: float = 0.5   # decay_type 1 (GenEval): uphold 0.5; decay_type 2 (OCR): 0.999 [CODE]
    old_policy_decay_rate: float = 0.001  # decay_type 1: uprate 0.001; decay_type 2: 0.0075 [CODE]
    old_policy_flat_steps: int = 0      # decay_type 1: flat 0; decay_type 2: 75 [CODE]


class DiffusionNFT:
    """The DiffusionNFT objective (data flow "online_groups").

    Built from `DiffusionNFTConfig`, the one place its defaults are written: ``DiffusionNFT(config)`` or
    ``DiffusionNFT(**fields)`` (the fields not given keep their `DiffusionNFTConfig` defaults;
    `diffalign.methods.method_config`).

    Fields:
        beta (`float`): β > 0 of the implicit policies (1 GenEval/PickScore, 0.1 OCR).
        beta_kl (`float`): weight of mean ‖v_θ − v_ref‖² (≥ 0; 0 drops the reference forward).
        advantage_max (`float`): A_max of `optimality_probability` and the loss scale A_max / β.
        loss_weighting (`str`): "adaptive" (x_0-space, released) or "uniform" (velocity MSE).
        timestep_fraction (`float`): each sample trains on max(1, ⌊K · fraction⌋) of the K
            timesteps of `training_schedule` (K = the rollout's steps), a per-sample random subset.
        old_policy_decay_max (`float`): the soft update's η schedule (`old_policy_decay`): its
            maximum (0.5 GenEval, 0.999 OCR).
        old_policy_decay_rate (`float`): its rate per optimizer step (0.0075 OCR).
        old_policy_flat_steps (`int`): the steps before it rises (75 OCR).

    Raises:
        ValueError: for β ≤ 0, β_KL < 0, A_max ≤ 0, an unknown weighting, a fraction outside (0, 1], η_max outside
            [0, 1), a negative rate or flat period (naming the ``method.`` field).
    """

    data_flow = "online_groups"
    log_prob_reduction = "mean"  # (ODE rollouts store none; the loss never reads them)
    advantage = "group"
    rollout_policy: SoftUpdateOldPolicy | None = None  # v_old, made by `setup`

    def __init__(self, config: DiffusionNFTConfig | None = None, **fields):
        config = method_config(DiffusionNFTConfig, config, fields)
        if config.beta <= 0:
            raise ValueError(f"method.beta={config.beta} must be > 0 (DiffusionNFT: 1.0 GenEval, 0.1 OCR).")
        if config.beta_kl < 0:
            raise ValueError(f"method.beta_kl={config.beta_kl} must be >= 0 (1e-4 in the released config; 0 disables).")
        if config.advantage_max <= 0:
            raise ValueError(f"method.advantage_max={config.advantage_max} must be > 0 (5 in the released config).")
        if config.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"method.loss_weighting={config.loss_weighting!r} must be one of {LOSS_WEIGHTINGS}.")
        if not 0 < config.timestep_fraction <= 1:
            raise ValueError(f"method.timestep_fraction={config.timestep_fraction} must be in (0, 1].")
        if not 0 <= config.old_policy_decay_max < 1:
            raise ValueError(f"method.old_policy_decay_max={config.old_policy_decay_max} must be in [0, 1) (0.5 "
                             "GenEval).")
        if config.old_policy_decay_rate < 0:
            raise ValueError(f"method.old_policy_decay_rate={config.old_policy_decay_rate} must be >= 0.")
        if config.old_policy_flat_steps < 0:
            raise ValueError(f"method.old_policy_flat_steps={config.old_policy_flat_steps} must be >= 0.")
        self.beta, self.beta_kl, self.advantage_max = config.beta, config.beta_kl, config.advantage_max
        self.loss_weighting, self.timestep_fraction = config.loss_weighting, config.timestep_fraction
        self.old_policy_decay_max = config.old_policy_decay_max
        self.old_policy_decay_rate = config.old_policy_decay_rate
        self.old_policy_flat_steps = config.old_policy_flat_steps

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """DiffusionNFT's checks of a run config (before any model loads): CFG-free rollouts (the data must come from
        v_old itself), no best-of-n selection (every sample of π_old is used), and an ``online.advantage_clip`` that
        does not cut the advantages below ``method.advantage_max`` (else r never reaches 0 or 1). Any sampler is
        accepted, ODE or SDE (the method never reads log-probs).

        Raises:
            ValueError: naming the field and the fix; also for a model that is not a rectified-flow one (its class's
                ``flow_matching`` attribute), before it loads.
        """
        from diffalign.config.checks import target_attribute

        on, sp, m = cfg.online, cfg.sampler, cfg.method
        if target_attribute(cfg.model.get("_target_"), "flow_matching") is False:
            raise ValueError(f"method=diffusion_nft trains rectified-flow (velocity) models, but model="
                             f"{cfg.model._target_} is an eps/v-prediction model; use a flow model (model=tiny_sd3, "
                             "model=sd35_medium)")
        if sp.guidance_scale != 1:
            raise ValueError(f"method=diffusion_nft is CFG-free: its rollouts must come from the old policy v_old "
                             f"itself (arXiv:2509.16117; released config sample.guidance_scale=1.0), but "
                             f"sampler.guidance_scale={sp.guidance_scale}. Set sampler.guidance_scale=1")
        if on.get("best_of_n") is not None:
            raise ValueError("online.best_of_n selects samples for the policy-gradient methods; DiffusionNFT trains "
                             "on every sample of the old policy: set online.best_of_n=null")
        clip = on.get("advantage_clip")
        if clip is not None and clip < m.advantage_max:
            raise ValueError(f"online.advantage_clip={clip} is below method.advantage_max={m.advantage_max}: the "
                             "optimality probability r = 1/2 + A / (2 A_max) could never reach 0 or 1. Set "
                             "online.advantage_clip >= method.advantage_max (both 5 in the released config)")

    def setup(self, policy) -> None:
        """Adds v_old (`SoftUpdateOldPolicy`) to the policy (a rectified-flow one: `check_config` refuses other models
        before they load, as the x_0-space weighting and the forward process x_t = (1 − σ) x_0 + σ ε are the flow
        ones)."""
        self.rollout_policy = SoftUpdateOldPolicy(self.old_policy_decay_max, self.old_policy_decay_rate,
                                                  self.old_policy_flat_steps)
        self.rollout_policy.setup(policy)

    def checkpoint_states(self) -> dict[str, SoftUpdateOldPolicy]:
        """v_old is saved with every checkpoint as ``old_policy_state``."""
        return {"old_policy_state": self.rollout_policy}

    def epoch_updates(self, updates_per_epoch: int, num_inner_epochs: int) -> int:
        """``online.num_inner_epochs`` passes of ``online.updates_per_epoch`` updates each."""
        return updates_per_epoch * num_inner_epochs

    def prepare(self, policy, epoch: OnlineEpoch) -> dict[str, float]:
        """Logs the epoch's mean optimality probability, the fraction of samples above their group's mean (r > ½)
        and η, the decay of v_old's latest soft update."""
        r = optimality_probability(epoch.advantages, self.advantage_max)
        return {"nft/r_mean": float(r.mean()), "nft/positive_fraction": float((r > 0.5).float().mean()),
                "nft/old_policy_decay": self.rollout_policy.decay()}

    def plan(self, policy, epoch: OnlineEpoch) -> Iterator[list[_NFTUnit]]:
        """The epoch's updates: ``epoch.inner_epochs`` passes, each over the minibatches of `trajectory_minibatches`
        × n training-timestep slots (slot j of a row is its j-th drawn timestep of `training_schedule`, drawn by
        `train_timesteps`), cut into ``epoch.updates`` contiguous updates (`split_updates`). After the last update,
        the soft update of v_old."""
        schedule = training_schedule(policy, len(epoch.trajectory.timesteps))
        n_train = max(1, int(len(schedule) * self.timestep_fraction))
        members = member_ordinals(epoch.group_ids)
        for inner in range(epoch.inner_epochs):
            order = train_timesteps(epoch, members, inner, len(schedule), n_train)
            minibatches, _ = trajectory_minibatches(epoch.group_ids, epoch.batch_size, seed=epoch.seed,
                                                    epoch=epoch.epoch, inner=inner)
            units = [_NFTUnit(epoch, rows, schedule[order[rows, j]], members[rows], inner, j)
                     for rows in minibatches for j in range(n_train)]
            yield from split_updates(units, epoch.updates)
        self.rollout_policy.soft_update()

    def loss(self, policy, unit: _NFTUnit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one unit: rows ``unit.rows`` of the epoch, each at its own timestep ``unit.timesteps``, with
        the noise of `training_noise`."""
        epoch, rows = unit.epoch, unit.rows
        traj = epoch.trajectory
        x0 = traj.latents[rows.to(traj.latents.device), -1]
        noise = training_noise(x0.shape[1:], epoch, epoch.group_ids[rows], unit.members, unit.inner, unit.slot)
        return self(policy, x0, traj.prompt_embeds.index(rows.to(traj.prompt_embeds.prompt_embeds.device)),
                    epoch.advantages[rows], timesteps=unit.timesteps.to(x0.device), noise=noise.to(x0.device),
                    reference=reference)

    def __call__(self, policy, x0: torch.Tensor, prompt_embeds, advantages: torch.Tensor, *, timesteps: torch.Tensor,
                 noise: torch.Tensor, reference=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of a micro-batch of clean rollouts at their training timesteps.

        Args:
            policy (`DiffusionPolicy`): a flow policy θ (LoRA adapter active) after `setup`.
            x0 (`torch.Tensor`): `(B, C, h, w)` the rollouts' final latents.
            prompt_embeds (`PromptEmbeds`): their `B` prompts (conditional rows; the forwards are unguided).
            advantages (`torch.Tensor`): `(B,)` group advantages A.
            timesteps (`torch.Tensor`): `(B,)` training timesteps t = 1000 σ (or a scalar).
            noise (`torch.Tensor`): `(B, C, h, w)` ε of the forward process.
            reference (`ReferenceStrategy`, *optional*): the run's reference strategy (a `use(policy)` context);
                needed when β_KL > 0.

        Returns:
            (scalar loss (A_max / β) · mean_i [r_i ℓ⁺_i + (1 − r_i) ℓ⁻_i] + β_KL · mean ‖v_θ − v_ref‖², detached
            metrics ``loss, policy_loss, kl, old_deviation, r``).

        Raises:
            ValueError: when β_KL > 0 and no reference is given.
        """
        t = torch.as_tensor(timesteps, device=x0.device)
        t = t.expand(x0.shape[0]) if t.ndim == 0 else t
        x_t = policy.add_noise(x0, noise, t)
        target = policy.training_target(x0, noise, t)
        sigma = policy.sigmas_of(t, x_t)
        with torch.no_grad(), self.rollout_policy.use(policy):
            v_old = policy.predict(x_t, t, prompt_embeds, guidance_scale=1.0)
        v_theta = policy.predict(x_t, t, prompt_embeds, guidance_scale=1.0)
        r = optimality_probability(advantages.to(x0.device), self.advantage_max)
        policy_loss = (self.advantage_max / self.beta) * nft_loss(v_theta, v_old, target, sigma, r, self.beta,
                                                                  self.loss_weighting).mean()
        kl = torch.zeros((), device=policy_loss.device)
        if self.beta_kl > 0:
            if reference is None:
                raise ValueError("method.beta_kl > 0 needs a reference; the loop passed none.")
            with torch.no_grad(), reference.use(policy):
                v_ref = policy.predict(x_t, t, prompt_embeds, guidance_scale=1.0)
            kl = (v_theta.float() - v_ref.float()).square().mean()
        loss = policy_loss + self.beta_kl * kl
        metrics = {"loss": loss.detach(), "policy_loss": policy_loss.detach(), "kl": kl.detach(),
                   "old_deviation": (v_theta.detach() - v_old).float().square().mean(), "r": r.mean()}
        return loss, metrics


class _NFTUnit(NamedTuple):
    """One DiffusionNFT micro-batch: rows `rows` of the epoch, row i at training timestep ``timesteps[i]``."""

    epoch: OnlineEpoch
    rows: torch.Tensor  # (B,) int64
    timesteps: torch.Tensor  # (B,) float32 t = 1000 σ, entries of `training_schedule`
    members: torch.Tensor  # (B,) int64 member ordinal of each row within its group on this process
    inner: int
    slot: int  # j: the row's j-th training timestep of this inner epoch


def member_ordinals(group_ids: torch.Tensor) -> torch.Tensor:
    """`(N,)` int64: the position of each row among this process's rows of its group (0, 1, … in row order)."""
    seen: dict[int, int] = {}
    out = []
    for g in group_ids.tolist():
        out.append(seen.get(g, 0))
        seen[g] = out[-1] + 1
    return torch.tensor(out, dtype=torch.long)


def _row_seed(epoch: OnlineEpoch, group: int, member: int, inner: int, slot: int, stream: int) -> int:
    # one stream per (group, member, inner epoch, slot): members < G and slots < 1000 keep the keys distinct
    return stream_seed(epoch.seed, epoch.epoch, group, (inner * epoch.group_size + member) * 1000 + slot, stream)


def training_schedule(policy, num_steps: int) -> torch.Tensor:
    """`(num_steps,)` float32 CPU training timesteps t = 1000 σ: the model's own inference schedule for the rollout's
    number of steps (a fresh copy of ``policy.scheduler``, for SD3 `FlowMatchEulerDiscreteScheduler` with its shift:
    σ_0 = 1 … σ_{K−1} > 0), whatever solver made the rollouts. The released code trains on
    ``pipeline.scheduler.timesteps`` (the SD3 Euler schedule) while its DPM-Solver samples on the same sigmas;
    diffusers' flow DPM-Solver (``sampler=dpm_ode``) uses another spacing, so the rollout's own timesteps are not
    used."""
    scheduler = type(policy.scheduler).from_config(policy.scheduler.config)
    scheduler.set_timesteps(num_steps)
    return scheduler.timesteps.detach().float().cpu()


def train_timesteps(epoch: OnlineEpoch, members: torch.Tensor, inner: int, num_steps: int, n_train: int
                    ) -> torch.Tensor:
    """`(N, n_train)` int64 indices into the K = `num_steps` training timesteps: for each row the first `n_train` of
    its own permutation (the released code's per-sample ``torch.randperm``), keyed by (seed, epoch, global group id,
    member, inner epoch), so it does not depend on the micro-batching or, with ``online.split=groups``, the process
    count."""
    rows = []
    for g, m in zip(epoch.group_ids.tolist(), members.tolist()):
        gen = torch.Generator().manual_seed(_row_seed(epoch, g, m, inner, 999, TIMESTEPS))
        rows.append(torch.randperm(num_steps, generator=gen)[:n_train])
    return torch.stack(rows)


def training_noise(shape: tuple[int, ...], epoch: OnlineEpoch, group_ids: torch.Tensor, members: torch.Tensor,
                   inner: int, slot: int) -> torch.Tensor:
    """`(B, *shape)` float32 CPU forward-process noise ε, fresh for every (row, inner epoch, slot), keyed like
    `train_timesteps`. With ``online.split=members`` the member ordinal is per process, so members of one group on
    different processes draw the same ε (with different x_0)."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(
        _row_seed(epoch, g, m, inner, slot, NOISE))) for g, m in zip(group_ids.tolist(), members.tolist())])
