r"""The clipped policy-gradient surrogate over stored denoising transitions, shared by DDPO and Flow-GRPO.

Per stored transition k of rollout i (docs/methods/algorithms.md#ddpo, docs/methods/algorithms.md#flow-grpo):

$$\rho_{ik}=\exp(\log\pi_\theta(x_{k+1}\mid x_k,c)-\log\pi_{old}),\qquad
\mathcal L=\operatorname{mean}_{i}\max\big(-A_i\rho_{ik},\,-A_i\operatorname{clip}(\rho_{ik},1-\epsilon_c,1+\epsilon_c)\big)
+\beta_{KL}\,\operatorname{mean}_i D_{KL}\big(\pi_\theta(\cdot\mid x_k)\,\|\,\pi_{ref}(\cdot\mid x_k)\big)$$

(PPO, Schulman et al., arXiv:1707.06347, eq. 7, as DDPO eq. 5 and Flow-GRPO eq. 8 use it), with the Gaussian step
policies of docs/methods/algorithms.md#step-log-probabilities whose std does not depend on θ. The KL between two
Gaussians of the same std s is ‖μ_θ − μ_ref‖² / (2 s²); the released Flow-GRPO code divides the *mean* squared
difference by 2σ_t² where σ_t is the SDE's noise scale without the √|Δ| factor (`kl_form="code"`, the default, Δ
absorbed in β); `kl_form="exact"` uses the step std s.

Which stored transitions an inner epoch trains is set by ``timestep_selection``: the first ⌊K · timestep_fraction⌋
in order, as the released Flow-GRPO loop, or a random subset of that size shared by every rollout (both
`train_transitions`), or one random subset per rollout, as ddpo-pytorch and DanceGRPO/ViPO (`per_sample_transitions`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import NamedTuple

import torch

from diffalign.methods import (
    SHUFFLE,
    TIMESTEPS,
    CurrentPolicy,
    OnlineEpoch,
    epoch_generator,
    split_updates,
    stream_seed,
)
from diffalign.runtime.console import literal, warn_repeated
from diffalign.samplers.base import build_sampler
from diffalign.samplers.rollout import recompute_step
from diffalign.types import Trajectory

logger = logging.getLogger(__name__)

TIMESTEP_SELECTIONS = ("first", "random", "per_sample")
SQRT_DT_STD = ("flow_sde", "dance_sde", "window_sde")
"""Flow SDEs whose step std is c_k·sqrt(σ_k − σ_{k+1}) (``kl_form="code"`` divides by that square root)."""


def kl_to_reference(policy, trajectory: Trajectory, k: int, step, reference, kl_form: str = "code") -> torch.Tensor:
    """The KL term of the module docstring for transition `k`: mean_i of mean_elements (μθ − μref)² / (2 s_i²), the
    released Flow-GRPO form (``flow_grpo/scripts/train_sd3.py``), with s_i the step std (``kl_form="exact"``) or, on the
    flow SDEs, the step std over √(σ_k − σ_{k+1}) (``"code"``). Shared by Flow-GRPO/DDPO/GRPO-Guard and ViPO's option.

    Args:
        step (`DDIMStepOutput` or `FlowStepOutput`): θ's recomputed step of transition `k`: ``mean`` `(B, C, *grid)`
            and ``std`` (a scalar or `(B, 1)`: one per row).
        reference (`ReferenceStrategy`): whose ``use(policy)`` context gives μref (the frozen base, by default).

    Returns:
        A scalar tensor (≥ 0, in nats per latent element).

    Raises:
        ValueError: when `reference` is None.
    """
    if reference is None:
        raise ValueError("method.beta_kl > 0 needs a reference; the loop passed none.")
    with torch.no_grad(), reference.use(policy):
        ref = recompute_step(policy, trajectory, k)
    std = torch.as_tensor(step.std, device=step.mean.device).float()
    if kl_form == "code" and trajectory.sampler in SQRT_DT_STD:
        sig = trajectory.sigmas.to(step.mean.device)
        std = std / torch.sqrt(sig[k] - sig[k + 1])
    diff = (step.mean - ref.mean).float().pow(2).reshape(len(step.mean), -1).mean(dim=1)
    return (diff / (2 * std.reshape(-1) ** 2)).mean()


def check_stochastic_sampler(cfg) -> None:
    """A policy-gradient method trains on stored step log-probs, so it needs stochastic rollouts that keep them.

    Raises:
        ValueError: unless the sampler stores log-probs (`Sampler.log_probs`) and its noise is > 0 (``sampler.eta``
            for ``ddim``, ``sampler.noise_level`` for the flow SDEs).
    """
    sampler = build_sampler(cfg.sampler)
    if not sampler.stochastic:
        raise ValueError(f"method={cfg.method._target_.rsplit('.', 1)[-1]} is a policy-gradient method: it needs a "
                         f"stochastic sampler with log-probs, but sampler={sampler.describe()}. Use "
                         "sampler=flow_sde, cps_sde or window_sde (flow models, sampler.noise_level > 0) or "
                         "sampler=ddim (eps-models, sampler.eta > 0)")


def trajectory_minibatches(group_ids: torch.Tensor, batch_size: int, *, seed: int, epoch: int, inner: int
                           ) -> tuple[list[torch.Tensor], bool]:
    """Row indices of a process's policy-gradient minibatches for one inner epoch.

    Stratified by group when `batch_size` is a whole number k of members from each of the process's groups (and k
    divides the group size): each group's members are shuffled by a stream keyed by (seed, epoch, global group id,
    inner epoch), and minibatch m takes members m·k … m·k + k − 1 of every group. A minibatch of one process is then
    exactly its groups' share of the global minibatch m of a run on fewer processes with the same global batch, so N
    processes with ``online.split=groups`` reproduce one process up to float rounding (with ``split=members`` a
    process shuffles only its share of each group, which does not). Otherwise the process's rows are shuffled as a
    whole (by a stream keyed by (seed, epoch, inner)) and cut into chunks of `batch_size` — a local shuffle, which
    does not reproduce across process counts.

    Args:
        group_ids (`torch.Tensor`): `(N,)` global group id of each local row.
        batch_size (`int`): rows per minibatch on this process (``trainer.batch_size``).

    Returns:
        (`list[torch.Tensor]` of int64 row indices covering every row once, True when stratified).
    """
    ids = group_ids.tolist()
    groups = list(dict.fromkeys(ids))
    members = {g: [i for i, x in enumerate(ids) if x == g] for g in groups}
    sizes = {len(m) for m in members.values()}
    k = batch_size // len(groups) if batch_size % len(groups) == 0 else 0
    if len(sizes) == 1 and k and next(iter(sizes)) % k == 0:
        size = next(iter(sizes))
        order = {g: [members[g][j] for j in torch.randperm(size, generator=torch.Generator().manual_seed(
            stream_seed(seed, epoch, g, inner, SHUFFLE))).tolist()] for g in groups}
        return [torch.tensor([i for g in groups for i in order[g][m * k:(m + 1) * k]])
                for m in range(size // k)], True
    perm = torch.randperm(len(ids), generator=epoch_generator(seed, epoch, SHUFFLE, inner))
    return [perm[s:s + batch_size] for s in range(0, len(perm), batch_size)], False


class TransitionUnit(NamedTuple):
    """One policy-gradient micro-batch: transition `k` of the epoch's rows `rows` (int64 indices).

    `weight` scales the unit's loss (the loop divides each unit's loss by the number of units in its update): 1 for
    "first"/"random", where every unit of an update has the same rows; for "per_sample", whose units hold different
    numbers of rows, ``len(update) · len(rows) / Σ len(rows)`` over the update, so the update's loss is the mean over
    all its (row, transition) pairs, as the released loops' accumulation over equal-sized micro-batches."""

    epoch: OnlineEpoch
    rows: torch.Tensor
    k: int
    weight: float = 1.0

    def weighted(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times `weight` (unchanged, no new graph node, when the weight is 1)."""
        return loss if self.weight == 1 else loss * self.weight


def transition_plan(epoch: OnlineEpoch, timestep_fraction: float, timestep_selection: str
                    ) -> Iterator[list[TransitionUnit]]:
    """The updates of a policy-gradient epoch: ``epoch.inner_epochs`` passes, each over the minibatches of
    `trajectory_minibatches` × the trained transitions (both drawn per pass from the epoch's streams), those units cut
    into ``epoch.updates`` contiguous updates (`split_updates`).

    With "first"/"random" a minibatch gives one unit per transition of `train_transitions` (every row at that
    transition). With "per_sample" each row trains its own transitions (`per_sample_transitions`, drawn over the
    process's rows in order from the pass's stream); a minibatch then gives one unit per transition index k, holding
    the rows that train k (at most K units, none empty), weighted so that an update's loss is the mean over its
    (row, transition) pairs (`TransitionUnit.weight`).

    The transitions are drawn among the trajectory's trainable ones (`Trajectory.trainable`; all of them for DDIM-η
    with a final step of std > 0 and the flow SDEs, only the window for ``sampler=window_sde``, MixGRPO): with K'
    trainable steps, ⌊K' · timestep_fraction⌋ of them.

    Raises:
        ValueError: for an unknown `timestep_selection`, a fraction outside (0, 1], or a trajectory without a
            trainable step.
    """
    traj = epoch.trajectory
    candidates = [int(k) for k in torch.nonzero(traj.trainable.cpu()).flatten()]
    if not candidates:
        raise ValueError(f"the epoch's rollouts (sampler={traj.sampler}) have no step with a log-prob to train")
    num_steps = len(candidates)
    full = num_steps == len(traj.timesteps)  # (index k is transition k)
    if timestep_selection == "per_sample" and epoch.num_processes > 1:
        epoch.note("[diffalign] note: method.timestep_selection=per_sample draws each process's rows' transitions on "
                   "their own (by local row index), so a run on another number of processes will differ")
    for inner in range(epoch.inner_epochs):
        generator = epoch_generator(epoch.seed, epoch.epoch, TIMESTEPS, inner)
        if timestep_selection == "per_sample":
            chosen = per_sample_transitions(len(epoch.group_ids), num_steps, timestep_fraction, generator=generator)
            if not full:
                chosen = torch.tensor(candidates)[chosen]
        else:  # the trained transitions are the same on every process (their own stream)
            steps = train_transitions(num_steps, timestep_fraction, timestep_selection, generator=generator)
            steps = steps if full else [candidates[j] for j in steps]
        minibatches, stratified = trajectory_minibatches(epoch.group_ids, epoch.batch_size, seed=epoch.seed,
                                                         epoch=epoch.epoch, inner=inner)
        if epoch.split == "members" and epoch.num_processes > 1:
            epoch.note("[diffalign] note: online.split=members with a policy-gradient method shuffles each process's "
                       "share of a group on its own; a run on another number of processes will differ "
                       "(online.split=groups reproduces it)")
        if not stratified and epoch.num_processes > 1:
            epoch.note(f"[diffalign] note: trainer.batch_size={epoch.batch_size} is not a whole number of members from "
                       "each of a process's groups, so minibatches are shuffled per process (a run on another number "
                       "of processes will differ)")
        if timestep_selection != "per_sample":
            units = [TransitionUnit(epoch, idx, k) for idx in minibatches for k in steps]
            yield from split_updates(units, epoch.updates)
            continue
        units = []
        for idx in minibatches:
            trains = torch.zeros(len(idx), len(traj.timesteps), dtype=torch.bool)  # trains[r, k]: row idx[r] trains k
            trains[torch.arange(len(idx))[:, None], chosen[idx]] = True
            units += [TransitionUnit(epoch, idx[trains[:, k]], k) for k in range(len(traj.timesteps))
                      if trains[:, k].any()]
        for update in split_updates(units, epoch.updates):
            pairs = sum(len(u.rows) for u in update)
            yield [u._replace(weight=len(update) * len(u.rows) / pairs) for u in update]


def train_transitions(num_steps: int, timestep_fraction: float, selection: str,
                      generator: torch.Generator | None = None) -> list[int]:
    """The stored transitions trained in one inner epoch (the same for every rollout), in increasing order.

    Their number is n = max(1, ⌊K · timestep_fraction⌋), the released loops' ``int(num_steps * timestep_fraction)``
    (ddpo-pytorch and flow_grpo ``scripts/train*.py``; at least one here).

    - ``"first"``: transitions 0 … n − 1 of the time-ordered trajectory (flow_grpo ``scripts/train_sd3.py``: ``for j in
      range(num_train_timesteps)`` over ``sample["timesteps"][:, j]``, which it never permutes), so the last K − n
      transitions, the low-noise end, are never trained: with K = 10 and 0.99, transitions 0 … 8.
    - ``"random"``: the first n of a permutation of 0 … K − 1 drawn from `generator`, sorted; one draw for all rollouts
      (diffalign's alternative). ddpo-pytorch and DanceGRPO/ViPO draw one permutation *per sample* instead:
      ``"per_sample"``, which is not one list for all rollouts and so is `per_sample_transitions` (this function
      rejects it). With timestep_fraction 1 every transition is trained in all three.

    Args:
        num_steps (`int`): K, the stored transitions per rollout (≥ 1).
        timestep_fraction (`float`): in (0, 1].
        selection (`str`): "first" or "random".
        generator (`torch.Generator`, *optional*): the stream of the "random" draw.

    Returns:
        `list[int]` of n distinct indices in [0, K), increasing.

    Raises:
        ValueError: for an unknown `selection` (naming ``method.timestep_selection``) or a fraction outside (0, 1].
    """
    if selection not in TIMESTEP_SELECTIONS:
        raise ValueError(f"method.timestep_selection={selection!r} must be one of {TIMESTEP_SELECTIONS}.")
    if selection == "per_sample":
        raise ValueError(f"method.timestep_selection={selection!r}: train_transitions gives one list for all rollouts, "
                         "so it takes 'first' or 'random'; 'per_sample' is per_sample_transitions.")
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"method.timestep_fraction={timestep_fraction} must be in (0, 1].")
    n_train = max(1, math.floor(num_steps * timestep_fraction))
    if selection == "first":
        return list(range(n_train))
    return torch.randperm(num_steps, generator=generator)[:n_train].sort().values.tolist()


def per_sample_transitions(num_rows: int, num_steps: int, timestep_fraction: float,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """The stored transitions each rollout trains in one inner epoch, drawn per rollout (``"per_sample"``).

    The released recipe of ddpo-pytorch (``scripts/train.py``: ``perms = torch.stack([torch.randperm(num_timesteps)
    for _ in range(total_batch_size)])``, then ``for j in range(num_train_timesteps)`` trains transition
    ``perms[i, j]`` of sample i) and of DanceGRPO/ViPO (the same ``torch.randperm`` per sample and the first
    ``int(K · timestep_fraction)`` of it): row i's permutation is the i-th ``torch.randperm(K, generator=generator)``
    call, and it trains the first n = max(1, ⌊K · timestep_fraction⌋) entries. Here the rows are in the epoch's order
    (the released scripts shuffle the batch first; the minibatch shuffle here has its own stream), so the draw is
    the same as theirs per row, not the same rows.

    Args:
        num_rows (`int`): N, the rollouts (≥ 0).
        num_steps (`int`): K, the stored transitions per rollout (≥ 1).
        timestep_fraction (`float`): in (0, 1].
        generator (`torch.Generator`, *optional*): the stream of the draws.

    Returns:
        `torch.Tensor` `(N, n)` int64: row i's trained transition indices in [0, K), distinct, in draw order.

    Raises:
        ValueError: for a fraction outside (0, 1] or K < 1.
    """
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"method.timestep_fraction={timestep_fraction} must be in (0, 1].")
    if num_steps < 1:
        raise ValueError(f"the trajectory has {num_steps} stored transitions; per-sample selection needs at least 1.")
    n_train = max(1, math.floor(num_steps * timestep_fraction))
    if num_rows == 0:
        return torch.zeros(0, n_train, dtype=torch.long)
    return torch.stack([torch.randperm(num_steps, generator=generator) for _ in range(num_rows)])[:, :n_train]


LOGPROB_CHECKS = ("stop", "warn", "off")
LOGPROB_TOLERANCE = 1e-3
"""Default of ``method.logprob_tolerance``: the largest |recomputed − stored| step log-prob accepted before the first
update of an epoch. Measured in the tiny world on CPU in float32 (docs/guides/reliability.md#trainrollout-consistency):
0 when rollout and training batch the rows alike, at most 1.4e-6 when they do not; a stored guidance scale off by 0.5
gives 5e-2, off by 0.01 6.5e-4. The default sits about 700 times above the float noise, with room for GPU kernels."""

CAUSES = ("the guidance scale differs between the rollout and the training forward (sampler.guidance_scale is what "
          "both should use; a custom plugin may guide differently); the noise level differs (sampler.eta: DDIM's eta, "
          "sampler.noise_level: the flow SDE's, or the sampler option); dtype (trainer.mixed_precision autocasts the training forward but not "
          "the rollout, or the frozen weights are float16/bfloat16: model.torch_dtype); the prompt embeddings are not "
          "in the order of the latents (a data or model plugin); timestep indexing (the trajectory's timesteps/sigmas "
          "and the scheduler's disagree, e.g. a scheduler whose set_timesteps changed)")


class StoredTransitionMethod:
    """The contract members every method that trains on stored stochastic transitions shares (the clipped policy
    gradients here and ViPO): stochastic rollouts with log-probs, no set-up or extra checkpoint state,
    ``num_inner_epochs`` passes of ``updates_per_epoch`` updates per epoch, and the train/rollout consistency alarm.

    The alarm: before the first optimizer update of every epoch the policy is the one that made the epoch's rollouts,
    so the log-prob each unit recomputes for training must equal the stored one up to float noise (ratio 1). During
    that update `check_logprobs` compares them (max |Δ| over the unit's rows, agreed over processes); beyond
    ``logprob_tolerance`` the run stops (`diffalign.runtime.faults.RolloutMismatchError`, ``logprob_check="stop"``)
    naming the likely causes, or warns once per epoch (``"warn"``); ``"off"`` skips it. A subclass sets
    ``logprob_check``, ``logprob_tolerance`` (`init_logprob_check`) and wraps its updates with `checked_updates`.
    """

    logprob_check: str = "stop"
    logprob_tolerance: float = LOGPROB_TOLERANCE
    _checking: bool = False
    _epoch: int = 0
    _worst: float = 0.0

    def init_logprob_check(self, logprob_check: str, logprob_tolerance: float) -> None:
        """Stores the alarm's settings.

        Raises:
            ValueError: for an unknown ``method.logprob_check`` or a tolerance that is not > 0.
        """
        if logprob_check not in LOGPROB_CHECKS:
            raise ValueError(f"method.logprob_check={logprob_check!r} must be one of {LOGPROB_CHECKS}.")
        if not logprob_tolerance > 0:
            raise ValueError(f"method.logprob_tolerance={logprob_tolerance} must be > 0 (default "
                             f"{LOGPROB_TOLERANCE}).")
        self.logprob_check, self.logprob_tolerance = logprob_check, float(logprob_tolerance)

    def checked_updates(self, epoch: OnlineEpoch, updates: Iterator[list]) -> Iterator[list]:
        """Yields `updates`, comparing log-probs (`check_logprobs`) while the first one is trained; in "warn" mode
        warns once for the epoch when they differ beyond the tolerance (`diffalign.runtime.console.warn_repeated`, kind
        ``logprob_mismatch``: one summary line for the epoch in the online loop)."""
        self._checking, self._epoch, self._worst = self.logprob_check != "off", epoch.epoch, 0.0
        for n, update in enumerate(updates):
            yield update
            if n == 0 and self._checking:
                self._checking = False
                if self._worst > self.logprob_tolerance:  # ("warn"; "stop" raised already)
                    # (once per epoch; reported with the epoch's other repeating warnings, diffalign.runtime.console)
                    warn_repeated(logger, "logprob_mismatch", "{count} epoch(s) trained on anyway (method.logprob_"
                                  "check=warn): " + literal(self._mismatch_text(self._worst, f"epoch {epoch.epoch}")),
                                  count=1, shared=True)
        self._checking = False

    def _mismatch_text(self, worst: float, where: str = "the epoch") -> str:
        return (f"the log-probs recomputed for training differ from the rollout's stored ones before the first update "
                f"of {where}: max |Δ log π| = {worst:.3g} > method.logprob_tolerance="
                f"{self.logprob_tolerance:g} (the ratio π_θ / π_old should be 1 there, up to float noise). Likely "
                f"causes: {CAUSES}")

    def check_logprobs(self, new: torch.Tensor, old: torch.Tensor, k: int) -> None:
        """During the first update of an epoch: the largest |`new` − `old`| of one unit (agreed over processes),
        checked against the tolerance.

        Args:
            new (`torch.Tensor`): the recomputed log-probs of the unit's rows at transition `k`.
            old (`torch.Tensor`): the stored ones, same shape.

        Raises:
            RolloutMismatchError: in "stop" mode, beyond the tolerance.
        """
        if not self._checking:
            return
        import torch.distributed as dist

        worst = (new.detach().float() - old.float()).abs().max().reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        worst = float(worst)
        if math.isnan(worst):  # a non-finite log-prob: the non-finite guard skips the update (runtime.faults)
            return
        self._worst = max(self._worst, worst)
        if self._worst > self.logprob_tolerance and self.logprob_check == "stop":
            from diffalign.runtime.faults import RolloutMismatchError

            self._checking = False
            raise RolloutMismatchError(
                f"{self._mismatch_text(self._worst, f'epoch {self._epoch} (transition {k})')}. The run stopped before "
                "training on it; pass method.logprob_check=warn to train anyway, or raise method.logprob_tolerance "
                "if this is float noise of your hardware")

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """Raises ValueError unless the rollouts are stochastic with stored log-probs (`check_stochastic_sampler`)."""
        check_stochastic_sampler(cfg)

    def setup(self, policy) -> None:
        pass

    def checkpoint_states(self) -> dict:
        return {}

    def epoch_updates(self, updates_per_epoch: int, num_inner_epochs: int) -> int:
        """``online.num_inner_epochs`` passes of ``online.updates_per_epoch`` updates each."""
        return updates_per_epoch * num_inner_epochs


class ClippedPolicyGradient(StoredTransitionMethod):
    """PPO-clip over stored transitions (data flow "online_trajectories").

    Args:
        clip_range (`float`, defaults to 1e-4): ε_c (DDPO and Flow-GRPO: 1e-4, tuned for mean-reduced log-probs).
        beta_kl (`float`, defaults to 0.0): KL weight to the reference (Flow-GRPO: 0.04 GenEval; DDPO: 0).
        kl_form (`str`, defaults to "code"): "code" or "exact" (see the module docstring).
        detach_unconditional (`bool`): stop gradients through the unconditional CFG branch when recomputing.
        advantage (`str`): how the loop normalises rewards: "group" (GRPO) or "per_prompt" (DDPO's stat tracker).
        timestep_fraction (`float`, defaults to 1.0): fraction of each rollout's transitions trained per epoch.
        timestep_selection (`str`, defaults to "random"): which of them: "first" or "random" (`train_transitions`),
            or "per_sample" (`per_sample_transitions`: one random subset per rollout, the released DDPO recipe).
        logprob_check (`str`, defaults to "stop"): the train/rollout consistency alarm (`StoredTransitionMethod`):
            "stop", "warn" or "off".
        logprob_tolerance (`float`, defaults to `LOGPROB_TOLERANCE`): its tolerance on |Δ log π|.

    Raises:
        ValueError: for a non-positive clip range, negative β_KL, an unknown `kl_form`/`advantage`/
            `timestep_selection`/`logprob_check`, a fraction outside (0, 1] or a tolerance that is not > 0.
    """

    data_flow = "online_trajectories"
    rollout_sampler_kind = "sde"
    log_prob_reduction = "mean"
    advantage = "group"  # (per instance: the `advantage` argument)
    rollout_policy = CurrentPolicy()  # on-policy: θ samples the epoch

    def __init__(self, clip_range: float = 1e-4, beta_kl: float = 0.0, kl_form: str = "code",
                 detach_unconditional: bool = False, advantage: str = "group", timestep_fraction: float = 1.0,
                 timestep_selection: str = "random", logprob_check: str = "stop",
                 logprob_tolerance: float = LOGPROB_TOLERANCE):
        self.init_logprob_check(logprob_check, logprob_tolerance)
        if clip_range <= 0:
            raise ValueError(f"method.clip_range={clip_range} must be > 0 (1e-4 in DDPO/Flow-GRPO).")
        if beta_kl < 0:
            raise ValueError(f"method.beta_kl={beta_kl} must be >= 0.")
        if kl_form not in ("code", "exact"):
            raise ValueError(f"method.kl_form={kl_form!r} must be 'code' or 'exact'.")
        if advantage not in ("group", "per_prompt"):
            raise ValueError(f"method.advantage={advantage!r} must be 'group' or 'per_prompt'.")
        if not 0 < timestep_fraction <= 1:
            raise ValueError(f"method.timestep_fraction={timestep_fraction} must be in (0, 1].")
        if timestep_selection not in TIMESTEP_SELECTIONS:
            raise ValueError(f"method.timestep_selection={timestep_selection!r} must be one of {TIMESTEP_SELECTIONS}.")
        self.clip_range, self.beta_kl, self.kl_form = clip_range, beta_kl, kl_form
        self.detach_unconditional, self.advantage = detach_unconditional, advantage
        self.timestep_fraction, self.timestep_selection = timestep_fraction, timestep_selection

    def prepare(self, policy, epoch: OnlineEpoch) -> dict[str, float]:
        return {}

    def plan(self, policy, epoch: OnlineEpoch) -> Iterator[list[TransitionUnit]]:
        """The epoch's updates (`transition_plan`), the first one checked for train/rollout consistency."""
        return self.checked_updates(epoch, transition_plan(epoch, self.timestep_fraction, self.timestep_selection))

    def loss(self, policy, unit: TransitionUnit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one unit: `__call__` on rows ``unit.rows`` of the epoch at transition ``unit.k``, times
        ``unit.weight`` (the metrics unscaled)."""
        mb = unit.epoch.trajectory.index(unit.rows)
        loss, metrics = self(policy, mb, unit.epoch.advantages[unit.rows].to(mb.latents.device), unit.k,
                             reference=reference)
        return unit.weighted(loss), metrics

    def __call__(self, policy, trajectory: Trajectory, advantages: torch.Tensor, k: int, *, reference=None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of transition `k` of every rollout in `trajectory` (a minibatch).

        Args:
            policy (`DiffusionPolicy`): the policy θ.
            trajectory (`Trajectory`): `B` stochastic rollouts with stored `log_probs` `(B, K)` (θ_old's).
            advantages (`torch.Tensor`): `(B,)` advantages.
            k (`int`): the transition index.
            reference (`ReferenceStrategy`, *optional*): a reference strategy (`use(policy)` context), needed when
                `beta_kl > 0`.

        Returns:
            (scalar loss, detached metrics ``loss, ratio, clipfrac, approx_kl, kl``).
        """
        step = recompute_step(policy, trajectory, k, detach_unconditional=self.detach_unconditional)
        old = trajectory.log_probs[:, k].to(step.log_prob.device)
        self.check_logprobs(step.log_prob, old, k)
        return self.clipped_loss(policy, trajectory, advantages, k, step, step.log_prob - old, reference=reference)

    def clipped_loss(self, policy, trajectory: Trajectory, advantages: torch.Tensor, k: int, step,
                     log_ratio: torch.Tensor, *, weight: float | torch.Tensor = 1.0, reference=None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped surrogate of the module docstring on a given log-ratio, plus β_KL · KL.

        Args:
            step (`DDIMStepOutput` or `FlowStepOutput`): the recomputed step output of transition `k`
                (`recompute_step`: ``mean``, ``std``, ``log_prob``).
            log_ratio (`torch.Tensor`): `(B,)` log ρ (here log π_θ − log π_old; GRPO-Guard passes its normalised one).
            weight (`float` or `torch.Tensor`): multiplies the clipped term only (GRPO-Guard's gradient reweighting);
                1 for DDPO/Flow-GRPO.

        Returns:
            (scalar loss, detached metrics ``loss, ratio, clipfrac, approx_kl, kl``; ``approx_kl`` is over the raw
            log π_θ − log π_old).
        """
        old = trajectory.log_probs[:, k].to(step.log_prob.device)
        adv = advantages.to(step.log_prob.device).float()
        ratio = torch.exp(log_ratio)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - self.clip_range, 1 + self.clip_range)
        loss = torch.maximum(unclipped, clipped).mean()
        if not (isinstance(weight, (int, float)) and weight == 1):
            loss = loss * weight
        kl = torch.zeros((), device=loss.device)
        if self.beta_kl > 0:
            kl = kl_to_reference(policy, trajectory, k, step, reference, self.kl_form)
            loss = loss + self.beta_kl * kl
        metrics = {
            "loss": loss.detach(),
            "ratio": ratio.detach().mean(),
            "clipfrac": ((ratio.detach() - 1).abs() > self.clip_range).float().mean(),
            "approx_kl": (0.5 * (step.log_prob.detach() - old) ** 2).mean(),
            "kl": kl.detach(),
        }
        return loss, metrics
