"""Training loop for offline and semi-online preference data: every method whose data flow is "pairs" or "winners".

``main(cfg)`` → setup → train → evaluate. The loop is written out (no Trainer class): one optimizer step per
``trainer.gradient_accumulation_steps`` micro-batches of ``trainer.batch_size`` items, gradient clipping, an LR
schedule with warmup, trackers, and atomic checkpoints every ``trainer.checkpointing_steps`` holding the LoRA (diffusers
format), optimizer, scheduler, data-sampler and reference state, so ``resume=latest`` continues exactly: the
training draws (t, ε, ...) come from one generator per sample seeded by (seed, step, micro-step, global position)
(`sample_generators`), so they need no saved state and do not depend on how the global batch is split across
processes.

The method (any whose ``data_flow`` is in `diffalign.methods.PREFERENCE_FLOWS`; the loop reads only the method
contract of `diffalign.methods`) says which batches it is called with (`diffalign.methods.BATCH_TYPES`):

- ``"pairs"``: the data yields ``images_w`` and ``images_l`` (VAE-encoded here), or ``latents_w`` and ``latents_l``
  directly (data sets that store latents), and optionally ``degraded_prompts`` (encoded too); the method gets a
  `PreferenceBatch`;
- ``"winners"``: only ``images_w`` is used (a pairs data set works too; its losers are ignored, and not read when it
  has ``winners_only``); the method gets a `WinnerBatch`.

The reference strategy (``cfg.reference``, `diffalign.reference`) is set up on the policy before the optimizer is
built (then the method's ``setup``), gets ``on_step(policy, n)`` before every update, ``n`` being the updates already
done (`diffalign.train.common.Updates`, as in the online loop), is passed to the objective as ``reference=``, and its
state is written as ``reference_state.{json,safetensors}`` into every checkpoint and read back on resume, with the
method's ``checkpoint_states``.

Rewards: ``reward=[...]`` is the training set (used by on-policy data such as ``data=ranked_pairs``), ``eval_reward=[...]``
the evaluation set (evaluation and the hacking monitors; the training set when unset). Every reward call is checked
(`diffalign.rewards.reward_set`): a reward that raises or returns NaN/inf stops the run after a checkpoint is saved,
with a `RewardError` naming the reward, the step, the batch and the prompt. ``monitor.every > 0`` logs a gold reward on
fixed prompts and seeds and the group diversity every that many steps (`diffalign.evaluation.monitors`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from tqdm.auto import tqdm

from diffalign.data.preference import PreferenceData, ResumableSampler
from diffalign.data.resumable import prepare_dataset
from diffalign.methods import BATCH_TYPES, PreferenceMethod, stream_seed
from diffalign.models.base import bare_forward
from diffalign.rewards.reward_set import WeightedSum, set_reward_step, stop_on_reward_error
from diffalign.runtime.console import WarningCounts, console_summary, write
from diffalign.runtime.distributed import main_process_work
from diffalign.runtime.faults import NonFiniteGuard, StopSignals, resume_hint
from diffalign.runtime.storage import write_text
from diffalign.train.common import (  # noqa: F401 (build_lr_scheduler: re-exported)
    Checkpoints,
    Updates,
    build_lr_scheduler,
    final_evaluation,
    prepare_training,
    save_final_lora,
    start_trackers,
    stop_if_requested,
)
from diffalign.train.prepare import PreparedRun, prepare_run, run_lock_once

_NOISE_TAG = 20  # stream tag of the training draws (diffalign.samplers.groups.stream_seed)


def sample_generators(seed: int, step: int, micro: int, start: int, count: int) -> list[torch.Generator]:
    """One CPU generator per sample of a micro-batch, seeded by (seed, step, micro-step, the sample's position in the
    global batch): global positions ``start .. start + count - 1``.

    The objective draws each sample's t and ε (and any further per-sample draws) from its own generator, so what a
    sample gets depends neither on the number of processes nor on which other samples share its process: N processes
    with batch B draw exactly what one process with batch N·B does, and a resumed run draws what the uninterrupted one
    did (the seeds are a function of the step; no generator state is carried)."""
    return [torch.Generator(device="cpu").manual_seed(stream_seed(seed, step, micro, start + i, _NOISE_TAG))
            for i in range(count)]


def data_latents(policy, batch_data: dict, side: str, device) -> torch.Tensor:
    """The clean latents of one side (`side` "w" or "l") of a data batch: ``latents_<side>`` as given (data sets that
    store latents), else ``images_<side>`` encoded with `policy.encode_images`. Float32 on
    `device`."""
    if f"latents_{side}" in batch_data:
        return batch_data[f"latents_{side}"].to(device=device, dtype=torch.float32)
    return policy.encode_images(batch_data[f"images_{side}"].to(device))


class LatentCache:
    """The clean latents of a data set's items, VAE-encoded once per run instead of at every step they are drawn.

    Valid because every built-in data set returns the same item for the same index each time it is read (renders and
    crops are seeded by the index; no random augmentation). Keyed by (side, index); float32, on the device. Data
    that carries latents itself (``latents_<side>``) passes through. `enabled` is False for a data
    set whose latents would need more than `max_bytes` (then every batch is encoded as it comes).
    """

    def __init__(self, num_items: int, latent_numel: int, *, enabled: bool = True, max_bytes: int = 2 * 1024**3):
        self.estimate = 2 * num_items * latent_numel * 4  # both sides, float32
        self.enabled = enabled and self.estimate <= max_bytes
        self._store: dict[tuple[str, int], torch.Tensor] = {}

    def latents(self, policy, batch_data: dict, side: str, indices: list[int], device) -> torch.Tensor:
        """`data_latents` of one side of a batch whose items are `indices`, encoding only items not seen before."""
        if not self.enabled or f"latents_{side}" in batch_data:
            return data_latents(policy, batch_data, side, device)
        missing = [k for k, i in enumerate(indices) if (side, i) not in self._store]
        if missing:
            images = batch_data[f"images_{side}"][missing]
            for k, latent in zip(missing, policy.encode_images(images.to(device))):
                self._store[side, indices[k]] = latent
        return torch.stack([self._store[side, i] for i in indices])

    def refill(self, policy, dataset: PreferenceData, batches, sides, device) -> int:
        """Encodes again what `latents` encoded for `batches` (this process's slices of the batches drawn before a
        resume, in order), in the same sub-batches, so that a resumed run's cache holds bit for bit what the
        uninterrupted run's held: on CPU a VAE's output for an image can change at float rounding with the other
        images of its batch. Data that carries latents, and a disabled cache, encode nothing.

        Returns:
            `int`: the number of (side, item) latents encoded.
        """
        if not self.enabled:
            return 0
        encoded = 0
        for indices in batches:
            for side in sides:
                missing = [i for i in indices if (side, i) not in self._store]
                if not missing:
                    continue
                data = dataset.collate(missing)  # each item is the same whatever it is stacked with
                if f"latents_{side}" in data or f"images_{side}" not in data:
                    continue
                for i, latent in zip(missing, policy.encode_images(data[f"images_{side}"].to(device))):
                    self._store[side, i] = latent
                encoded += len(missing)
        return encoded


def train(run: PreparedRun | DictConfig) -> dict:
    """Runs a preference fine-tuning job (see ``configs/train.yaml``); returns the final metrics.

    Args:
        run (`PreparedRun` or `DictConfig`): the run checked and built by `diffalign.train.prepare.prepare_run` (what
            ``diffalign-train`` passes), or a composed config, which is prepared here (checked and built once).

    Raises:
        ValueError / FileNotFoundError: for a config `prepare_run` refuses (the method's ``data_flow`` is neither
            "pairs" nor "winners", a "pairs" method given data without losers, ...), or data whose image size is not
            the model's pixel size.
        NonFiniteError: after ``trainer.max_consecutive_nonfinite`` skipped updates in a row (checkpoint saved).
        TrainingInterrupted: on SIGTERM / SIGINT, after a checkpoint is saved between two updates.
    """
    cfg = run.cfg if isinstance(run, PreparedRun) else run
    # repeating warnings (saturation, skipped updates, ...) counted, one summary line per trainer.warnings_every
    # steps; every log line written around the progress bars (diffalign.runtime.console)
    stop_signals = StopSignals(hint=resume_hint(cfg.output_dir))  # (stop messages end with how to continue)
    with run_lock_once(cfg.output_dir), stop_signals as stop, console_summary() as warnings:
        t_start = time.time()
        prepared = run if isinstance(run, PreparedRun) else prepare_run(cfg)  # 1. checks, then every component
        if prepared.online:
            raise ValueError(f"method={cfg.method._target_} is an online method; train it with "
                             "diffalign.train.online.train")
        run = _setup(prepared)  # optimizer, LR schedule, checkpoints
        run.warnings = warnings
        _prepare_data(run, stop)
        _resume(run)  # 2. resume
        t_train = time.time()
        history = _train_steps(run, stop)  # 3. train
        results = _finish(run, history, train_seconds=time.time() - t_train, t_start=t_start)  # 4. evaluate
        stop.raise_if_received("at the end", f"the run finished; its results are in {cfg.output_dir}")
        return results


@dataclass
class _Run:
    """A set-up preference run: its parts and its position (the global step, the data sampler's state)."""

    cfg: DictConfig
    accelerator: Accelerator
    objective: PreferenceMethod
    policy: object
    reference: object
    dataset: PreferenceData
    rewards: WeightedSum
    eval_rewards: dict
    monitor: object
    params: list
    lr_scheduler: object
    guard: NonFiniteGuard
    updates: Updates
    checkpoints: Checkpoints
    pixel_size: tuple[int, int]
    sampler: ResumableSampler | None = None  # made once the data is prepared
    latent_cache: LatentCache | None = None
    warnings: WarningCounts | None = None  # the run's repeating warnings (diffalign.runtime.console)
    global_step: int = 0
    data_seconds: float = 0.0

    def trainer_state(self, step: int) -> dict:
        sampler = self.sampler
        return {"global_step": step, "epoch": sampler.state_dict()["epoch"] if sampler is not None else 0,
                "sampler": sampler.state_dict() if sampler is not None else None,  # None: stopped while preparing
                "nonfinite": self.guard.state_dict()}

    def checkpoint_before_stop(self, step: int) -> Path | None:
        """The checkpoint of `step` (written now unless it exists) when a reward fails; main process only."""
        return self.checkpoints.before_stop(step, lambda: self.trainer_state(step))


def _setup(prepared: PreparedRun) -> _Run:
    """The optimizer, LR schedule, trackers and checkpoints around the prepared run's components."""
    cfg, accelerator, objective, policy = prepared.cfg, prepared.accelerator, prepared.method, prepared.policy
    tr, reference, dataset, pixel_size = cfg.trainer, prepared.reference, prepared.dataset, prepared.pixel_size
    rewards, eval_rewards, monitor = prepared.rewards, prepared.eval_rewards, prepared.monitor
    params, optimizer, lr_scheduler = prepare_training(accelerator, policy, tr, tr.max_steps)
    guard = NonFiniteGuard(tr.get("max_consecutive_nonfinite", 5))
    updates = Updates(accelerator, policy, reference, guard, optimizer, lr_scheduler, params, tr.max_grad_norm)
    start_trackers(accelerator, cfg)
    checkpoints = Checkpoints(accelerator, Path(cfg.output_dir), policy, optimizer, lr_scheduler, tr.keep_last,
                              {"reference_state": reference, **objective.checkpoint_states()})
    return _Run(cfg, accelerator, objective, policy, reference, dataset, rewards, eval_rewards, monitor, params,
                lr_scheduler, guard, updates, checkpoints, pixel_size)


def _prepare_data(run: _Run, stop: StopSignals) -> None:
    """The data set's `prepare` (on-policy data, e.g. RankedPairs, is made by the policy itself here; static data
    has nothing to make), then the data sampler and latent cache."""
    accelerator, tr, dataset = run.accelerator, run.cfg.trainer, run.dataset
    t_data = time.time()
    set_reward_step(run.rewards, 0)
    with stop_on_reward_error(lambda: run.checkpoint_before_stop(0)):
        # (nothing for static data; on-policy data resumable in <output_dir>/prepared, diffalign.data.resumable)
        prepare_dataset(dataset, run.policy, run.rewards.rewards, cfg=run.cfg, accelerator=accelerator, stop=stop)
    run.data_seconds = time.time() - t_data
    run.warnings.flush("data preparation", accelerator)
    if dataset.stats:
        accelerator.print(f"[diffalign] data prepared in {run.data_seconds:.0f}s: {dataset.stats}")
    # one global batch of batch_size × processes per micro-step; process r takes its r-th slice (no duplicates)
    num_proc = accelerator.num_processes
    if len(dataset) < tr.batch_size * num_proc:  # on-policy data only knows its size now (static data: validation)
        raise ValueError(f"the data holds {len(dataset)} items, fewer than one global batch (trainer.batch_size="
                         f"{tr.batch_size} × {num_proc} processes); lower trainer.batch_size or make more data "
                         "(e.g. raise data.num_prompts or data.samples_per_prompt)")
    run.sampler = ResumableSampler(len(dataset), tr.batch_size * num_proc, seed=run.cfg.seed, shuffle=True,
                                   drop_last=True)
    run.latent_cache = LatentCache(len(dataset), math.prod(run.policy.latent_shape),
                                   enabled=tr.get("cache_latents", True))
    if tr.get("cache_latents", True) and not run.latent_cache.enabled:
        accelerator.print(f"[diffalign] the data's latents would take {run.latent_cache.estimate / 1024**3:.1f} GiB; "
                          "encoding every batch as it comes instead of caching (trainer.cache_latents)")
    effective = tr.batch_size * tr.gradient_accumulation_steps * num_proc
    accelerator.print(f"[diffalign] {sum(p.numel() for p in run.params) / 1e6:.3f}M trainable parameters; "
                      f"{tr.max_steps} optimizer steps × {effective} {run.objective.data_flow} (batch {tr.batch_size} "
                      f"× accumulation {tr.gradient_accumulation_steps} × {num_proc} processes); {len(dataset)} items; "
                      f"reference {run.reference.strategy}; output {run.cfg.output_dir}")


def _resume(run: _Run) -> None:
    state = run.checkpoints.resume(run.cfg.resume)
    if state is None:
        return
    run.global_step = state["global_step"]
    if state["sampler"] is not None:  # (None: a run stopped by a reward failure while preparing data)
        run.sampler.load_state_dict(state["sampler"])
    run.guard.load_state_dict(state.get("nonfinite", run.guard.state_dict()))
    run.accelerator.print(f"[diffalign] resumed from {state['checkpoint']} at step {run.global_step}")
    if state["sampler"] is not None and run.latent_cache.enabled:
        _refill_latent_cache(run)


def _refill_latent_cache(run: _Run) -> None:
    """After a resume: the latent cache as the uninterrupted run had it at the resumed step (`LatentCache.refill`
    over the batches the steps before it drew), so that the resumed run continues bit for bit."""
    tr, rank = run.cfg.trainer, run.accelerator.process_index
    replay = ResumableSampler(run.sampler.num_items, run.sampler.batch_size, seed=run.sampler.seed,
                              shuffle=run.sampler.shuffle, drop_last=run.sampler.drop_last)
    batches = [replay.next_batch()[rank * tr.batch_size:(rank + 1) * tr.batch_size]
               for _ in range(run.global_step * tr.gradient_accumulation_steps)]
    if replay.state_dict() != run.sampler.state_dict():  # (not this config's sampler: nothing to replay exactly)
        run.accelerator.print(f"[diffalign] the checkpoint's data position {run.sampler.state_dict()} is not where "
                              f"{len(batches)} batches of this config end ({replay.state_dict()}); the latent cache "
                              "starts empty (the run continues, not bit for bit)")
        return
    with torch.no_grad():
        encoded = run.latent_cache.refill(run.policy, run.dataset, batches,
                                          BATCH_TYPES[run.objective.data_flow].sides, run.accelerator.device)
    if encoded:
        run.accelerator.print(f"[diffalign] latent cache: re-encoded the {encoded} latents the steps before "
                              f"{run.global_step} encoded, in the same batches")


def _batch(run: _Run):
    """This process's slice of the next global batch, as the batch type of the method's data flow."""
    tr, policy, device = run.cfg.trainer, run.policy, run.accelerator.device
    rank = run.accelerator.process_index
    batch_type = BATCH_TYPES[run.objective.data_flow]
    indices = run.sampler.next_batch()[rank * tr.batch_size:(rank + 1) * tr.batch_size]
    data = run.dataset.collate(indices)
    if "latents_w" in data:
        if tuple(data["latents_w"].shape[1:]) != tuple(policy.latent_shape):
            raise ValueError(f"data latents are {tuple(data['latents_w'].shape[1:])} but the model's are "
                             f"{tuple(policy.latent_shape)}; generate the pairs with this model")
    elif tuple(data["images_w"].shape[-2:]) != run.pixel_size:
        raise ValueError(f"data images are {tuple(data['images_w'].shape[-2:])} px but the model makes "
                         f"{run.pixel_size} px images; set data.resolution={run.pixel_size[0]} (or null)")
    if "l" in batch_type.sides and "images_l" not in data and "latents_l" not in data:
        raise ValueError(f"method={run.cfg.method._target_} needs preference pairs but data={run.cfg.data._target_} "
                         "yields winners only; pick a pairs data set (e.g. data=shapes_pairs, data=pickapic)")
    with torch.no_grad():
        batch = batch_type.from_data(
            data, lambda side: run.latent_cache.latents(policy, data, side, indices, device),
            lambda prompts: policy.encode_prompts(prompts, do_classifier_free_guidance=False))
    return batch, len(data["prompts"])


def _train_steps(run: _Run, stop: StopSignals) -> list[dict]:
    """Optimizer steps up to ``trainer.max_steps`` (checkpoint every ``trainer.checkpointing_steps``); the history."""
    accelerator, tr, policy = run.accelerator, run.cfg.trainer, run.policy
    rank = accelerator.process_index
    policy.denoiser.train()
    progress = tqdm(total=tr.max_steps, initial=run.global_step, desc="train", disable=not accelerator.is_main_process)
    history = []
    say = lambda message: write(message, accelerator)  # (around the progress bar)
    every = tr.get("warnings_every", 10)
    interval_start = run_start = run.global_step + 1
    if run.monitor is not None and run.global_step == 0:  # the monitors' baseline (main process; FSDP: gathered)
        with main_process_work(accelerator, policy) as main:
            if main:
                with stop_on_reward_error(lambda: run.checkpoint_before_stop(0)), bare_forward(policy):
                    run.monitor.maybe_log(0, policy, accelerator, log=say)
    while run.global_step < tr.max_steps:
        # SIGTERM / SIGINT: checkpoint, then exit (code 128 + signal in the CLI)
        stop_if_requested(stop, accelerator, lambda: run.checkpoints.stop(
            run.global_step, lambda: run.trainer_state(run.global_step)), f"at step {run.global_step}")
        sums: dict[str, float] = {}
        # a non-finite loss or gradient (on any process) skips the update; the step still counts (data, LR schedule)
        with run.updates.update(run.global_step) as losses:
            for micro in range(tr.gradient_accumulation_steps):
                batch, count = _batch(run)
                with accelerator.accumulate(policy.forward_module), accelerator.autocast():
                    # one generator per sample, keyed by its position in the global batch (`sample_generators`)
                    generators = sample_generators(run.cfg.seed, run.global_step, micro, rank * tr.batch_size, count)
                    loss, metrics = run.objective(policy, batch, generator=generators, reference=run.reference)
                    losses.add(loss)
                    accelerator.backward(loss)  # also when non-finite: every process must take part in the all-reduce
                for k, v in metrics.items():
                    if torch.is_tensor(v) and v.numel() == 1:
                        sums[k] = sums.get(k, 0.0) + float(v) / tr.gradient_accumulation_steps
        run.global_step += 1
        step = run.global_step
        sums["nonfinite_skips"] = run.guard.skips
        sums["lr"] = run.lr_scheduler.get_last_lr()[0]
        run.updates.stop_if_exhausted(lambda step=step: run.checkpoints.stop(step, lambda: run.trainer_state(step)),
                                      f"step {step}")
        if step % every == 0 or step == tr.max_steps:  # one line per kind of repeating warning of the interval
            # (per-run kinds, e.g. saturation: one line for the whole run, at its last step)
            run_where = f"steps {run_start}-{step}" if step == tr.max_steps else None
            sums.update(run.warnings.flush(f"steps {interval_start}-{step}", accelerator, run_where=run_where))
            interval_start = step + 1
        history.append({"step": step, **sums})
        accelerator.log(sums, step=step)
        if run.monitor is not None:  # gold reward + diversity every monitor.every steps (main process; FSDP: gathered)
            with main_process_work(accelerator, policy, due=step % run.monitor.every == 0) as main:
                if main:
                    with stop_on_reward_error(lambda step=step: run.checkpoint_before_stop(step)), \
                            bare_forward(policy):
                        run.monitor.maybe_log(step, policy, accelerator, log=say)
        progress.update(1)
        progress.set_postfix(loss=f"{sums.get('loss', float('nan')):.4f}", acc=f"{sums.get('implicit_acc', 0):.2f}",
                             **run.warnings.postfix())
        if tr.checkpointing_steps and step % tr.checkpointing_steps == 0:  # (every process: FSDP gathers)
            run.checkpoints.write(step, run.trainer_state(step))
    progress.close()
    return history


def _finish(run: _Run, history: list[dict], *, train_seconds: float, t_start: float) -> dict:
    """The last checkpoint and the final LoRA; evaluation of base vs fine-tuned, the HTML report
    (<output_dir>/eval/report.html) and ``results.json``."""
    accelerator, output_dir, step = run.accelerator, Path(run.cfg.output_dir), run.global_step
    if not (output_dir / f"checkpoint-{step}").exists():  # (every process: FSDP gathers)
        run.checkpoints.write(step, run.trainer_state(step))  # (a resumed run that was already finished has it)
    final_dir = output_dir / "final"
    with main_process_work(accelerator, run.policy) as main:
        if main:
            save_final_lora(run.policy, final_dir)
    results = {"global_step": step, "train_seconds": train_seconds, "data_seconds": run.data_seconds,
               "data_stats": run.dataset.stats, "final_lora": str(final_dir),
               "history_tail": history[-5:]}
    with main_process_work(accelerator, run.policy, due=run.cfg.eval.enabled):
        results.update(final_evaluation(run.cfg, accelerator, run.policy, run.eval_rewards, step,
                                        lambda: run.checkpoint_before_stop(step)))
    results["total_seconds"] = time.time() - t_start
    results["warnings"] = run.warnings.totals  # this process's (the main one's: summed over processes)
    if accelerator.is_main_process:
        write_text(output_dir / "results.json", json.dumps(results, indent=2, default=str))
        accelerator.print(f"[diffalign] done in {results['total_seconds']:.0f}s; results in {output_dir}")
        if results.get("headline"):  # the evaluation's headline figure, last (diffalign.evaluation.metrics)
            accelerator.print(results["headline"])
    accelerator.end_training()
    return results
