"""Training loop for online group-based methods: rollouts → rewards → advantages → objective (DGPO, Flow-GRPO, DDPO,
ViPO).

``train(cfg)`` runs ``online.num_epochs`` epochs. Each epoch:

1. draws ``online.groups_per_epoch`` train prompts (one group each; global group indices
   ``epoch · groups_per_epoch + j`` split across processes, so no two processes or groups share noise);
2. samples ``online.group_size`` images per prompt with the rollout policy — θ⁻ (`diffalign.old_policy`) for DGPO,
   θ for the policy-gradient methods — using ``sampler`` (an ODE solver for DGPO, the stochastic DDIM-η / flow SDE
   with stored log-probs for Flow-GRPO and DDPO), with initial noise shared inside a group when
   ``online.shared_initial_noise`` (`diffalign.samplers.groups`);
3. scores them with the selected rewards (`WeightedSum`; a failing or non-finite reward stops the run after a
   checkpoint, naming the reward, batch and prompts);
4. computes advantages (`diffalign.advantages`: per group with group or global std, or DDPO's per-prompt tracker)
   from the whole epoch's rewards, gathered from every process;
5. updates the policy ``online.updates_per_epoch`` times:
   - "online_groups" objectives (DGPO): ``method.num_train_timesteps`` timesteps from the high-noise part of the
     rollout schedule, noise shared per group, micro-batches of whole groups;
   - "online_trajectories" objectives (Flow-GRPO, DDPO, ViPO): ``online.num_inner_epochs`` passes over shuffled
     minibatches (stratified by group, `trajectory_minibatches`), each over ``method.timestep_fraction`` of the stored
     transitions, the first ones or a random subset (``method.timestep_selection``,
     `diffalign.objectives.policy_gradient.train_transitions`).

Every random stream is seeded from ``(seed, epoch, …)``, so ``resume=latest`` continues from a checkpoint's epoch
exactly; checkpoints hold the LoRA, optimizer, LR scheduler, reference, θ⁻, the DDPO tracker and the non-finite
counters. A non-finite loss or gradient skips that update (``nonfinite_skips``; ``trainer.max_consecutive_nonfinite``
in a row stop the run with a checkpoint); SIGTERM / SIGINT stop it at the next epoch boundary with a checkpoint
(`diffalign.faults`). After training the
base and fine-tuned models are evaluated on ``eval.prompts`` as in the preference loop.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, gather_object, set_seed
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from diffalign.advantages import PerPromptStatTracker, best_of_n_rows, group_advantages
from diffalign.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    new_lineage,
    read_state,
    remove_temporaries,
    save_checkpoint,
    write_state,
)
from diffalign.evaluate import base_reuse_key, eval_config_from, evaluate_policy, select_prompts
from diffalign.faults import NonFiniteError, NonFiniteGuard, StopSignals, TrainingInterrupted
from diffalign.models.base import bare_forward
from diffalign.monitors import build_monitor
from diffalign.objectives.dgpo import select_train_timesteps
from diffalign.objectives.policy_gradient import train_transitions
from diffalign.old_policy import EmaRolloutPolicy
from diffalign.plugins import build_rewards, build_selected_rewards
from diffalign.rewards.base import RewardError
from diffalign.rewards.combine import reward_metrics
from diffalign.runlock import run_lock
from diffalign.samplers.groups import group_rollout, stream_seed
from diffalign.train.preference import _flat_hparams, build_lr_scheduler
from diffalign.types import GroupBatch
from diffalign.world.prompts import load_prompts

ONLINE_FLOWS = ("online_groups", "online_trajectories")
_PROMPTS, _TIMESTEPS, _NOISE, _SHUFFLE = 10, 11, 12, 13  # stream tags (diffalign.samplers.groups uses 0 and 1)


def epoch_generator(seed: int, epoch: int, tag: int, extra: int = 0) -> torch.Generator:
    """A CPU generator for one of an epoch's random streams (prompt draw, timestep choice, noise, shuffles)."""
    return torch.Generator().manual_seed(stream_seed(seed, epoch, extra, 0, tag))


def group_noise(shape: tuple[int, ...], group_ids: torch.Tensor, *, seed: int, epoch: int, timestep_index: int
                ) -> torch.Tensor:
    """DGPO's training noise: one ε per (group, training timestep), identical for every member of the group and on
    every process that holds members of it. Returns `(N, *shape)` float32 on CPU."""
    cache: dict[int, torch.Tensor] = {}
    rows = []
    for g in group_ids.tolist():
        if g not in cache:
            cache[g] = torch.randn(shape, generator=torch.Generator().manual_seed(
                stream_seed(seed, epoch, g, timestep_index, _NOISE)))
        rows.append(cache[g])
    return torch.stack(rows)


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
            stream_seed(seed, epoch, g, inner, _SHUFFLE))).tolist()] for g in groups}
        return [torch.tensor([i for g in groups for i in order[g][m * k:(m + 1) * k]])
                for m in range(size // k)], True
    perm = torch.randperm(len(ids), generator=epoch_generator(seed, epoch, _SHUFFLE, inner))
    return [perm[s:s + batch_size] for s in range(0, len(perm), batch_size)], False


def _split(units: list, parts: int) -> list[list]:
    """`units` in `parts` contiguous, nearly equal chunks (empty ones dropped)."""
    bounds = np.linspace(0, len(units), parts + 1).round().astype(int)
    return [units[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def train(cfg: DictConfig) -> dict:
    """Runs an online job described by `cfg` (``configs/train.yaml`` with an online ``method``); returns the final
    metrics (also written to ``<output_dir>/results.json``).

    Raises:
        ValueError: for a method whose data flow is not online, a sampler that does not fit the method (a
            policy-gradient method needs stored log-probs: ``sampler.name=sde`` with ``sampler.eta > 0``), a group
            size < 2, or a DGPO micro-batch that is not a whole number of groups.
        RewardError: when a reward fails (after a checkpoint is written).
        NonFiniteError: after ``trainer.max_consecutive_nonfinite`` skipped updates in a row (checkpoint saved).
        TrainingInterrupted: on SIGTERM / SIGINT, at the next epoch boundary, after a checkpoint is saved.
    """
    with run_lock(cfg.output_dir, "diffalign-train"), StopSignals() as stop:
        results = _train(cfg, stop)
        stop.raise_if_received("at the end", f"the run finished; its results are in {cfg.output_dir}")
        return results


def _train(cfg: DictConfig, stop: StopSignals) -> dict:
    t_start = time.time()
    output_dir = Path(cfg.output_dir)
    tr, on, sp = cfg.trainer, cfg.online, cfg.sampler
    log_with = None if tr.log_with in (None, "none") else tr.log_with
    accelerator = Accelerator(mixed_precision=tr.mixed_precision, log_with=log_with, cpu=tr.cpu,
                              step_scheduler_with_optimizer=False,  # one LR step per update on any number of processes
                              project_config=ProjectConfiguration(project_dir=str(output_dir),
                                                                  logging_dir=str(output_dir / "logs")))
    set_seed(cfg.seed)
    objective = instantiate(cfg.method)
    flow = getattr(objective, "data_flow", None)
    if flow not in ONLINE_FLOWS:
        raise ValueError(f"method={cfg.method._target_} consumes {flow!r} data; the online loop runs methods whose "
                         f"data_flow is one of {ONLINE_FLOWS}")
    sampler_name = sp.get("name", "sde")
    if flow == "online_trajectories" and (sampler_name != "sde" or sp.eta <= 0):
        raise ValueError(f"method={cfg.method._target_} is a policy-gradient method and needs stochastic rollouts with "
                         f"log-probs; got sampler.name={sampler_name!r}, sampler.eta={sp.eta}. Use sampler=ddim (SD) "
                         "or sampler=flow_sde (flow models) with eta > 0.")
    if on.group_size < 2:
        raise ValueError(f"online.group_size={on.group_size}: group-relative advantages need at least 2 samples per "
                         "prompt; set online.group_size >= 2 (DGPO/Flow-GRPO use 16-24).")
    if flow == "online_groups" and on.get("split", "groups") == "groups" and tr.batch_size % on.group_size:
        raise ValueError(f"trainer.batch_size={tr.batch_size} must be a multiple of online.group_size={on.group_size}"
                         " for DGPO (a micro-batch holds whole groups).")
    policy = instantiate(cfg.model)
    policy.to(accelerator.device)
    reference = instantiate(cfg.reference)
    reference.setup(policy)
    old_policy = None
    if flow == "online_groups":
        old_policy = EmaRolloutPolicy(objective.old_policy_switch_step, objective.old_policy_decay,
                                      objective.old_policy_ramp)
        old_policy.setup(policy)
    rewards = build_rewards(cfg.reward)
    eval_rewards = build_selected_rewards(cfg.get("eval_reward") or cfg.reward)
    monitor = build_monitor(cfg.get("monitor"), eval_rewards, samples_dir=output_dir / "logs" / "samples")
    rows = load_prompts(on.prompts, field="online.prompts")
    tracker = PerPromptStatTracker(on.tracker_buffer_size, on.tracker_min_count, clip=on.advantage_clip) \
        if getattr(objective, "advantage", "group") == "per_prompt" else None
    if getattr(objective, "advantage_per_reward", False):  # c_r of Σ_r c_r 𝓛_r: the rewards' weights
        objective.reward_coefficients = torch.tensor([rewards.weights[n] for n in rewards.weights])
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=tr.learning_rate, betas=(tr.adam_beta1, tr.adam_beta2),
                                  weight_decay=tr.adam_weight_decay, eps=tr.adam_epsilon)
    total_updates = on.num_epochs * on.updates_per_epoch * (on.num_inner_epochs if flow == "online_trajectories" else 1)
    lr_scheduler = build_lr_scheduler(optimizer, tr.lr_warmup_steps, total_updates, tr.lr_scheduler)
    wrapped, optimizer, lr_scheduler = accelerator.prepare(policy.denoiser, optimizer, lr_scheduler)
    if wrapped is not policy.denoiser:  # DDP/FSDP: forward through the wrapper, switch adapters on the bare module
        policy.set_forward_module(wrapped)
    num_proc, rank = accelerator.num_processes, accelerator.process_index
    split = on.get("split", "groups")
    if split not in ("groups", "members"):
        raise ValueError(f"online.split={split!r} must be 'groups' (whole groups per process) or 'members' (every "
                         "group spread over the processes)")
    if split == "groups" and on.groups_per_epoch % num_proc:
        raise ValueError(f"online.groups_per_epoch={on.groups_per_epoch} must be divisible by the {num_proc} "
                         "processes (or set online.split=members to spread every group over the processes).")
    if split == "members":
        if on.group_size % num_proc:
            raise ValueError(f"online.split=members: online.group_size={on.group_size} must be divisible by the "
                             f"{num_proc} processes")
        if flow == "online_groups" and tr.batch_size % (on.group_size // num_proc):
            raise ValueError(f"online.split=members: trainer.batch_size={tr.batch_size} must be a multiple of each "
                             f"process's share of a group ({on.group_size // num_proc}) so a micro-batch holds whole "
                             "shares")
        if on.get("best_of_n"):
            raise ValueError("online.best_of_n selects within whole groups; use online.split=groups with it")
        if flow == "online_trajectories" and num_proc > 1:
            accelerator.print("[diffalign] note: online.split=members with a policy-gradient method shuffles each "
                              "process's share of a group on its own; a run on another number of processes will "
                              "differ (online.split=groups reproduces it)")
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        accelerator.init_trackers("diffalign", config=_flat_hparams(cfg) if log_with == "tensorboard" else
                                  OmegaConf.to_container(cfg, resolve=True))
    flow_sde_label = "DanceGRPO SDE eta" if sp.get("sde_type", "flow_grpo") == "dance" else "flow SDE a"
    sampler_label = sampler_name if sampler_name != "sde" else (
        f"{flow_sde_label if policy.prediction_type == 'flow' else 'DDIM eta'}={sp.eta}")
    accelerator.print(
        f"[diffalign] online {type(objective).__name__}: {sum(p.numel() for p in params) / 1e6:.3f}M trainable "
        f"parameters; {on.num_epochs} epochs × {on.groups_per_epoch} prompts × {on.group_size} samples "
        f"({sampler_label}, {sp.num_inference_steps} steps, CFG {sp.guidance_scale}); {len(rows)} train prompts; "
        f"reward {rewards!r}{' (one advantage per reward)' if getattr(objective, 'advantage_per_reward', False) else ''}"
        f"{f'; best-of-{on.best_of_n}' if on.get('best_of_n') else ''}; output {output_dir}")

    # ---------------------------------------------------------------------------------------------------- resume
    epoch, global_step = 0, 0
    lineage = new_lineage()  # keep_last prunes only this lineage's checkpoints; a resumed run carries its lineage on
    resumed_history: list[dict] = []
    guard = NonFiniteGuard(tr.get("max_consecutive_nonfinite", 5))
    if accelerator.is_main_process:  # half-written checkpoints of a killed run (never picked by resume)
        remove_temporaries(output_dir)
    if cfg.resume is not None:
        ckpt = latest_checkpoint(output_dir) if cfg.resume == "latest" else Path(cfg.resume)
        if ckpt is None:
            accelerator.print(f"[diffalign] resume=latest: no checkpoint in {output_dir}, starting from scratch")
        else:
            state = load_checkpoint(ckpt, optimizer=optimizer, lr_scheduler=lr_scheduler)
            policy.load_lora_weights(ckpt)
            epoch, global_step = state["epoch"], state["global_step"]
            lineage = state.get("lineage") or lineage
            reference.load_state_dict(read_state(ckpt, "reference_state"))
            if old_policy is not None:
                old_policy.load_state_dict(read_state(ckpt, "old_policy_state"))
            if tracker is not None:
                tracker.load_state_dict(state["tracker"])
            guard.load_state_dict(state.get("nonfinite", guard.state_dict()))
            if (output_dir / "history.jsonl").is_file():  # keep the log of the epochs before the checkpoint
                resumed_history = [json.loads(line) for line in (output_dir / "history.jsonl").read_text().splitlines()
                                   if line.strip()]
                resumed_history = [h for h in resumed_history if h.get("epoch", 0) <= epoch]
            accelerator.print(f"[diffalign] resumed from {ckpt} at epoch {epoch} (step {global_step})")

    def write_dir(directory: Path) -> None:
        policy.save_lora_weights(directory)
        write_state(reference.state_dict(), directory, "reference_state")
        if old_policy is not None:
            write_state(old_policy.state_dict(), directory, "old_policy_state")

    def write_checkpoint(at_epoch: int) -> Path:
        return save_checkpoint(output_dir, global_step, lora_dir_writer=write_dir, optimizer=optimizer,
                               lr_scheduler=lr_scheduler, keep_last=tr.keep_last, lineage=lineage,
                               state={"epoch": at_epoch, "global_step": global_step,
                                      "tracker": tracker.state_dict() if tracker is not None else {},
                                      "nonfinite": guard.state_dict()})

    def stop_with_checkpoint(at_epoch: int) -> Path:
        """The checkpoint of the current step (written by the main process unless it exists), after a barrier."""
        ckpt = output_dir / f"checkpoint-{global_step}"
        if accelerator.is_main_process and not ckpt.exists():
            write_checkpoint(at_epoch)
        accelerator.wait_for_everyone()
        return ckpt

    def optimizer_step(loss_finite: bool) -> None:
        nonlocal global_step
        # a non-finite loss or gradient (on any process) skips the update; the step still counts (LR schedule, θ⁻)
        if guard.update_ok(accelerator, params, tr.max_grad_norm, loss_finite):
            optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        global_step += 1
        reference.on_step(policy, global_step)
        if old_policy is not None:
            old_policy.after_update()
        if guard.exhausted:
            ckpt = stop_with_checkpoint(epoch)
            raise NonFiniteError(
                f"{guard.consecutive} updates in a row had a non-finite loss or gradient (epoch {epoch}, step "
                f"{global_step}, trainer.max_consecutive_nonfinite={guard.max_consecutive}); checkpoint saved to "
                f"{ckpt} (mid-epoch: it restarts epoch {epoch}). Lower trainer.learning_rate, set "
                "trainer.max_grad_norm, or use trainer.mixed_precision=no", checkpoint=ckpt)

    # ---------------------------------------------------------------------------------------------------- train
    progress = tqdm(total=on.num_epochs, initial=epoch, desc="epochs", disable=not accelerator.is_main_process)
    history, t_train = list(resumed_history), time.time()
    # train_clock: seconds of rollouts + updates (no monitors), carried over a resume
    train_clock = float(history[-1].get("train_seconds", 0.0)) if history else 0.0

    def monitor_logs() -> dict:
        if monitor is None or not accelerator.is_main_process:
            return {}
        policy.denoiser.eval()
        with bare_forward(policy):
            out = monitor.maybe_log(global_step, policy, accelerator=accelerator, log=accelerator.print) or {}
        policy.denoiser.train()
        return out

    if epoch == 0 and monitor is not None and not history:
        first = monitor_logs()
        if first:
            history.append({"epoch": 0, "step": 0, "rollouts": 0, "train_seconds": 0.0, **first})
    # split of an epoch's rows across processes: whole groups ("groups"), or a share of every group ("members": each
    # process samples members r·G/P .. (r+1)·G/P − 1 of every group, so a group spans the processes)
    split = on.get("split", "groups")
    said_local_shuffle = False
    per_proc = on.groups_per_epoch // num_proc if split == "groups" else on.groups_per_epoch
    share = on.group_size // num_proc if split == "members" else on.group_size
    my_members = list(range(rank * share, (rank + 1) * share)) if split == "members" else None
    while epoch < on.num_epochs:
        if stop.requested(accelerator):  # SIGTERM / SIGINT: checkpoint at this epoch boundary, then exit
            ckpt = stop_with_checkpoint(epoch)
            accelerator.print(f"[diffalign] {stop.name} received: stopped before epoch {epoch}, checkpoint {ckpt}; "
                              "continue with resume=latest")
            raise TrainingInterrupted(f"stopped by {stop.name} before epoch {epoch} (step {global_step}); checkpoint "
                                      f"saved to {ckpt}; continue with resume=latest", stop.signum, checkpoint=ckpt)
        t_epoch = time.time()
        # 1. prompts of this epoch (the same draw on every process; each takes its own slice)
        pick = torch.randint(len(rows), (on.groups_per_epoch,), generator=epoch_generator(cfg.seed, epoch, _PROMPTS))
        mine = list(range(rank * per_proc, (rank + 1) * per_proc)) if split == "groups" else \
            list(range(on.groups_per_epoch))
        epoch_rows = [rows[int(pick[j])] for j in mine]
        group_indices = [epoch * on.groups_per_epoch + j for j in mine]
        # 2. rollouts with θ⁻ (DGPO) or θ
        policy.denoiser.eval()
        with torch.no_grad(), (old_policy.use(policy) if old_policy is not None else _null()):
            traj, group_ids = group_rollout(
                policy, [r["prompt"] for r in epoch_rows], on.group_size, group_indices=group_indices,
                seed=cfg.seed, epoch=epoch, shared_initial_noise=on.shared_initial_noise, sampler=sampler_name,
                num_inference_steps=sp.num_inference_steps, guidance_scale=sp.guidance_scale, eta=sp.eta,
                rollout_batch_size=on.rollout_batch_size,
                reduction=getattr(objective, "log_prob_reduction", "mean"),  # ViPO: "per_position"
                sde_type=sp.get("sde_type", "flow_grpo"), members=my_members)
        policy.denoiser.train()
        # 3. rewards
        metadata = [r for r in epoch_rows for _ in range(share)]
        try:
            scored = rewards(traj.images, traj.prompts, metadata)
        except RewardError as err:
            if accelerator.is_main_process:
                err.checkpoint = write_checkpoint(epoch)
            raise RewardError(err.reward_name, f"{err.detail} — checkpoint saved to {err.checkpoint}; fix the reward "
                              f"and resume with resume=latest", step=global_step, batch_index=epoch,
                              prompts=sorted(set(traj.prompts))) from err
        scores = scored.scores.detach().cpu()
        # 4. advantages, computed from the whole epoch's rewards on every process (gathered in rank order), so the
        # global std and the per-prompt tracker see what one process would; each process keeps its own rows
        all_scores, all_ids, all_prompts = scores, group_ids, list(traj.prompts)
        if num_proc > 1:
            all_scores = accelerator.gather(scores.to(accelerator.device)).cpu()
            all_ids = accelerator.gather(group_ids.to(accelerator.device)).cpu()
            all_prompts = gather_object(list(traj.prompts))
        mine_rows = slice(rank * len(scores), (rank + 1) * len(scores))
        if tracker is not None:
            advantages = tracker.update(all_prompts, all_scores)[mine_rows]
            adv_stats = {"zero_std_fraction": group_advantages(all_scores, all_ids)[1]["zero_std_fraction"]}
        elif getattr(objective, "advantage_per_reward", False):  # ViPO-Wan: one advantage per reward (VQ, MQ)
            names = list(rewards.weights)
            components = torch.stack([scored.info[f"scores/{n}"].detach().float().cpu() for n in names], 1)
            if num_proc > 1:
                components = accelerator.gather(components.to(accelerator.device)).cpu()
            columns = [group_advantages(components[:, j], all_ids, std=on.advantage_std, clip=on.advantage_clip,
                                        correction=on.advantage_std_correction, eps=on.advantage_eps)
                       for j in range(len(names))]
            advantages = torch.stack([c[0] for c in columns], 1)[mine_rows]  # (N, R)
            adv_stats = {"zero_std_fraction": columns[0][1]["zero_std_fraction"]}
        else:
            advantages, adv_stats = group_advantages(all_scores, all_ids, std=on.advantage_std,
                                                     clip=on.advantage_clip, correction=on.advantage_std_correction,
                                                     eps=on.advantage_eps)
            advantages = advantages[mine_rows]
        if on.get("best_of_n") and flow == "online_trajectories":  # keep the n/2 best and n/2 worst of each group
            keep = best_of_n_rows(scores, group_ids, on.best_of_n)
            if len(keep) < len(scores):
                traj, advantages, group_ids = traj.index(keep), advantages[keep], group_ids[keep]
            adv_stats["kept_fraction"] = len(keep) / len(scores)
        # 5. updates (an objective with `prepare_epoch`, e.g. ViPO's advantage maps, sees the whole epoch first and is
        # then called with `rows=` the minibatch's row indices)
        sums: dict[str, float] = {}
        n_units = 0
        prepare = getattr(objective, "prepare_epoch", None)
        epoch_stats = prepare(policy, traj, advantages) if prepare is not None else None

        def add(metrics, sums=sums):
            nonlocal n_units
            n_units += 1
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)

        if flow == "online_groups":
            x0 = traj.latents[:, -1]
            embeds = traj.prompt_embeds
            if objective.reference_guidance_scale > 1 and embeds.negative_prompt_embeds is None:
                embeds = policy.encode_prompts(traj.prompts, do_classifier_free_guidance=True)  # CFG-free mode 2
            chosen = select_train_timesteps(traj.timesteps, objective.num_train_timesteps,
                                            objective.timestep_max_index,
                                            generator=epoch_generator(cfg.seed, epoch, _TIMESTEPS))
            units = [(ti, start) for ti in range(len(chosen)) for start in range(0, len(x0), tr.batch_size)]
            for part in _split(units, on.updates_per_epoch):
                part_finite = True
                for ti, start in part:
                    rows_idx = slice(start, start + tr.batch_size)
                    gids = group_ids[rows_idx]
                    noise = group_noise(x0.shape[1:], gids, seed=cfg.seed, epoch=epoch, timestep_index=ti)
                    batch = GroupBatch(x0[rows_idx], traj.prompts[rows_idx], embeds.index(torch.arange(
                        len(x0))[rows_idx]), advantages[rows_idx].to(x0.device), gids, on.group_size)
                    with accelerator.autocast():
                        loss, metrics = objective(policy, batch, timesteps=chosen[ti].to(x0.device),
                                                  noise=noise.to(x0.device), reference=reference,
                                                  old_policy=old_policy)
                    part_finite = part_finite and bool(torch.isfinite(loss))
                    accelerator.backward(loss / len(part))
                    add(metrics)
                optimizer_step(part_finite)
        else:
            for inner in range(on.num_inner_epochs):
                # the trained transitions are the same on every process (their own stream); an objective without
                # `timestep_selection` (a plugin written before it) keeps the random subset it was written for
                steps = train_transitions(len(traj.timesteps), objective.timestep_fraction,
                                          getattr(objective, "timestep_selection", "random"),
                                          generator=epoch_generator(cfg.seed, epoch, _TIMESTEPS, inner))
                minibatches, stratified = trajectory_minibatches(group_ids, tr.batch_size, seed=cfg.seed, epoch=epoch,
                                                                 inner=inner)
                if not stratified and not said_local_shuffle and num_proc > 1:
                    said_local_shuffle = True
                    accelerator.print(f"[diffalign] note: trainer.batch_size={tr.batch_size} is not a whole number of "
                                      "members from each of a process's groups, so minibatches are shuffled per "
                                      "process (a run on another number of processes will differ)")
                units = [(idx, k) for idx in minibatches for k in steps]
                for part in _split(units, on.updates_per_epoch):
                    part_finite = True
                    for idx, k in part:
                        mb = traj.index(idx)
                        with accelerator.autocast():
                            loss, metrics = objective(policy, mb, advantages[idx].to(mb.latents.device), k,
                                                      reference=reference,
                                                      **({"rows": idx} if prepare is not None else {}))
                        part_finite = part_finite and bool(torch.isfinite(loss))
                        accelerator.backward(loss / len(part))
                        add(metrics)
                    optimizer_step(part_finite)
        epoch += 1
        train_clock += time.time() - t_epoch
        logs = {k: v / max(1, n_units) for k, v in sums.items()}
        logs.update(reward_metrics(scored))
        logs.update({f"advantage/{k}": v for k, v in adv_stats.items()})
        logs.update({f"vipo/{k}": v for k, v in (epoch_stats or {}).items()})
        logs.update({"nonfinite_skips": guard.skips, "lr": lr_scheduler.get_last_lr()[0], "epoch_seconds": time.time() - t_epoch,
                     "train_seconds": train_clock, "rollouts": epoch * on.groups_per_epoch * on.group_size})
        logs.update(monitor_logs())
        history.append({"epoch": epoch, "step": global_step, **logs})
        accelerator.log(logs, step=epoch)
        progress.update(1)
        progress.set_postfix(reward=f"{logs['reward/mean']:.3f}", loss=f"{logs.get('loss', float('nan')):.4f}")
        if on.checkpointing_epochs and epoch % on.checkpointing_epochs == 0 and accelerator.is_main_process:
            write_checkpoint(epoch)
    progress.close()
    train_seconds = time.time() - t_train
    if accelerator.is_main_process and not (output_dir / f"checkpoint-{global_step}").exists():
        write_checkpoint(epoch)
    final_dir = output_dir / "final"
    if accelerator.is_main_process:
        policy.save_lora_weights(final_dir)
        (output_dir / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))

    # ---------------------------------------------------------------------------------------------------- evaluate
    results = {"epochs": epoch, "global_step": global_step, "train_seconds": train_seconds, "final_lora": str(final_dir),
               "rollouts": epoch * on.groups_per_epoch * on.group_size, "history_tail": history[-3:]}
    if cfg.eval.enabled and accelerator.is_main_process:
        t_eval = time.time()
        policy.denoiser.eval()
        ecfg = eval_config_from(cfg.eval)
        eval_rows = select_prompts(load_prompts(ecfg.prompts), ecfg.prompts_per_tag)
        with bare_forward(policy):
            results["eval"] = evaluate_policy(policy, eval_rows, eval_rewards, ecfg, output_dir / "eval",
                                              {"base": True, "finetuned": False}, log=accelerator.print,
                                              base_key=base_reuse_key(cfg.model, cfg.get("eval_reward") or cfg.reward))
        results["eval_seconds"] = time.time() - t_eval
        try:
            from diffalign.report import write_report

            results["report"] = str(write_report(output_dir / "eval", run_dir=output_dir))
            accelerator.print(f"[diffalign] report: {results['report']}")
        except ImportError:
            pass
    results["total_seconds"] = time.time() - t_start
    if accelerator.is_main_process:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
        accelerator.print(f"[diffalign] done in {results['total_seconds']:.0f}s; results in {output_dir}")
    accelerator.end_training()
    return results


class _null:
    """A no-op context manager."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
