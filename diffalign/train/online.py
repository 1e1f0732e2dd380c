"""Training loop for online methods: rollouts → rewards → advantages → the method's updates.

``train(cfg)`` runs ``online.num_epochs`` epochs of the method built from ``cfg.method`` (any method whose
``data_flow`` is in `diffalign.methods.ONLINE_FLOWS`; the loop reads only the method contract of `diffalign.methods`).
Each epoch:

1. draws ``online.groups_per_epoch`` train prompts (one group each; global group indices
   ``epoch · groups_per_epoch + j`` split across processes, so no two processes or groups share noise);
2. samples ``online.group_size`` images per prompt with the method's ``rollout_policy`` (θ, or θ⁻ for a method that
   samples with an old policy) using ``sampler``, storing step log-probs as the method's ``log_prob_reduction`` asks,
   with initial noise shared inside a group when ``online.shared_initial_noise`` (`diffalign.samplers.groups`);
3. scores them with the selected rewards (`diffalign.train.common.build_reward_sets`; a failing or non-finite reward
   stops the run after a checkpoint, naming the reward, step and prompts); a reward served over HTTP
   (``reward=[http]``) scores each rollout batch of ``online.rollout_batch_size`` while the next one is sampled
   (`diffalign.rewards.reward_set`);
4. computes the advantages the method asks for (its ``advantage``: per group with group or global std, per reward,
   or running per-prompt statistics; `diffalign.advantages.EpochAdvantages`) from the whole epoch's rewards, gathered
   from every process; with ``online.best_of_n`` keeps the n/2 best and n/2 worst of each group;
5. hands the epoch to the method (`OnlineEpoch`): ``method.prepare`` once, then one optimizer update per list of
   units of ``method.plan`` (gradients of its units accumulated, each unit's ``method.loss`` divided by their number;
   under DDP the processes synchronise once per update, `Accelerator.no_sync` on the other units).

Every random stream is seeded from ``(seed, epoch, …)``, so ``resume=latest`` continues from a checkpoint's epoch
exactly; checkpoints hold the LoRA, optimizer, LR scheduler, reference, the method's ``checkpoint_states`` (e.g. θ⁻),
the per-prompt tracker and the non-finite counters. A non-finite loss or gradient skips that update
(``nonfinite_skips``; ``trainer.max_consecutive_nonfinite`` in a row stop the run with a checkpoint); SIGTERM / SIGINT
stop it at the next epoch boundary with a checkpoint (`diffalign.runtime.faults`). After training the base and
fine-tuned models are evaluated on ``eval.prompts`` as in the preference loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from omegaconf import DictConfig
from tqdm.auto import tqdm

from diffalign.advantages import EpochAdvantages, best_of_n_rows
from diffalign.methods import PROMPTS, OnlineEpoch, OnlineMethod, epoch_generator
from diffalign.models.base import bare_forward
from diffalign.rewards.reward_set import (
    ChunkScorer,
    WeightedSum,
    reward_metrics,
    set_reward_step,
    stop_on_reward_error,
)
from diffalign.runtime.console import WarningCounts, console_summary, write
from diffalign.runtime.distributed import is_fsdp, main_process_work
from diffalign.runtime.faults import NonFiniteGuard, StopSignals, resume_hint
from diffalign.runtime.storage import write_text
from diffalign.samplers.base import Sampler, build_sampler
from diffalign.samplers.groups import group_rollout
from diffalign.train.common import (
    Checkpoints,
    Updates,
    evaluation_hint,
    final_evaluation,
    prepare_training,
    save_final_lora,
    start_trackers,
    stop_if_requested,
)
from diffalign.train.ema import ParameterEma
from diffalign.train.prepare import PreparedRun, prepare_run, run_lock_once


def train(run: PreparedRun | DictConfig) -> dict:
    """Runs an online job (``configs/train.yaml`` with an online ``method``); returns the final metrics (also written to
    ``<output_dir>/results.json``).

    Args:
        run (`PreparedRun` or `DictConfig`): the run checked and built by `diffalign.train.prepare.prepare_run` (what
            ``diffalign-train`` passes), or a composed config, which is prepared here (checked and built once).

    Raises:
        ValueError / FileNotFoundError: for a config `prepare_run` refuses (the method's data flow is not online, a
            config the method refuses, a group size < 2, an ``online.split`` the processes do not divide, ...).
        RewardError: when a reward fails (after a checkpoint is written).
        NonFiniteError: after ``trainer.max_consecutive_nonfinite`` skipped updates in a row (checkpoint saved).
        TrainingInterrupted: on SIGTERM / SIGINT, at the next epoch boundary, after a checkpoint is saved.
    """
    cfg = run.cfg if isinstance(run, PreparedRun) else run
    # repeating warnings counted, one summary line per epoch; log lines around the progress bars
    # (diffalign.runtime.console)
    stop_signals = StopSignals(hint=resume_hint(cfg.output_dir))  # (stop messages end with how to continue)
    with run_lock_once(cfg.output_dir), stop_signals as stop, console_summary() as warnings:
        t_start = time.time()
        prepared = run if isinstance(run, PreparedRun) else prepare_run(cfg)
        if not prepared.online:
            raise ValueError(f"method={cfg.method._target_} is not an online method; train it with "
                             "diffalign.train.preference.train")
        run = _setup(prepared)
        run.warnings = warnings
        history = _resume(run)
        t_train = time.time()
        history = _train_epochs(run, stop, history)
        results = _finish(run, history, train_seconds=time.time() - t_train, t_start=t_start)
        stop.raise_if_received("at the end", f"the run finished; its results are in {cfg.output_dir}")
        return results


@dataclass
class _Run:
    """A set-up online run: its parts and its position (epoch, global step)."""

    cfg: DictConfig
    accelerator: Accelerator
    objective: OnlineMethod
    policy: object
    reference: object
    rewards: WeightedSum
    eval_rewards: dict
    monitor: object
    rows: list[dict]
    advantages: EpochAdvantages
    lr_scheduler: object
    guard: NonFiniteGuard
    updates: Updates
    checkpoints: Checkpoints
    sampler: Sampler  # the rollout sampler, built once from cfg.sampler
    ema: ParameterEma | None = None  # online.ema: the LoRA's EMA, evaluated and exported as final/
    epoch: int = 0
    global_step: int = 0
    said: set = field(default_factory=set)
    warnings: WarningCounts | None = None  # the run's repeating warnings (diffalign.runtime.console)

    def trainer_state(self, at_epoch: int) -> dict:
        return {"epoch": at_epoch, "global_step": self.global_step, "tracker": self.advantages.state_dict(),
                "nonfinite": self.guard.state_dict()}

    def write_checkpoint(self, at_epoch: int) -> Path:
        return self.checkpoints.write(self.global_step, self.trainer_state(at_epoch))

    def stop_with_checkpoint(self, at_epoch: int) -> Path:
        """The checkpoint of the current step (written by the main process unless it exists), after a barrier."""
        return self.checkpoints.stop(self.global_step, lambda: self.trainer_state(at_epoch))

    def note(self, message: str) -> None:
        """Prints `message` once per run."""
        if message not in self.said:
            self.said.add(message)
            write(message, self.accelerator)


def _setup(prepared: PreparedRun) -> _Run:
    """The optimizer, LR schedule, trackers and checkpoints around the prepared run's components."""
    cfg, accelerator, objective, policy = prepared.cfg, prepared.accelerator, prepared.method, prepared.policy
    tr, on = cfg.trainer, cfg.online
    sp = build_sampler(cfg.sampler)
    output_dir = Path(cfg.output_dir)
    reference, rewards, eval_rewards = prepared.reference, prepared.rewards, prepared.eval_rewards
    monitor, rows = prepared.monitor, prepared.rows
    advantages = EpochAdvantages(objective.advantage, std=on.advantage_std, clip=on.advantage_clip,
                                 correction=on.advantage_std_correction, eps=on.advantage_eps,
                                 tracker_buffer_size=on.tracker_buffer_size, tracker_min_count=on.tracker_min_count)
    total_updates = on.num_epochs * objective.epoch_updates(on.updates_per_epoch, on.num_inner_epochs)
    params, optimizer, lr_scheduler = prepare_training(accelerator, policy, tr, total_updates)
    start_trackers(accelerator, cfg)
    accelerator.print(
        f"[diffalign] online {type(objective).__name__}: {sum(p.numel() for p in params) / 1e6:.3f}M trainable "
        f"parameters; {on.num_epochs} epochs × {on.groups_per_epoch} prompts × {on.group_size} samples "
        f"({sp.describe()}, {sp.num_inference_steps} steps, CFG {sp.guidance_scale}); {len(rows)} train prompts; "
        f"reward {rewards!r}{' (one advantage per reward)' if objective.advantage == 'per_reward' else ''}"
        f"{f'; best-of-{on.best_of_n}' if on.get('best_of_n') else ''}; output {output_dir}")
    if cfg.eval.enabled:  # the default evaluation can outlast a smoke run's training: say so, and how to skip it
        accelerator.print(evaluation_hint(cfg))
    guard = NonFiniteGuard(tr.get("max_consecutive_nonfinite", 5))
    updates = Updates(accelerator, policy, reference, guard, optimizer, lr_scheduler, params, tr.max_grad_norm)
    ema = None
    if on.get("ema", False):
        if is_fsdp(accelerator):
            raise ValueError("online.ema=true is not supported under FSDP (each process holds a shard of the LoRA); "
                             "run without FSDP or with online.ema=false")
        ema = ParameterEma(params, on.get("ema_decay", 0.9), on.get("ema_update_interval", 8))
    checkpoints = Checkpoints(accelerator, output_dir, policy, optimizer, lr_scheduler, tr.keep_last,
                              {"reference_state": reference, **objective.checkpoint_states(),
                               **({"ema_state": ema} if ema is not None else {})})
    return _Run(cfg, accelerator, objective, policy, reference, rewards, eval_rewards, monitor, rows, advantages,
                lr_scheduler, guard, updates, checkpoints, sp, ema)


def _resume(run: _Run) -> list[dict]:
    """Continues from ``cfg.resume`` (if any); returns the history of the epochs before the checkpoint."""
    state = run.checkpoints.resume(run.cfg.resume)
    if state is None:
        return []
    run.epoch, run.global_step = state["epoch"], state["global_step"]
    run.advantages.load_state_dict(state.get("tracker", {}))
    run.guard.load_state_dict(state.get("nonfinite", run.guard.state_dict()))
    history = []
    path = Path(run.cfg.output_dir) / "history.jsonl"
    if path.is_file():  # keep the log of the epochs before the checkpoint
        history = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        history = [h for h in history if h.get("epoch", 0) <= run.epoch]
    run.accelerator.print(f"[diffalign] resumed from {state['checkpoint']} at epoch {run.epoch} (step "
                          f"{run.global_step})")
    return history


def _monitor_logs(run: _Run) -> dict:
    """The hacking monitors' metrics when due (main process), else `{}`; logged to the trackers (with the samples)
    at the loop's tracker step, the epoch (``monitor.every`` counts optimizer steps)."""
    if run.monitor is None:
        return {}
    out = {}
    with main_process_work(run.accelerator, run.policy, due=run.global_step % run.monitor.every == 0) as main:
        if main:  # (FSDP: every process gathered the weights)
            run.policy.denoiser.eval()
            with bare_forward(run.policy):
                out = run.monitor.maybe_log(run.global_step, run.policy, accelerator=run.accelerator,
                                            log=lambda message: write(message, run.accelerator),
                                            tracker_step=run.epoch) or {}
            run.policy.denoiser.train()
    return out


def _train_epochs(run: _Run, stop: StopSignals, history: list[dict]) -> list[dict]:
    """Runs the remaining epochs (checkpoint every ``online.checkpointing_epochs``); returns the whole history."""
    on, accelerator = run.cfg.online, run.accelerator
    progress = tqdm(total=on.num_epochs, initial=run.epoch, desc="epochs", disable=not accelerator.is_main_process)
    # train_clock: seconds of rollouts + updates (no monitors), carried over a resume
    train_clock = float(history[-1].get("train_seconds", 0.0)) if history else 0.0
    if run.epoch == 0 and run.monitor is not None and not history:
        first = _monitor_logs(run)
        if first:
            history.append({"epoch": 0, "step": 0, "rollouts": 0, "train_seconds": 0.0, **first})
    while run.epoch < on.num_epochs:
        stop_if_requested(stop, accelerator, lambda: run.stop_with_checkpoint(run.epoch),
                          f"before epoch {run.epoch} (step {run.global_step})")
        t_epoch = time.time()
        logs = _epoch(run)
        run.epoch += 1
        train_clock += time.time() - t_epoch
        logs.update({"nonfinite_skips": run.guard.skips, "lr": run.lr_scheduler.get_last_lr()[0],
                     "epoch_seconds": time.time() - t_epoch, "train_seconds": train_clock,
                     "rollouts": run.epoch * on.groups_per_epoch * on.group_size})
        # one line per kind of repeating warning of the epoch (summed over the processes)
        logs.update(run.warnings.flush(f"epoch {run.epoch - 1}", accelerator))
        accelerator.log(logs, step=run.epoch)
        logs.update(_monitor_logs(run))  # (logged by the monitor itself, at the same tracker step)
        history.append({"epoch": run.epoch, "step": run.global_step, **logs})
        progress.update(1)
        progress.set_postfix(reward=f"{logs['reward/mean']:.3f}", loss=f"{logs.get('loss', float('nan')):.4f}",
                             **run.warnings.postfix())
        if on.checkpointing_epochs and run.epoch % on.checkpointing_epochs == 0:  # (every process: FSDP gathers)
            run.write_checkpoint(run.epoch)
    progress.close()
    return history


def _epoch(run: _Run) -> dict:
    """One epoch: rollouts, rewards, advantages, then the method's updates; returns the epoch's log entries."""
    cfg, on, accelerator, policy = run.cfg, run.cfg.online, run.accelerator, run.policy
    num_proc, rank, epoch = accelerator.num_processes, accelerator.process_index, run.epoch
    # split of an epoch's rows across processes: whole groups ("groups"), or a share of every group ("members": each
    # process samples members r·G/P .. (r+1)·G/P − 1 of every group, so a group spans the processes)
    members_split = on.get("split", "groups") == "members"
    per_proc = on.groups_per_epoch if members_split else on.groups_per_epoch // num_proc
    share = on.group_size // num_proc if members_split else on.group_size
    # 1. prompts of this epoch (the same draw on every process; each takes its own slice)
    pick = torch.randint(len(run.rows), (on.groups_per_epoch,), generator=epoch_generator(cfg.seed, epoch, PROMPTS))
    mine = list(range(on.groups_per_epoch)) if members_split else list(range(rank * per_proc, (rank + 1) * per_proc))
    epoch_rows = [run.rows[int(pick[j])] for j in mine]
    metadata = [r for r in epoch_rows for _ in range(share)]
    # 2. rollouts with the method's rollout policy (θ, or θ⁻); a reward server scores each rollout batch while the
    # next one is sampled (other rewards are called on the whole epoch in 3., as before)
    set_reward_step(run.rewards, run.global_step, reset_calls=True)
    scorer = ChunkScorer(run.rewards, metadata)
    policy.denoiser.eval()
    with torch.no_grad(), run.objective.rollout_policy.use(policy):
        traj, group_ids = group_rollout(
            policy, [r["prompt"] for r in epoch_rows], on.group_size,
            group_indices=[epoch * on.groups_per_epoch + j for j in mine], seed=cfg.seed, epoch=epoch,
            shared_initial_noise=on.shared_initial_noise, sampler=run.sampler, rollout_batch_size=on.rollout_batch_size, reduction=run.objective.log_prob_reduction,
            encode_prompts_once=on.get("encode_prompts_once", False), fuse_lora=on.get("fuse_rollout_lora", "auto"),
            members=list(range(rank * share, (rank + 1) * share)) if members_split else None,
            on_chunk=scorer.add)
    policy.denoiser.train()
    # 3. rewards (a failing or non-finite one stops the run after a checkpoint)
    with stop_on_reward_error(lambda: run.checkpoints.before_stop(run.global_step, lambda: run.trainer_state(epoch))):
        scored = scorer.result(traj.images, traj.prompts)
    # 4. advantages
    advantages, adv_stats = _advantages(run, scored, group_ids, traj.prompts)
    scores = scored.scores.detach().cpu()
    if on.get("best_of_n"):  # keep the n/2 best and n/2 worst of each group
        keep = best_of_n_rows(scores, group_ids, on.best_of_n)
        if len(keep) < len(scores):
            traj, advantages, group_ids = traj.index(keep), advantages[keep], group_ids[keep]
        adv_stats["kept_fraction"] = len(keep) / len(scores)
    # 5. the method's updates
    data = OnlineEpoch(traj, advantages, group_ids, on.group_size,
                       torch.tensor([run.rewards.weights[n] for n in run.rewards.weights]), cfg.seed, epoch,
                       cfg.trainer.batch_size, on.updates_per_epoch, on.num_inner_epochs, num_proc,
                       on.get("split", "groups"), run.note)
    prepared = run.objective.prepare(policy, data)
    logs = _updates(run, data)
    logs.update(reward_metrics(scored))
    logs.update({f"advantage/{k}": v for k, v in adv_stats.items()})
    logs.update(prepared)
    return logs


def _advantages(run: _Run, scored, group_ids: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict]:
    """This process's rows of the advantages, computed from the whole epoch's rewards on every process (gathered in
    rank order), so the global std and the per-prompt tracker see what one process would."""
    accelerator = run.accelerator
    scores = scored.scores.detach().cpu()
    all_scores, all_ids, all_prompts = scores, group_ids, list(prompts)
    if accelerator.num_processes > 1:
        all_scores = accelerator.gather(scores.to(accelerator.device)).cpu()
        all_ids = accelerator.gather(group_ids.to(accelerator.device)).cpu()
        all_prompts = gather_object(list(prompts))

    def components() -> torch.Tensor:  # (N, R) each reward's scores, for one advantage per reward
        out = torch.stack([scored.info[f"scores/{n}"].detach().float().cpu() for n in run.rewards.weights], 1)
        return accelerator.gather(out.to(accelerator.device)).cpu() if accelerator.num_processes > 1 else out

    advantages, stats = run.advantages(all_scores, all_ids, all_prompts, components)
    rank = accelerator.process_index
    return advantages[rank * len(scores):(rank + 1) * len(scores)], stats


def _updates(run: _Run, data: OnlineEpoch) -> dict:
    """One optimizer update per list of units of ``method.plan`` (`Updates.update`: the reference is stepped before
    each); returns the units' mean metrics."""
    accelerator = run.accelerator
    sums: dict[str, float] = {}
    n_units = 0
    for update in run.objective.plan(run.policy, data):
        # a non-finite loss or gradient (on any process) skips the update; the step still counts (LR schedule, θ⁻)
        with run.updates.update(run.global_step) as losses:
            for i, unit in enumerate(update):
                # the processes synchronise the accumulated gradients once per update, at its last unit (DDP no_sync)
                last = i == len(update) - 1
                with (contextlib.nullcontext() if last else accelerator.no_sync(run.policy.forward_module)), \
                        accelerator.autocast():
                    loss, metrics = run.objective.loss(run.policy, unit, reference=run.reference)
                    losses.add(loss)
                    accelerator.backward(loss / len(update))
                n_units += 1
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        run.global_step += 1
        run.objective.rollout_policy.after_update()
        if run.ema is not None:
            run.ema.after_update(run.global_step)
        run.updates.stop_if_exhausted(lambda: run.stop_with_checkpoint(run.epoch),
                                      f"epoch {run.epoch}, step {run.global_step}",
                                      f" (mid-epoch: it restarts epoch {run.epoch})")
    return {k: v / max(1, n_units) for k, v in sums.items()}


def _finish(run: _Run, history: list[dict], *, train_seconds: float, t_start: float) -> dict:
    """The last checkpoint, the final LoRA and history, the evaluation and ``results.json``."""
    accelerator, on, output_dir = run.accelerator, run.cfg.online, Path(run.cfg.output_dir)
    if not (output_dir / f"checkpoint-{run.global_step}").exists():  # (every process: FSDP gathers)
        run.write_checkpoint(run.epoch)
    final_dir = output_dir / "final"
    # online.ema: the EMA is the final LoRA and what is evaluated (the checkpoint above holds the live weights)
    with run.ema.swapped_in() if run.ema is not None else contextlib.nullcontext():
        with main_process_work(accelerator, run.policy) as main:
            if main:
                save_final_lora(run.policy, final_dir)
        if accelerator.is_main_process:
            write_text(output_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in history))
        results = {"epochs": run.epoch, "global_step": run.global_step, "train_seconds": train_seconds,
                   "final_lora": str(final_dir), "rollouts": run.epoch * on.groups_per_epoch * on.group_size,
                   "history_tail": history[-3:]}
        with main_process_work(accelerator, run.policy, due=run.cfg.eval.enabled):
            results.update(final_evaluation(run.cfg, accelerator, run.policy, run.eval_rewards, run.global_step,
                                            lambda: run.checkpoints.before_stop(run.global_step,
                                                                                lambda: run.trainer_state(run.epoch)),
                                            tracker_step=run.epoch))
    results["ema"] = run.ema is not None
    results["total_seconds"] = time.time() - t_start
    results["warnings"] = run.warnings.totals  # this process's (the main one's: summed over processes)
    if accelerator.is_main_process:
        write_text(output_dir / "results.json", json.dumps(results, indent=2, default=str))
        accelerator.print(f"[diffalign] done in {results['total_seconds']:.0f}s; results in {output_dir}")
        if results.get("headline"):  # the evaluation's headline figure, last (diffalign.evaluation.metrics)
            accelerator.print(results["headline"])
    accelerator.end_training()
    return results
