"""Fault handling shared by the training loops: non-finite updates and stop signals.

- `NonFiniteGuard` decides, once per optimizer update, whether the update may be applied: a non-finite loss on any
  micro-batch or a non-finite gradient norm (after clipping; all-reduced over processes) skips it. Skips are counted
  (``nonfinite_skips``, logged; a warning reported once per logging interval, `diffalign.runtime.console`); after
  ``trainer.max_consecutive_nonfinite`` skips in a row the loop saves a checkpoint and raises `NonFiniteError`.
- `StopSignals` turns SIGTERM / SIGINT into a flag that the loops read between updates (agreed over processes); the
  loop then writes a checkpoint and raises `TrainingInterrupted`, which the CLI turns into exit code 128 + signal
  (143 for SIGTERM, 130 for SIGINT). A second SIGINT interrupts at once (KeyboardInterrupt). The data preparation
  (`diffalign.data.resumable`) checks the flag after every chunk, the evaluation (`stop_received`) before every batch,
  and the loops once more after the report, so a signal at any point stops the run at the next safe point.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import ClassVar

import torch

from diffalign.runtime.console import warn_repeated

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """Too many non-finite updates in a row; `checkpoint` is the folder saved before stopping."""

    def __init__(self, message: str, checkpoint: Path | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint


class RolloutMismatchError(RuntimeError):
    """The log-probs a policy-gradient method recomputes for training differ from the rollout's stored ones before
    the first update of an epoch (the train/rollout consistency alarm,
    `diffalign.objectives.policy_gradient.StoredTransitionMethod`); the message names the likely causes."""


class TrainingInterrupted(RuntimeError):
    """A stop signal ended the run after a checkpoint was saved; `exit_code` is 128 + the signal number."""

    def __init__(self, message: str, signum: int, checkpoint: Path | None = None):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
        self.checkpoint = checkpoint


def any_process(accelerator, flag: bool) -> bool:
    """`flag` OR-ed over all processes (a no-op on one process), so every process takes the same branch."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum").item() > 0)


class NonFiniteGuard:
    """Counts skipped updates and says when to stop.

    Args:
        max_consecutive (`int`): skips in a row after which `update_ok` raises `NonFiniteError` (≥ 1).
    """

    def __init__(self, max_consecutive: int):
        if max_consecutive < 1:
            raise ValueError(f"trainer.max_consecutive_nonfinite must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.skips = 0
        self.consecutive = 0

    def update_ok(self, accelerator, params, max_grad_norm: float | None, loss_finite: bool) -> bool:
        """Clips the gradients (when `max_grad_norm` is set), then returns whether the update may be applied: every
        micro-batch loss of this update finite (`loss_finite`, this process's) and the gradient norm finite, on every
        process. On a skip the caller zeroes the gradients and does not call ``optimizer.step()``.

        Under fp16 mixed precision a non-finite gradient with finite losses is a loss-scale overflow: it is left to
        the GradScaler (which skips the step and lowers the scale), so it returns True and is not counted here.
        """
        from diffalign.runtime.distributed import clip_grad_norm  # (under FSDP: the norm over all shards)

        norm = clip_grad_norm(accelerator, params, max_grad_norm if max_grad_norm is not None else float("inf"))
        grads_finite = norm is None or bool(torch.isfinite(torch.as_tensor(norm)).all())
        if accelerator.scaler is not None and loss_finite:
            grads_finite = True
        bad = any_process(accelerator, not (loss_finite and grads_finite))
        warn_repeated(logger, "nonfinite_skips", "{count} of {of} optimizer updates skipped: a non-finite loss or "
                      f"gradient (the step still counts); {self.max_consecutive} in a row stop the run "
                      "(trainer.max_consecutive_nonfinite)", count=int(bad), of=1, shared=True)
        if bad:
            self.skips += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        return not bad

    @property
    def exhausted(self) -> bool:
        return self.consecutive >= self.max_consecutive

    def state_dict(self) -> dict:
        return {"skips": self.skips, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skips, self.consecutive = int(state["skips"]), int(state["consecutive"])


def resume_hint(output_dir: str | Path) -> str:
    """How a stopped training run continues: ``continue with output_dir=<folder> resume=latest``. The folder is named
    because ``resume=latest`` alone looks in the default ``output_dir``, a new ``runs/train-<time>`` folder (and is
    refused there). A folder with a space, quote, comma or bracket is written ``"output_dir='<folder>'"``: the double
    quotes for the shell, the single ones for Hydra's override parser."""
    folder = str(output_dir)
    if any(c in folder for c in " \t'\",=[]{}()"):
        return f"continue with \"output_dir='{folder.replace(chr(39), chr(92) + chr(39))}'\" resume=latest"
    return f"continue with output_dir={folder} resume=latest"


class StopSignals:
    """A context manager that records SIGTERM / SIGINT instead of dying, so the loop can checkpoint and exit.

    Handlers are installed only in the main thread (elsewhere this does nothing) and restored on exit. After the first
    SIGINT the default SIGINT handler is back, so a second Ctrl-C interrupts at once. Code that runs inside (the
    evaluation, `diffalign.evaluation.evaluate.evaluate_policy`) asks `stop_received` at its own safe points; a signal
    received by a nested instance is handed to the enclosing one on exit.

    Args:
        hint (`str`, defaults to "continue with resume=latest"): how to continue, ending the stop messages.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    _active: ClassVar[list[StopSignals]] = []  # entered instances, innermost last

    def __init__(self, hint: str = "continue with resume=latest"):
        self.signum: int | None = None
        self.hint = hint
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if signum == signal.SIGINT:
            previous = self._previous.get(signal.SIGINT)  # SIG_IGN/SIG_DFL (e.g. under nohup) are not callables
            signal.signal(signal.SIGINT, previous if callable(previous) else signal.default_int_handler)

    def __enter__(self) -> StopSignals:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            StopSignals._active.append(self)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self in StopSignals._active:
            StopSignals._active.remove(self)
            if self.signum is not None and StopSignals._active and StopSignals._active[-1].signum is None:
                StopSignals._active[-1].signum = self.signum
        return False

    def interrupted(self, where: str, hint: str | None = None) -> TrainingInterrupted:
        """The `TrainingInterrupted` to raise at a safe point: ``stopped by SIGINT <where>; <hint>``."""
        return TrainingInterrupted(f"stopped by {self.name} {where}; {hint or self.hint}", self.signum or signal.SIGTERM)

    def raise_if_received(self, where: str, hint: str | None = None) -> None:
        """Raises `interrupted(where, hint)` when this process received a signal (a local check, no collective)."""
        if self.signum is not None:
            raise self.interrupted(where, hint)

    def requested(self, accelerator) -> bool:
        """Whether any process received a stop signal (every process must call this at the same point)."""
        if any_process(accelerator, self.signum is not None):
            self.signum = self.signum or signal.SIGTERM  # (another process got it)
            return True
        return False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "signal"


def stop_received() -> StopSignals | None:
    """The innermost active `StopSignals` of this process when it has received a signal, else None."""
    active = StopSignals._active
    return active[-1] if active and active[-1].signum is not None else None
