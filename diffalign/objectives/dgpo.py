r"""DGPO — Direct Group Preference Optimization (Luo, Hu, Tang; ICLR 2026; arXiv:2510.08425),
docs/methods/algorithms.md#dgpo.

Online and without a policy gradient: for each prompt a group of G samples x^i (from the rollout policy θ⁻ with a
deterministic ODE sampler), rewards, group-normalised advantages A_i, and a group Bradley–Terry objective whose
trainable bound is (paper Eq. 17, with the per-sample denoising loss ℓ of docs/methods/algorithms.md#denoising-loss)

$$\mathcal L = -\log\sigma\Big(-\beta\lambda_t \sum_{i=1}^{G} A_i\,[\ell_\theta(x^i) - \ell_{ref}(x^i)]\Big),$$

all G samples of a group sharing the timestep t and the noise ε. The released code optimises the
gradient-equivalent surrogate (groups may span processes; z_g is summed over them)

$$z_g = \frac{\beta}{G}\sum_{i\in g} A_i\,\mathrm{sg}[\ell_\theta(x^i)-\ell_{ref}(x^i)],\qquad
\mathcal L_{sur} = \operatorname{mean}_i\ \mathrm{sg}[\sigma(z_{g(i)})]\,A_i\,\ell_\theta(x^i),$$

whose gradient is (1/N)·Σ_g σ(z_g) Σ_{i∈g} A_i ∇ℓ_θ(x^i). With βλ_t = β/G this is 1/β times the gradient of the boxed
loss averaged over the groups of the batch (the factor is folded into the learning rate, as in the released code;
tests/unit/objectives/test_dgpo.py checks β·∇L_sur = ∇ mean_g L_g exactly, against the boxed loss written out in the
tests).

Post-review options of the released code: the PPO-style clip of the denoising loss against θ⁻ (ρ_i =
exp(ℓ_old − ℓ_θ); where A_i > 0 and ρ_i > 1 + ε_c, or A_i ≤ 0 and ρ_i < 1 − ε_c, ℓ_θ(x^i) is detached), and a KL
regulariser β_KL · mean‖v_θ − v_base‖² to the frozen base. The training forward is unguided (conditional only); the
reference forward may be guided (`reference_guidance_scale`, the CFG-free mode's `kl_cfg`).

The two references are separate in the released code (`scripts/train_sd3_dgpo.py`): the KL term is always taken
against the adapter-disabled base (``with transformer.module.disable_adapter()``), while with ``use_ema_ref`` (the
EMA-reference configuration, `config/dgpo_wocfg_emaref.py`, β = 2000) the DPO term's ℓ_ref comes from an EMA of the
policy. Here the DPO term uses the `reference` strategy passed in and the KL term uses ``kl_reference``: "base" (the
released behaviour: `policy.reference()`, whatever the strategy) or "reference" (the same strategy as the DPO term).
With the frozen-base strategy the two coincide and one reference forward serves both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from diffalign.config.schemas import config_schema
from diffalign.methods import NOISE, TIMESTEPS, OnlineEpoch, epoch_generator, method_config, split_updates, stream_seed
from diffalign.objectives.common import per_sample_mse
from diffalign.reference.frozen_base import FrozenBaseReference
from diffalign.reference.old_policy import EmaRolloutPolicy
from diffalign.samplers.base import build_sampler
from diffalign.types import GroupBatch, PromptEmbeds

KL_REFERENCES = ("base", "reference")


def group_noise(shape: tuple[int, ...], group_ids: torch.Tensor, *, seed: int, epoch: int, timestep_index: int
                ) -> torch.Tensor:
    """DGPO's training noise: one ε per (group, training timestep), identical for every member of the group and on
    every process that holds members of it. Returns `(N, *shape)` float32 on CPU."""
    cache: dict[int, torch.Tensor] = {}
    rows = []
    for g in group_ids.tolist():
        if g not in cache:
            cache[g] = torch.randn(shape, generator=torch.Generator().manual_seed(
                stream_seed(seed, epoch, g, timestep_index, NOISE)))
        rows.append(cache[g])
    return torch.stack(rows)


def group_sums(values: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Σ of `values` over each sample's group, returned per sample `(N,)`.

    When `torch.distributed` is initialised with several processes, the sums run over the members of a group on every
    process: each process contributes ``(group id, partial sum)`` pairs (`all_gather_object`, so processes may hold
    different groups, or different members of the same groups, in any order), and each sample gets its group's total.
    The values are detached statistics (z_g), so no gradient crosses processes.
    """
    values_d = values.detach()
    uniq, inverse = torch.unique(group_ids.to(values.device), return_inverse=True)
    sums = torch.zeros(len(uniq), device=values.device, dtype=values.dtype).index_add_(0, inverse, values_d)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        mine = (uniq.cpu().tolist(), sums.cpu().tolist())
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        totals: dict[int, float] = {}
        for ids, partial in gathered:
            for g, v in zip(ids, partial):
                totals[g] = totals.get(g, 0.0) + v
        sums = torch.tensor([totals[g] for g in uniq.cpu().tolist()], device=values.device, dtype=values.dtype)
    return sums[inverse]


def select_train_timesteps(schedule: torch.Tensor, num: int, max_index: int, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
    """DGPO's timestep clip (paper §4.3; code `trunc_steps`): `num` distinct timesteps drawn from the first
    ``max_index + 1`` entries (the high-noise part) of the rollout schedule `schedule` `(K,)`, shared by every sample.

    Raises:
        ValueError: if `num` exceeds the available ``max_index + 1`` timesteps or `max_index` is outside the schedule.
    """
    if not 0 <= max_index < len(schedule):
        raise ValueError(f"method.timestep_max_index={max_index} must index the {len(schedule)}-step rollout schedule.")
    if not 1 <= num <= max_index + 1:
        raise ValueError(f"method.timesteps_per_epoch={num} must be in [1, timestep_max_index + 1 = {max_index + 1}].")
    perm = torch.randperm(max_index + 1, generator=generator)[:num]
    return schedule[perm.sort().values]


@config_schema("method", "dgpo")
@dataclass
class DGPOConfig:
    """Config of `DGPO` (``method=dgpo`` extends it); the one place its defaults are written (the method is built from
    it: `diffalign.methods.method_config`). [PAPER] = arXiv:2510.08425, [CODE] = the released code."""

    _target_: str = "diffalign.objectives.dgpo.DGPO"
    beta: float = 100.0                     # paper default; 10 PickScore; 2000 with an EMA reference [CODE config/dgpo.py]
    beta_kl: float = 0.0                    # velocity L2 to the KL reference; method=dgpo: 0.02 (GenEval/OCR) [CODE]
    clip_range: float | None = None         # PPO-style clip of the DSM loss vs theta^-; method=dgpo: 0.01 [CODE]
    reference_guidance_scale: float = 1.0   # mode 1; the CFG-free mode 2 uses 4.5 with sampler.guidance_scale=1
    timesteps_per_epoch: int = 4            # M timesteps per epoch, shared by all samples [CODE num_train_timesteps]
    timestep_max_index: int = 4             # timestep clip: rollout-schedule indices 0..4 of 10 (GenEval) [CODE]
    old_policy_switch_step: int = 200       # theta^- = theta for the first 200 updates (500 GenEval) [PAPER+CODE]
    old_policy_decay: float = 0.3
    old_policy_ramp: float = 0.001
    kl_reference: str = "base"              # KL to the adapter-disabled base even with reference=ema [CODE] | reference


class DGPO:
    """The DGPO objective (data flow "online_groups").

    Built from `DGPOConfig`, the one place its defaults are written: ``DGPO(config)`` or ``DGPO(**fields)`` (the fields
    not given keep their `DGPOConfig` defaults; `diffalign.methods.method_config`).

    Fields:
        beta (`float`): DPO strength β (100 GenEval/OCR, 10 PickScore, 2000 with an EMA reference).
        beta_kl (`float`): β_KL of the velocity/ε L2 to the KL reference (code: 0.02 GenEval).
        clip_range (`float`, *optional*): ε_c of the PPO-style clip against θ⁻ (code: 1e-2 GenEval); `None` disables.
        reference_guidance_scale (`float`): CFG scale of the reference forwards, DPO and KL (mode 2:
            4.5).
        kl_reference (`str`): the model of the KL term's v_ref: "base" (the adapter-disabled
            base, as the released code also with an EMA DPO reference) or "reference" (the DPO term's reference
            strategy).
        timesteps_per_epoch (`int`): M, the timesteps trained per epoch (the released code's
            ``num_train_timesteps``, renamed here: in diffusers that is the 1000-step training schedule).
        timestep_max_index (`int`): train on rollout-schedule indices 0..this (GenEval: 4 of 10).
        old_policy_switch_step (`int`): updates during which θ⁻ = θ (`EmaRolloutPolicy`).
        old_policy_decay (`float`): θ⁻'s EMA decay cap, in [0, 1).
        old_policy_ramp (`float`): θ⁻'s decay d = min(decay, ramp · step).

    Raises:
        ValueError: for β ≤ 0, β_KL < 0, a non-positive clip range, guidance < 1 or an unknown `kl_reference`
            (naming the `method.` field).
    """

    data_flow = "online_groups"
    rollout_sampler_kind = "ode"
    log_prob_reduction = "mean"  # (the ODE rollouts store none)
    advantage = "group"
    rollout_policy: EmaRolloutPolicy | None = None  # θ⁻, made by `setup`

    def __init__(self, config: DGPOConfig | None = None, **fields):
        config = method_config(DGPOConfig, config, fields)
        if config.beta <= 0:
            raise ValueError(f"method.beta={config.beta} must be > 0 (DGPO: 100).")
        if config.beta_kl < 0:
            raise ValueError(f"method.beta_kl={config.beta_kl} must be >= 0.")
        if config.clip_range is not None and config.clip_range <= 0:
            raise ValueError(f"method.clip_range={config.clip_range} must be > 0, or null to disable the clip.")
        if config.reference_guidance_scale < 1:
            raise ValueError(f"method.reference_guidance_scale={config.reference_guidance_scale} must be >= 1.")
        if config.kl_reference not in KL_REFERENCES:
            raise ValueError(f"method.kl_reference={config.kl_reference!r} must be one of {KL_REFERENCES}: 'base' (the "
                             "adapter-disabled base, released code) or 'reference' (the reference strategy).")
        self.beta, self.beta_kl, self.clip_range = config.beta, config.beta_kl, config.clip_range
        self.reference_guidance_scale = config.reference_guidance_scale
        self.timesteps_per_epoch, self.timestep_max_index = config.timesteps_per_epoch, config.timestep_max_index
        self.old_policy_switch_step, self.old_policy_decay = config.old_policy_switch_step, config.old_policy_decay
        self.old_policy_ramp = config.old_policy_ramp
        self.kl_reference = config.kl_reference
        self._base = FrozenBaseReference()  # holds no tensors: `use(policy)` disables the adapters

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """DGPO's checks of a run config (before any model loads): a deterministic rollout sampler, the timestep clip
        inside the rollout schedule, micro-batches of whole groups (or, with ``online.split=members``, of whole shares
        of a group on each of the `num_processes` processes; unchecked when None, before the launch), and no best-of-n
        selection.

        Raises:
            ValueError: naming the field and the fix.
        """
        on, sp, m = cfg.online, cfg.sampler, cfg.method
        if on.get("best_of_n") is not None:
            raise ValueError("online.best_of_n selects samples for the policy-gradient methods (DanceGRPO/ViPO); DGPO "
                             "trains on whole groups: set online.best_of_n=null")
        sampler = build_sampler(sp)
        if sampler.stochastic:
            raise ValueError(f"method=dgpo samples its groups with a deterministic ODE solver (arXiv:2510.08425 §4; "
                             f"docs/methods/algorithms.md#dgpo), but sampler={sampler.describe()} is stochastic. Use "
                             "sampler=dpm_ode (or sampler=euler_ode for flow models), or sampler=ddim sampler.eta=0 "
                             "for deterministic DDIM")
        if m.timestep_max_index >= sp.num_inference_steps:
            raise ValueError(f"method.timestep_max_index={m.timestep_max_index} must index the "
                             f"{sp.num_inference_steps}-step rollout schedule; lower it below "
                             f"sampler.num_inference_steps")
        if not 1 <= m.timesteps_per_epoch <= m.timestep_max_index + 1:
            raise ValueError(f"method.timesteps_per_epoch={m.timesteps_per_epoch} must be in [1, "
                             f"method.timestep_max_index + 1 = {m.timestep_max_index + 1}]")
        batch_size, split = cfg.trainer.batch_size, on.get("split", "groups")
        if split == "groups" and batch_size % on.group_size:
            raise ValueError(f"trainer.batch_size={batch_size} must be a multiple of online.group_size="
                             f"{on.group_size} for DGPO (a micro-batch holds whole groups)")
        if split == "members" and num_processes is not None and batch_size % (on.group_size // num_processes):
            raise ValueError(f"online.split=members: trainer.batch_size={batch_size} must be a multiple of each "
                             f"process's share of a group ({on.group_size // num_processes}) so a micro-batch holds "
                             "whole shares")

    def setup(self, policy) -> None:
        """Adds θ⁻ (`EmaRolloutPolicy`, an ``"old"`` adapter holding a copy of the policy's) to the policy."""
        self.rollout_policy = EmaRolloutPolicy(self.old_policy_switch_step, self.old_policy_decay,
                                               self.old_policy_ramp)
        self.rollout_policy.setup(policy)

    def checkpoint_states(self) -> dict[str, EmaRolloutPolicy]:
        """θ⁻ is saved with every checkpoint as ``old_policy_state``."""
        return {"old_policy_state": self.rollout_policy}

    def epoch_updates(self, updates_per_epoch: int, num_inner_epochs: int) -> int:
        """One pass over the epoch: ``online.updates_per_epoch`` updates (``num_inner_epochs`` does not apply)."""
        return updates_per_epoch

    def prepare(self, policy, epoch: OnlineEpoch) -> dict[str, float]:
        return {}

    def plan(self, policy, epoch: OnlineEpoch) -> Iterator[list[_GroupUnit]]:
        """The epoch's updates: `timesteps_per_epoch` timesteps drawn from the clipped rollout schedule (one draw per
        epoch, `select_train_timesteps`), each over micro-batches of ``epoch.batch_size`` rows (whole groups), all
        (timestep, micro-batch) units cut into ``epoch.updates`` contiguous updates (`split_updates`)."""
        traj = epoch.trajectory
        x0 = traj.latents[:, -1]
        embeds = traj.prompt_embeds
        if self.reference_guidance_scale > 1 and embeds.negative_prompt_embeds is None:
            embeds = policy.encode_prompts(traj.prompts, do_classifier_free_guidance=True)  # CFG-free mode 2
        chosen = select_train_timesteps(traj.timesteps, self.timesteps_per_epoch, self.timestep_max_index,
                                        generator=epoch_generator(epoch.seed, epoch.epoch, TIMESTEPS))
        units = [_GroupUnit(epoch, x0, embeds, chosen, ti, start)
                 for ti in range(len(chosen)) for start in range(0, len(x0), epoch.batch_size)]
        yield from split_updates(units, epoch.updates)

    def loss(self, policy, unit: _GroupUnit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch at one training timestep, with the group noise of `group_noise`."""
        epoch, x0 = unit.epoch, unit.x0
        rows = slice(unit.start, unit.start + epoch.batch_size)
        gids = epoch.group_ids[rows]
        noise = group_noise(x0.shape[1:], gids, seed=epoch.seed, epoch=epoch.epoch, timestep_index=unit.timestep_index)
        batch = GroupBatch(x0[rows], epoch.trajectory.prompts[rows], unit.embeds.index(torch.arange(len(x0))[rows]),
                           epoch.advantages[rows].to(x0.device), gids, epoch.group_size)
        return self(policy, batch, timesteps=unit.timesteps[unit.timestep_index].to(x0.device),
                    noise=noise.to(x0.device), reference=reference, old_policy=self.rollout_policy)

    def __call__(self, policy, batch: GroupBatch, *, timesteps: torch.Tensor, noise: torch.Tensor, reference,
                 old_policy=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The surrogate loss at one training timestep.

        Args:
            policy (`DiffusionPolicy`): the policy θ (LoRA adapter active).
            batch (`GroupBatch`): `N` samples; `latents` `(N, C, h, w)`.
            timesteps (`torch.Tensor`): scalar or `(N,)` training timestep(s) (the same for a group).
            noise (`torch.Tensor`): `(N, C, h, w)` ε, identical rows within a group (`group_noise`).
            reference (`ReferenceStrategy`): the DPO term's reference strategy, a `use(policy)` context (frozen base by default); also the
                KL term's with ``kl_reference="reference"``.
            old_policy (`EmaRolloutPolicy`, *optional*): θ⁻ for the clip; required when `clip_range` is set.

        Returns:
            (scalar loss, detached metrics: ``loss, dgpo_z, dgpo_weight, loss_diff, clipfrac, kl``; ``kl`` is
            mean‖v_θ − v_ref‖² against the KL reference, 0 when β_KL = 0 and that reference would cost an extra
            forward).

        Raises:
            ValueError: when the clip is on and no `old_policy` is given.
        """
        if self.clip_range is not None and old_policy is None:
            raise ValueError("method.clip_range is set but the loop passed no rollout policy θ⁻.")
        x0 = batch.latents
        t = torch.as_tensor(timesteps, device=x0.device)
        t = t.expand(x0.shape[0]) if t.ndim == 0 else t
        x_t = policy.add_noise(x0, noise, t)
        target = policy.training_target(x0, noise, t)
        cond = batch.prompt_embeds
        pred = policy.predict(x_t, t, cond, guidance_scale=1.0)
        loss_theta = per_sample_mse(pred, target)
        with torch.no_grad(), reference.use(policy):
            ref_pred = policy.predict(x_t, t, cond, guidance_scale=self.reference_guidance_scale)
        loss_ref = per_sample_mse(ref_pred, target)
        advantages = batch.advantages.to(loss_theta.device).float()
        z = self.beta / batch.group_size * group_sums(advantages * (loss_theta.detach() - loss_ref), batch.group_ids)
        weight = torch.sigmoid(z)
        used = loss_theta
        clipfrac = torch.zeros(())
        if self.clip_range is not None:
            with torch.no_grad(), old_policy.use(policy):
                loss_old = per_sample_mse(policy.predict(x_t, t, cond, guidance_scale=1.0), target)
            ratio = torch.exp(loss_old - loss_theta.detach())
            clipped = ((advantages > 0) & (ratio > 1 + self.clip_range)) | (
                (advantages <= 0) & (ratio < 1 - self.clip_range))
            used = torch.where(clipped, loss_theta.detach(), loss_theta)
            clipfrac = clipped.float().mean()
        loss = (weight * advantages * used).mean()
        if self.kl_reference == "reference" or isinstance(reference, FrozenBaseReference):
            kl = F.mse_loss(pred, ref_pred)
        elif self.beta_kl > 0:
            with torch.no_grad(), self._base.use(policy):
                base_pred = policy.predict(x_t, t, cond, guidance_scale=self.reference_guidance_scale)
            kl = F.mse_loss(pred, base_pred)
        else:
            kl = torch.zeros((), device=loss.device)
        if self.beta_kl > 0:
            loss = loss + self.beta_kl * kl
        metrics = {"loss": loss.detach(), "dgpo_z": z.mean(), "dgpo_weight": weight.mean(),
                   "loss_diff": (loss_theta.detach() - loss_ref).mean(), "clipfrac": clipfrac, "kl": kl.detach()}
        return loss, metrics


class _GroupUnit(NamedTuple):
    """One DGPO micro-batch: rows ``start .. start + batch_size - 1`` of the epoch at its `timestep_index`-th
    training timestep."""

    epoch: OnlineEpoch
    x0: torch.Tensor  # (N, C, h, w) the rollouts' final latents
    embeds: PromptEmbeds  # (N, ...) their prompts (with the unconditional rows in the CFG-free mode)
    timesteps: torch.Tensor  # (M,) the epoch's training timesteps
    timestep_index: int
    start: int

