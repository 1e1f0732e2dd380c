"""The console of the training loops and the evaluation: warnings that can fire at every step are counted and reported
once per logging interval, and every log line is written around the progress bars, never through them.

A call site that may warn at every step or batch (Diffusion-DPO / SePPO saturation, an update skipped for a non-finite
loss, a prompt longer than a text encoder's context, a retried reward-server request, a log-prob mismatch in "warn"
mode) calls `warn_repeated` instead of ``logger.warning``:

- inside `console_summary()` (both training loops, the final evaluation, ``diffalign-eval``) the call is counted per
  kind; `WarningCounts.flush`, called by the loop once per interval (``trainer.warnings_every`` optimizer steps, one
  epoch of the online loop, one variant of an evaluation), logs one line per kind seen since the last flush, e.g.
  ``steps 11-20: 1 of 10 optimizer updates skipped: a non-finite loss or (...)``, and returns the interval's
  counts for the trackers (``warnings/<kind>``); the run's totals go to ``results.json`` and the progress bar's
  postfix. A kind counted with ``per_run=True`` (an expected event whose count is the news: Diffusion-DPO / SePPO
  saturation) is said once, at the loop's last flush, with the run's counts: ``steps 1-100: Diffusion-DPO: 35 of
  3200 pairs had z > 30 (...)``;
- outside it (a library call, e.g. ``diffusion_dpo_loss`` in a notebook) it logs the warning at once, as
  ``logger.warning`` would.

`console_summary` also wraps its body in `tqdm.contrib.logging.logging_redirect_tqdm`, so every log record of the run
(the summary lines, one-off warnings, "saved checkpoint" messages) is written by ``tqdm.write`` around the open bars;
`write` does the same for the loops' own ``[diffalign] ...`` lines. docs/guides/reliability.md#console-output.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

__all__ = ["WarningCounts", "active_counts", "console_summary", "literal", "quiet_on_broken_pipe", "warn_repeated",
           "write"]


@dataclass
class _Kind:
    """The counts of one kind of warning over an interval (or a run): the sum of `count` and `of` over its calls,
    the calls, and the calls that counted something."""

    message: str
    logger: str
    count: int = 0
    of: int = 0
    calls: int = 0
    events: int = 0
    per_run: bool = False

    def add(self, other: _Kind) -> None:
        self.count += other.count
        self.of += other.of
        self.calls += other.calls
        self.events += other.events
        self.message, self.logger, self.per_run = other.message, other.logger, other.per_run

    def text(self) -> str:
        return self.message.format(count=self.count, of=self.of)


class WarningCounts:
    """Counts repeating warnings by kind between two `flush` calls; thread-safe (a reward server's retries are counted
    from the scoring thread).

    Attributes:
        totals (`dict[str, dict]`): per kind, what every flush reported so far: ``{"count", "of", "events", "calls",
            "message"}`` (``message`` formatted with the totals); since this process started the run (a resumed run
            counts from its resume).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._interval: dict[str, _Kind] = {}
        self._totals: dict[str, _Kind] = {}
        self._held: dict[str, _Kind] = {}  # per-run kinds flushed but not reported yet

    def add(self, key: str, message: str, count: int, of: int | None, logger: logging.Logger,
            per_run: bool = False) -> None:
        """Counts one call of the kind `key` (see `warn_repeated`)."""
        with self._lock:
            kind = self._interval.setdefault(key, _Kind(message, logger.name, per_run=per_run))
            kind.add(_Kind(message, logger.name, count, of or 0, 1, int(count > 0), per_run))

    def pending(self) -> dict[str, int]:
        """This process's counts since the last flush, by kind (kinds counted but with count 0 included)."""
        with self._lock:
            return {key: kind.count for key, kind in self._interval.items()}

    def flush(self, where: str, accelerator=None, run_where: str | None = None) -> dict[str, int]:
        """Reports the kinds counted since the last flush whose count is > 0, one log line each (``<where>: <the
        kind's message with the interval's counts>``, at WARNING on the call site's logger), adds them to `totals`,
        and starts a new interval. A per-run kind (``warn_repeated(..., per_run=True)``) is held instead, and
        reported once, with its counts summed over the intervals held, by the flush given `run_where` (or at the end
        of the `console_summary`).

        Args:
            where (`str`): the interval, e.g. ``"steps 11-20"``, ``"epoch 3"``, ``"eval base"``.
            accelerator (`accelerate.Accelerator`, *optional*): with several processes the counts of every process
                are summed first (a collective: every process must call `flush` at the same point) and only the main
                process logs. Without it the counts are this process's.
            run_where (`str`, *optional*): given by the run's last flush, the span the held per-run kinds cover, e.g.
                ``"steps 1-100"``: they are reported now, as ``<run_where>: <message with their sums>``.

        Returns:
            ``{"warnings/<kind>": count}`` of the interval, for the kinds with count > 0 (summed over processes).
        """
        with self._lock:
            interval, self._interval = self._interval, {}
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            merged: dict[str, _Kind] = {}
            for part in gather_object([interval]):
                for key, kind in part.items():
                    merged.setdefault(key, _Kind(kind.message, kind.logger)).add(kind)
            interval = merged
            speak = accelerator.is_main_process
        else:
            speak = True
        out, say = {}, []
        with self._lock:
            for key, kind in interval.items():
                self._totals.setdefault(key, _Kind(kind.message, kind.logger)).add(kind)
                if kind.per_run:
                    self._held.setdefault(key, _Kind(kind.message, kind.logger)).add(kind)
            for key, kind in sorted(interval.items()):
                if kind.count > 0:
                    out[f"warnings/{key}"] = kind.count
                    if not kind.per_run:
                        say.append((where, kind))
            if run_where is not None:
                held, self._held = self._held, {}
                say += [(run_where, kind) for _, kind in sorted(held.items()) if kind.count > 0]
        if speak:
            for span, kind in say:
                logging.getLogger(kind.logger).warning("%s: %s", span, kind.text())
        return out

    @property
    def totals(self) -> dict[str, dict]:
        with self._lock:
            return {key: {"count": k.count, "of": k.of, "events": k.events, "calls": k.calls, "message": k.text()}
                    for key, k in sorted(self._totals.items()) if k.count > 0}

    def postfix(self) -> dict[str, int]:
        """The run's totals so far (flushed intervals) of the kinds that occurred, ``{kind: count}``, for a progress
        bar's ``set_postfix``."""
        return {key: value["count"] for key, value in self.totals.items()}


_stack: list[WarningCounts] = []
_stack_lock = threading.Lock()


def active_counts() -> WarningCounts | None:
    """The innermost `WarningCounts` of an open `console_summary` (any thread of the process), else None."""
    with _stack_lock:
        return _stack[-1] if _stack else None


def literal(text: str) -> str:
    """`text` with its braces doubled, for the part of a `warn_repeated` message that is not a placeholder (a prompt,
    a URL, an exception's text)."""
    return str(text).replace("{", "{{").replace("}", "}}")


def _first_process() -> bool:
    """Whether this is process 0 of a torch.distributed group (True without one)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def warn_repeated(logger: logging.Logger, key: str, message: str, count: int = 1, of: int | None = None,
                  shared: bool = False, once: str | None = None, per_run: bool = False) -> None:
    """A warning that may repeat at every step: counted under `key` inside `console_summary`, else logged at once.

    Call it also when nothing went wrong (``count=0``) so that the summary's ``of`` covers every call of the interval
    ("5 of 320 pairs").

    Args:
        logger (`logging.Logger`): the call site's module logger (the summary line is logged there).
        key (`str`): the kind, short and stable: ``"saturated"``, ``"nonfinite_skips"``, ... (shown in the progress
            bar's postfix and logged as ``warnings/<key>``).
        message (`str`): the warning, with ``{count}`` and ``{of}`` where the counts go (filled with this call's
            values when logged at once, with the interval's sums in a summary); other braces doubled.
        count (`int`): how many things went wrong in this call (0: none; nothing is logged).
        of (`int`, *optional*): out of how many.
        shared (`bool`): the event is one that every process sees alike (e.g. a skipped update, agreed over the
            processes): only process 0 counts or logs it, so the summed summary does not multiply it.
        once (`str`, *optional*): the text logged at once outside a summary (plain text, no placeholders); default:
            `message` with this call's counts.
        per_run (`bool`): inside a summary, report the kind once per run (its sums over the run, at the loop's last
            flush, `WarningCounts.flush`'s ``run_where``) rather than once per interval: for an expected event whose
            count, not its timing, is the news (Diffusion-DPO / SePPO saturation).
    """
    if shared and not _first_process():
        return
    counts = active_counts()
    if counts is not None:
        counts.add(key, message, int(count), of, logger, per_run)
    elif count > 0:
        logger.warning(once if once is not None else message.format(count=count, of=of))


def write(message: str, accelerator=None) -> None:
    """Prints `message` as one line around any open progress bar (``tqdm.write``; standard output), on the main
    process only when `accelerator` is given (as ``accelerator.print``)."""
    if accelerator is None or accelerator.is_local_main_process:
        tqdm.write(message, file=sys.stdout)


@contextlib.contextmanager
def console_summary() -> Iterator[WarningCounts]:
    """Counts `warn_repeated` calls of this process (every thread) until exit, with every log record written around
    the progress bars (`logging_redirect_tqdm` on the root logger). Re-entrant: inside another one it yields the
    outer counts (an evaluation inside a training run reports into the run's totals). On exit, what was not flushed
    yet is reported (``"at the end"``, this process's counts).

    Yields:
        `WarningCounts`: the counts to `flush` once per interval.
    """
    outer = active_counts()
    if outer is not None:
        yield outer
        return
    counts = WarningCounts()
    with _stack_lock:
        _stack.append(counts)
    try:
        with logging_redirect_tqdm():
            try:
                yield counts
            finally:
                counts.flush("at the end", run_where="at the end")
    finally:
        with _stack_lock:
            _stack.remove(counts)


def quiet_on_broken_pipe(entry_point: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a command's entry point so that a reader closing its stdout early (``diffalign-train --help | head -3``)
    ends the command quietly, as ``head`` expects of any Unix tool, instead of with a `BrokenPipeError` traceback
    (and a second "Exception ignored ... BrokenPipeError" when Python flushes stdout at exit).

    The recipe of the Python documentation (library/signal.html, "Note on SIGPIPE"): stdout is pointed at
    ``/dev/null`` so that the final flush succeeds, and the process exits with status 141 (128 + SIGPIPE, the status
    of a tool killed by SIGPIPE, which shells report for the writer of a broken pipe). SIGPIPE is not reset to its
    default action, so a training run whose log pipe breaks still stops through Python (checkpoint logic intact).

    Returns:
        The wrapped entry point (same arguments and return value).
    """

    @functools.wraps(entry_point)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return entry_point(*args, **kwargs)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            with contextlib.suppress(OSError, ValueError):
                os.dup2(devnull, sys.stdout.fileno())  # the unwritten rest of stdout's buffer goes nowhere
            try:
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr was the closed pipe (`2>&1 | head`)
                with contextlib.suppress(OSError, ValueError):
                    os.dup2(devnull, sys.stderr.fileno())
            sys.exit(128 + 13)

    return wrapped
