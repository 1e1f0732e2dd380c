"""What both training loops share, written once: the accelerator and trackers, the optimizer and LR schedule, the
optimizer updates (reference stepping, the non-finite guard: `Updates`), checkpoints (write, stop, resume), the stop on
SIGTERM / SIGINT, the reward set, and the final evaluation.

The loops stay unrolled (`diffalign.train.online`, `diffalign.train.preference`); these are the blocks they would
otherwise each write out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from omegaconf import DictConfig, OmegaConf

from diffalign.evaluation.evaluate import evaluate_policy
from diffalign.evaluation.files import base_reuse_key
from diffalign.evaluation.generation import eval_config_from, select_prompts
from diffalign.evaluation.metrics import headline_line
from diffalign.models.base import bare_forward
from diffalign.rewards.reward_set import (
    CheckedReward,
    WeightedSum,
    build_checked_rewards,
    build_rewards,
    set_reward_step,
    stop_on_reward_error,
)
from diffalign.runtime.checkpoint import (
    check_resume_target,
    latest_checkpoint,
    load_checkpoint,
    new_lineage,
    read_state,
    remove_temporaries,
    save_checkpoint,
    write_state,
)
from diffalign.runtime.console import write
from diffalign.runtime.distributed import (
    CheckpointOptimizer,
    fsdp_plugin_for,
    fsdp_root,
    full_weights,
    is_fsdp,
    switch_fsdp_on,
    wrap_on_cpu,
)
from diffalign.runtime.faults import (
    NonFiniteError,
    NonFiniteGuard,
    StopSignals,
    TrainingInterrupted,
    resume_hint,
)
from diffalign.runtime.storage import write_folder
from diffalign.runtime.trackers import tracker_init_kwargs
from diffalign.world.prompts import load_prompts


def flat_hparams(cfg: DictConfig) -> dict:
    """Scalar leaves of the config, flattened with '/' for the trackers."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}/")
        elif isinstance(node, (int, float, str, bool)):
            out[prefix[:-1]] = node
        elif node is not None:
            out[prefix[:-1]] = str(node)

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def make_accelerator(cfg: DictConfig, gradient_accumulation_steps: int = 1) -> Accelerator:
    """The run's `Accelerator` (``trainer.mixed_precision``, ``trainer.log_with``, ``trainer.cpu``; logs under
    ``<output_dir>/logs``), one LR step per optimizer step on any number of processes; then seeds every RNG with
    ``cfg.seed``. ``trainer.cudnn_attention=false`` turns cuDNN's scaled-dot-product attention off for the process
    (``torch.backends.cuda.enable_cudnn_sdp(False)``)."""
    tr, output_dir = cfg.trainer, Path(cfg.output_dir)
    if not tr.get("cudnn_attention", True):
        torch.backends.cuda.enable_cudnn_sdp(False)
    # an FSDP launch on CPU (accelerate drops FSDP there; diffalign.runtime.distributed)
    fsdp_plugin = fsdp_plugin_for(tr.cpu)
    accelerator = Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=tr.mixed_precision,
        log_with=None if tr.log_with in (None, "none") else tr.log_with,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        cpu=tr.cpu,
        step_scheduler_with_optimizer=False,  # one LR step per optimizer step, whatever the number of processes
        fsdp_plugin=fsdp_plugin,
    )
    switch_fsdp_on(accelerator, fsdp_plugin, accelerator.print)
    set_seed(cfg.seed)
    return accelerator


def start_trackers(accelerator: Accelerator, cfg: DictConfig) -> None:
    """Creates ``output_dir`` and starts the trackers with the run's config (main process): TensorBoard under
    ``<output_dir>/logs/diffalign``, wandb's run folder under ``<output_dir>/logs/wandb`` (`tracker_init_kwargs`)."""
    if accelerator.is_main_process:
        (Path(cfg.output_dir) / "logs").mkdir(parents=True, exist_ok=True)
        # TensorBoard's hparams take scalars only: the flat config whenever it is one of the trackers
        tensorboard = cfg.trainer.log_with in ("tensorboard", "all")
        accelerator.init_trackers("diffalign", config=flat_hparams(cfg) if tensorboard else
                                  OmegaConf.to_container(cfg, resolve=True),
                                  init_kwargs=tracker_init_kwargs(cfg.output_dir))


def build_optimizer(node: DictConfig, params: list) -> torch.optim.Optimizer:
    """The optimizer of ``trainer.optimizer``: ``hydra.utils.instantiate(node, params=params)``, the node's other keys
    as the class's keyword arguments (lists as plain lists). The default is ``torch.optim.AdamW`` (``lr``, ``betas``,
    ``weight_decay``, ``eps``); any class taking the parameters as ``params`` can be named with ``_target_`` (e.g.
    ``bitsandbytes.optim.AdamW8bit``, ``torch.optim.SGD``). `diffalign.train.checks.check_optimizer` has checked the
    node's keys against the class's arguments before any work.

    Args:
        node (`DictConfig`): ``trainer.optimizer``, with ``_target_``.
        params (`list[torch.nn.Parameter]`): the trainable parameters.
    """
    from hydra.utils import instantiate

    return instantiate(node, params=params, _convert_="all")


def build_lr_scheduler(optimizer, warmup_steps: int, max_steps: int, kind: str):
    """``constant_with_warmup`` or ``cosine`` (``trainer.lr_scheduler``) from `diffusers.optimization.get_scheduler`,
    stepped once per optimizer step after the update, as the diffusers training scripts (and Diffusion-DPO's released
    ``train.py``) step it: the factor on the optimizer's ``lr`` for update s (0-based) is s / `warmup_steps` while
    s < `warmup_steps` (so the first update of a warmed-up run has learning rate 0, as in the released code), then 1
    (``constant_with_warmup``) or ½(1 + cos(π · (s − W) / max(1, `max_steps` − W))) (``cosine``, W = `warmup_steps`).

    Raises:
        ValueError: `kind` is not one of `diffalign.train.checks.LR_SCHEDULERS`.
    """
    from diffusers.optimization import get_scheduler

    from diffalign.train.checks import LR_SCHEDULERS

    if kind not in LR_SCHEDULERS:
        raise ValueError(f"trainer.lr_scheduler={kind!r} must be one of {LR_SCHEDULERS}")
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps)


def prepare_training(accelerator: Accelerator, policy, tr: DictConfig, total_updates: int) -> tuple[list, Any, Any]:
    """The optimizer of ``trainer.optimizer`` over the policy's trainable parameters (`build_optimizer`), the LR
    schedule over `total_updates` (``trainer.lr_scheduler``, ``trainer.lr_warmup_steps``), and the denoiser, optimizer
    and schedule prepared by `accelerator` (under DDP/FSDP the policy then forwards through the wrapper).

    Returns:
        (the trainable parameters, the optimizer, the LR scheduler).
    """
    params = policy.trainable_parameters()
    optimizer = build_optimizer(tr.optimizer, params)
    lr_scheduler = build_lr_scheduler(optimizer, tr.lr_warmup_steps, total_updates, tr.lr_scheduler)
    # (FSDP on CPU: wrapped here, without the device_id accelerate would pass; diffalign.runtime.distributed)
    wrapped, optimizer, lr_scheduler = accelerator.prepare(wrap_on_cpu(accelerator, policy.denoiser), optimizer,
                                                           lr_scheduler)
    if wrapped is not policy.denoiser:  # DDP/FSDP: forward through the wrapper, switch adapters on the bare module
        policy.set_forward_module(wrapped)
    return params, optimizer, lr_scheduler


def apply_update(accelerator: Accelerator, guard: NonFiniteGuard, optimizer, lr_scheduler, params,
                 max_grad_norm: float | None, loss_finite: bool) -> None:
    """One optimizer update from the accumulated gradients: skipped when the loss or a gradient is non-finite on any
    process (`NonFiniteGuard`; the step still counts for the LR schedule), clipped to `max_grad_norm` otherwise."""
    if guard.update_ok(accelerator, params, max_grad_norm, loss_finite):
        optimizer.step()
    lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)


class UpdateLosses:
    """The micro-batch losses of one optimizer update, as far as the guard needs them: whether all were finite."""

    def __init__(self):
        self.finite = True

    def add(self, loss: torch.Tensor) -> None:
        """Records one micro-batch's scalar loss (before its backward pass)."""
        self.finite = self.finite and bool(torch.isfinite(loss))


class Updates:
    """The optimizer updates of a run, taken the same way by both loops.

    The reference is stepped here and nowhere else: ``reference.on_step(policy, n)`` runs before every update with
    ``n`` = the number of updates already done (0 before the first; docs/methods/algorithms.md#reference-stepping).
    Every reference strategy is written for that call (`diffalign.reference`): the pool snapshots θ_n when ``n %
    save_every == 0``, so θ_0 is in the pool before the first update, and an EMA reference takes its step once the
    policy has had ``n`` updates. A resumed run at step ``n`` makes the next call with ``n``, so no call is repeated
    or skipped (each strategy also ignores a second call for the same ``n``).

    Args:
        accelerator (`Accelerator`), policy, reference: the run's.
        guard (`NonFiniteGuard`): decides whether an update is applied.
        optimizer, lr_scheduler, params: what `apply_update` steps.
        max_grad_norm (`float`, *optional*): ``trainer.max_grad_norm``.
    """

    def __init__(self, accelerator: Accelerator, policy, reference, guard: NonFiniteGuard, optimizer, lr_scheduler,
                 params, max_grad_norm: float | None):
        self.accelerator, self.policy, self.reference, self.guard = accelerator, policy, reference, guard
        self.optimizer, self.lr_scheduler, self.params = optimizer, lr_scheduler, params
        self.max_grad_norm = max_grad_norm

    @contextlib.contextmanager
    def update(self, done: int) -> Iterator[UpdateLosses]:
        """One optimizer update after `done` updates: steps the reference (``on_step(policy, done)``), then runs the
        body, which computes and backpropagates the update's micro-batches and records each loss with
        ``losses.add(loss)``, then applies the accumulated gradients (`apply_update`: skipped when a loss or gradient
        is non-finite on any process)."""
        self.reference.on_step(self.policy, done)
        losses = UpdateLosses()
        yield losses
        apply_update(self.accelerator, self.guard, self.optimizer, self.lr_scheduler, self.params, self.max_grad_norm,
                     losses.finite)

    def stop_if_exhausted(self, checkpoint: Callable[[], Path], where: str, note: str = "") -> None:
        """After ``trainer.max_consecutive_nonfinite`` skipped updates in a row: `checkpoint()`, then
        `NonFiniteError`.

        Args:
            where (`str`): the run's position, e.g. "step 3" or "epoch 1, step 2".
            note (`str`): said after the checkpoint's folder, e.g. how a resume continues.

        Raises:
            NonFiniteError: naming the count, `where`, the setting, the checkpoint and the fixes.
        """
        if not self.guard.exhausted:
            return
        ckpt = checkpoint()
        how = resume_hint(ckpt.parent) if ckpt is not None else "continue with resume=latest"  # (another process)
        raise NonFiniteError(
            f"{self.guard.consecutive} updates in a row had a non-finite loss or gradient ({where}, "
            f"trainer.max_consecutive_nonfinite={self.guard.max_consecutive}); checkpoint saved to {ckpt}{note}. "
            "Lower trainer.optimizer.lr (or the method's strength, e.g. method.beta), set trainer.max_grad_norm, or "
            f"use trainer.mixed_precision=no, then {how}", checkpoint=ckpt)


class Checkpoints:
    """A run's checkpoints: ``checkpoint-<step>`` folders (`diffalign.runtime.checkpoint.save_checkpoint`) holding the
    LoRA, the optimizer and LR scheduler, every object of `states` as ``<name>.{json,safetensors}`` and the loop's own
    trainer state with the run's lineage (``keep_last`` prunes only this lineage's checkpoints; a resume carries the
    checkpoint's lineage on).

    Args:
        accelerator (`Accelerator`): only its main process writes.
        output_dir (`Path`): the run folder.
        policy: the policy whose LoRA is saved and loaded.
        optimizer, lr_scheduler: saved and loaded with the checkpoint.
        keep_last (`int`): the newest checkpoints kept (-1: all).
        states (`dict[str, Any]`): objects with ``state_dict`` / ``load_state_dict`` by file stem (the reference
            strategy as ``reference_state``, a method's `checkpoint_states`).
    """

    def __init__(self, accelerator: Accelerator, output_dir: Path, policy, optimizer, lr_scheduler, keep_last: int,
                 states: dict[str, Any]):
        self.accelerator, self.output_dir, self.policy = accelerator, output_dir, policy
        self.optimizer, self.lr_scheduler, self.keep_last, self.states = optimizer, lr_scheduler, keep_last, states
        if is_fsdp(accelerator):  # the optimizer state gathered into / re-sharded from the one-process layout
            self.optimizer = CheckpointOptimizer(optimizer, fsdp_root(accelerator))
        self.lineage = new_lineage()  # keep_last prunes only this lineage's checkpoints; a resumed run carries it on

    def _write_dir(self, directory: Path) -> None:
        self.policy.save_lora_weights(directory)
        for name, part in self.states.items():
            write_state(part.state_dict(), directory, name)

    def write(self, step: int, trainer_state: dict) -> Path:
        """Writes ``checkpoint-<step>`` with `trainer_state` as its ``trainer_state.json``. Call it on every process:
        under FSDP the LoRA and the optimizer state are gathered first (collectives, `diffalign.runtime.distributed`),
        in the one-process layout; only the main process writes files."""
        optimizer = self.optimizer
        if is_fsdp(self.accelerator):
            optimizer = _Gathered(self.optimizer.state_dict())
        path = self.output_dir / f"checkpoint-{step}"
        with full_weights(self.policy):
            if self.accelerator.is_main_process:
                path = save_checkpoint(self.output_dir, step, lora_dir_writer=self._write_dir, optimizer=optimizer,
                                       lr_scheduler=self.lr_scheduler, keep_last=self.keep_last,
                                       lineage=self.lineage, state=trainer_state)
        if is_fsdp(self.accelerator):  # every process then sees the folder (a later `exists()` agrees everywhere)
            self.accelerator.wait_for_everyone()
        return path

    def before_stop(self, step: int, trainer_state: Callable[[], dict], collective: bool = False) -> Path | None:
        """The checkpoint of `step`, written now unless it exists; None on the other processes (no barrier).

        `collective`: every process calls it (a stop). Under FSDP a checkpoint needs every process (its weights are
        sharded), so a stop on one process alone (a failing reward) writes none and says so."""
        existing = self.output_dir / f"checkpoint-{step}"
        if is_fsdp(self.accelerator):
            if not collective:
                write("[diffalign] FSDP: no checkpoint written (the weights are sharded and this process stopped "
                      f"alone); output_dir={self.output_dir} resume=latest continues from the last one",
                      self.accelerator)
                return None
            if existing.exists():  # (the same answer on every process: the folder is shared)
                return existing if self.accelerator.is_main_process else None
            path = self.write(step, trainer_state())
            return path if self.accelerator.is_main_process else None
        if not self.accelerator.is_main_process:
            return None
        return existing if existing.exists() else self.write(step, trainer_state())

    def stop(self, step: int, trainer_state: Callable[[], dict]) -> Path:
        """`before_stop` on every process, then a barrier (the other processes wait for the write); the checkpoint's
        folder."""
        self.before_stop(step, trainer_state, collective=True)
        self.accelerator.wait_for_everyone()
        return self.output_dir / f"checkpoint-{step}"

    def resume(self, resume: str | None) -> dict | None:
        """Removes half-written checkpoints of a killed run, then loads `resume` (``"latest"`` or a folder) into the
        optimizer, scheduler, LoRA and `states`; returns its trainer state, or None when there is nothing to resume."""
        log = self.accelerator.print
        if self.accelerator.is_main_process:  # half-written checkpoints of a killed run (never picked by resume)
            remove_temporaries(self.output_dir)
        if resume is None:
            return None
        ckpt = latest_checkpoint(self.output_dir) if resume == "latest" else Path(resume)
        if ckpt is None:
            log(f"[diffalign] resume=latest: no checkpoint in {self.output_dir}, starting from scratch")
            return None
        if resume != "latest":  # later checkpoints here: refused (validation says so first; this for Python callers)
            check_resume_target(self.output_dir, ckpt)
        state = load_checkpoint(ckpt, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler)
        with full_weights(self.policy, writeback=True):  # (under FSDP: loaded in full, re-sharded on exit)
            self.policy.load_lora_weights(ckpt)
        self.lineage = state.get("lineage") or self.lineage
        for name, part in self.states.items():
            part.load_state_dict(read_state(ckpt, name))
        state["checkpoint"] = ckpt
        return state


class _Gathered:
    """An optimizer state already gathered (under FSDP, by every process), for `save_checkpoint`."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def build_reward_sets(cfg: DictConfig) -> tuple[WeightedSum, dict[str, CheckedReward]]:
    """The run's rewards, built the one way (build → guard → combine, `diffalign.rewards.reward_set.build_rewards`).

    Returns:
        (the training set ``reward=[...]`` as a `WeightedSum` of guarded components, the evaluation set
        ``eval_reward=[...]`` as ``{name: CheckedReward}``, used by the final evaluation and the monitors; without
        ``eval_reward`` the training set's own guarded components, not a second copy of the reward models).
    """
    rewards = build_rewards(cfg.reward)
    eval_rewards = build_checked_rewards(cfg.eval_reward) if cfg.get("eval_reward") else rewards.rewards
    return rewards, eval_rewards


def stop_if_requested(stop: StopSignals, accelerator: Accelerator, checkpoint: Callable[[], Path], where: str) -> None:
    """On SIGTERM / SIGINT (on any process): a checkpoint (`checkpoint()`), a message, then `TrainingInterrupted`.

    Args:
        where (`str`): when the run stopped, e.g. "before epoch 3" or "at step 12".

    Raises:
        TrainingInterrupted: with the signal and the checkpoint (the CLI exits with 128 + the signal number).
    """
    if not stop.requested(accelerator):
        return
    ckpt = checkpoint()
    write(f"[diffalign] {stop.name} received: stopped {where}, checkpoint {ckpt}; {stop.hint}", accelerator)
    raise TrainingInterrupted(f"stopped by {stop.name} {where}; checkpoint saved to {ckpt}; {stop.hint}", stop.signum,
                              checkpoint=ckpt)


def save_final_lora(policy, final_dir: Path) -> Path:
    """Writes the run's final LoRA (``final/pytorch_lora_weights.safetensors``) through a temporary folder
    (`diffalign.runtime.storage.write_folder`): a full disk leaves no truncated file, and an earlier ``final/`` (a
    resumed run's) keeps its file.

    Raises:
        DiskFullError: the disk filled up (naming the run folder and about the bytes the adapter takes).
    """
    needed = sum(p.numel() * p.element_size() for p in policy.trainable_parameters())
    return write_folder(final_dir, policy.save_lora_weights, what=f"the final LoRA ({final_dir.name}/)", needed=needed)


def evaluation_size(cfg: DictConfig) -> tuple[int, int]:
    """(prompts, seeds) of the run's final evaluation (``eval.prompts`` after ``eval.prompts_per_tag``, ``eval.seeds``)."""
    ecfg = eval_config_from(cfg.eval)
    return len(select_prompts(load_prompts(ecfg.prompts), ecfg.prompts_per_tag)), len(ecfg.seeds)


def evaluation_hint(cfg: DictConfig) -> str:
    """The line that says what the final evaluation will cost and how to skip or shorten it (printed when an online
    run starts, whose default evaluation can take longer than a short run's training)."""
    prompts, seeds = evaluation_size(cfg)
    return (f"[diffalign] the run ends with an evaluation of the base and the fine-tuned model on {prompts} prompts × "
            f"{seeds} seeds = {2 * prompts * seeds} images at {cfg.eval.sampler.num_inference_steps} sampler steps; for "
            "a smoke run pass eval.enabled=false (or shorten it: eval.prompts_per_tag=1 eval.seeds=[0])")


def final_evaluation(cfg: DictConfig, accelerator: Accelerator, policy, eval_rewards: dict, step: int,
                     checkpoint: Callable[[], Path | None], tracker_step: int | None = None) -> dict:
    """Evaluates the base and the fine-tuned model on ``eval.prompts`` (main process, when ``eval.enabled``) and writes
    the HTML report; a failing reward stops the run after `checkpoint()` (`stop_on_reward_error`). The trackers get
    the evaluation (`log_evaluation`).

    Args:
        eval_rewards (`dict[str, CheckedReward]`): the evaluation rewards (`build_reward_sets`).
        step (`int`): the global step, named in reward errors.
        tracker_step (`int`, *optional*): the trackers' step when it is not `step` (the online loop's epoch).

    Returns:
        ``{"eval", "eval_seconds", "report", "headline"}`` for the run's results (``headline``: `headline_line`, which
        the loops print last), or `{}` when nothing is evaluated here.
    """
    if not (cfg.eval.enabled and accelerator.is_main_process):
        return {}
    from diffalign.evaluation.report import write_report

    output_dir = Path(cfg.output_dir)
    t_eval = time.time()
    policy.denoiser.eval()
    ecfg = eval_config_from(cfg.eval)
    rows = select_prompts(load_prompts(ecfg.prompts), ecfg.prompts_per_tag)
    set_reward_step(eval_rewards, step, reset_calls=True)
    say = lambda message: write(message, accelerator)  # (around the evaluation's progress bar)
    with stop_on_reward_error(checkpoint), bare_forward(policy):
        results = {"eval": evaluate_policy(policy, rows, eval_rewards, ecfg, output_dir / "eval",
                                           {"base": True, "finetuned": False}, log=say,
                                           base_key=base_reuse_key(cfg.model, cfg.get("eval_reward") or cfg.reward))}
    results["eval_seconds"] = time.time() - t_eval
    log_evaluation(accelerator, results["eval"], output_dir / "eval", step if tracker_step is None else tracker_step)
    results["report"] = str(write_report(output_dir / "eval", run_dir=output_dir))
    accelerator.print(f"[diffalign] report: {results['report']}")
    line = headline_line(results["eval"])
    if line is not None:
        results["headline"] = line
    return results


EVAL_VIDEOS = 8
"""Videos per variant that `log_evaluation` logs (the first seed of the first prompts)."""


def log_evaluation(accelerator: Accelerator, metrics: dict, eval_dir: Path, step: int) -> None:
    """Logs an evaluation's results to the run's trackers at `step`: every variant's scalar statistics as
    ``eval/<variant>/<statistic>`` (all trackers), its overview grid as the image ``eval/<variant>/grid``, and for a
    video model the videos of the first seed of its first `EVAL_VIDEOS` prompts as ``eval/<variant>/videos``
    (TensorBoard and wandb, `diffalign.runtime.trackers`).

    Args:
        metrics (`dict`): what `evaluate_policy` returned (``metrics.json``).
        eval_dir (`Path`): the evaluation's folder (the files named in `metrics` and ``samples.jsonl``).
    """
    import json

    from diffalign.runtime.trackers import log_images, log_videos

    if not accelerator.is_main_process or not accelerator.trackers:
        return
    scalars = {f"eval/{label}/{k}": v for label, summary in metrics["variants"].items() for k, v in summary.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    accelerator.log(scalars, step=step)
    grids = {f"eval/{label}/grid": [eval_dir / name] for label, name in metrics.get("overview_grids", {}).items()}
    log_images(accelerator, grids, step)
    samples = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    first_seed = metrics["seeds"][0]
    for label in metrics["labels"]:
        rows = [s for s in samples if s["variant"] == label and s["seed"] == first_seed and s.get("video")]
        rows = sorted(rows, key=lambda s: s["prompt_index"])[:EVAL_VIDEOS]
        if rows:
            log_videos(accelerator, {f"eval/{label}/videos": [eval_dir / s["video"] for s in rows]}, step,
                       captions={f"eval/{label}/videos": [s["prompt"] for s in rows]})
