"""Asynchronous scoring: rewards of one batch computed while the next batch is sampled
(docs/guides/rewards.md#rewards-served-over-http).

A reward may offer ``submit(images, prompts, metadata) -> concurrent.futures.Future[RewardOutput]`` besides its call
(`diffalign.rewards.http.HttpReward` does: the batch goes to a reward server in a background thread). The loops use
that through two helpers, and treat every other reward as before:

- `submit` starts scoring one batch: the reward's own ``submit`` when it has one, else the reward is called now and
  the returned future is already done (its errors raise at once, as a call's would);
- `ChunkScorer` scores the rollout chunks of an online epoch as they are made
  (`diffalign.samplers.groups.group_rollout` calls its `ChunkScorer.add` after every chunk) and returns the epoch's `WeightedSum` output, the same as one call on
  the whole epoch: asynchronous components are concatenated from their chunks, synchronous ones are called on the
  whole epoch at the end as before (so a run without such a reward is unchanged), and the weights and z-scores apply
  to the whole epoch.

Every future's result goes through the same checks as a call (`diffalign.rewards.guard`), so a reward that fails in a
background thread still stops the run with a checkpoint, naming the reward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from diffalign.rewards.combine import WeightedSum
from diffalign.types import RewardOutput


def completed(value: Any) -> Future:
    """A future that is already done with result `value`."""
    future: Future = Future()
    future.set_result(value)
    return future


def has_submit(reward: Any) -> bool:
    """Whether `reward` scores asynchronously (has a callable ``submit``)."""
    return callable(getattr(reward, "submit", None))


def submit(reward: Any, images: torch.Tensor, prompts: list[str],
           metadata: list[dict[str, Any]] | None = None) -> Future:
    """Starts scoring a batch: ``reward.submit(...)`` when the reward has an asynchronous API, else calls the reward
    now and returns a done future.

    Args:
        reward: any reward (`diffalign.rewards.base.Reward`), or a `CheckedReward` around one.
        images (`torch.Tensor`): `(B, 3, H, W)` images or `(B, F, 3, H, W)` videos, float in [0, 1]; not modified
            afterwards by the caller (an asynchronous reward copies what it sends before returning).
        prompts (`list[str]`): the `B` prompts.
        metadata (`list[dict]`, *optional*): `B` per-sample records.

    Returns:
        `concurrent.futures.Future` whose result is the `RewardOutput` (or whose exception is the reward's error).

    Raises:
        Exception: whatever a synchronous reward raises (at once).
    """
    if has_submit(reward):
        return reward.submit(images, prompts, metadata)
    return completed(reward(images, prompts, metadata))


def then(future: Future, fn: Callable[[Future], Any]) -> Future:
    """A future for ``fn(future)``, run when `future` is done (in the thread that completes it); an exception of `fn`
    becomes the new future's exception. Cancelling the new future cancels `future` if it has not started."""
    out: Future = Future()

    def finish(done: Future) -> None:
        if not out.set_running_or_notify_cancel():
            return
        try:
            out.set_result(fn(done))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the future
            out.set_exception(err)

    out.add_done_callback(lambda f: future.cancel() if f.cancelled() else None)
    future.add_done_callback(finish)
    return out


def gather(futures: list[Future], combine: Callable[[list[Any]], Any]) -> Future:
    """A future for ``combine([f.result() for f in futures])``; it fails with the first failed future's error (in
    list order) once all are done. Cancelling it cancels the parts that have not started."""
    out: Future = Future()
    if not futures:
        out.set_result(combine([]))
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def finish(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        if not out.set_running_or_notify_cancel():
            return
        try:
            out.set_result(combine([f.result() for f in futures]))
        except BaseException as err:  # noqa: BLE001 - a part's error (or CancelledError) is handed on
            out.set_exception(err)

    out.add_done_callback(lambda f: [part.cancel() for part in futures] if f.cancelled() else None)
    for future in futures:
        future.add_done_callback(finish)
    return out


def concat_outputs(outputs: list[RewardOutput]) -> RewardOutput:
    """One `RewardOutput` of the batches `outputs` in order: ``scores`` (and ``maps``, when every part has them)
    concatenated along the batch; an ``info`` entry is kept when every part has it as a tensor (concatenated) or a
    list (joined), since info entries are per sample; others are dropped.

    Raises:
        ValueError: for an empty list.
    """
    if not outputs:
        raise ValueError("no reward outputs to concatenate")
    if len(outputs) == 1:
        return outputs[0]
    scores = torch.cat([o.scores.detach().float().cpu() for o in outputs])
    maps = None
    if all(o.maps is not None for o in outputs):
        maps = torch.cat([o.maps.detach().cpu() for o in outputs])
    info = {}
    for key in outputs[0].info:
        values = [o.info.get(key) for o in outputs]
        if all(isinstance(v, torch.Tensor) and v.ndim >= 1 for v in values):
            info[key] = torch.cat([v.detach().cpu() for v in values])
        elif all(isinstance(v, list) for v in values):
            info[key] = [item for v in values for item in v]
    return RewardOutput(scores=scores, info=info, maps=maps)


class Resolved:
    """A reward whose call returns a future's result (or raises its error): lets a `WeightedSum` or
    `diffalign.rewards.guard.score_or_raise` check an output that was computed elsewhere."""

    def __init__(self, future: Future, differentiable: bool = False):
        self.future, self.differentiable = future, differentiable

    def __call__(self, images: Any, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        return self.future.result()


def _unguarded(reward: Any) -> Any:
    """The reward a `diffalign.rewards.guard.CheckedReward` guards (any other reward: itself)."""
    return getattr(reward, "reward", reward)


class ChunkScorer:
    """Scores an online epoch's rollouts chunk by chunk as they are made, so that a reward server scores chunk k while
    the policy samples chunk k + 1; the result equals one `WeightedSum` call on the whole epoch.

        scorer = ChunkScorer(rewards, metadata)
        traj, group_ids = group_rollout(..., on_chunk=scorer.add)
        scored = scorer.result(traj.images, traj.prompts)   # raises RewardError like rewards(...) would

    Args:
        rewards (`WeightedSum`): the run's rewards (guarded components, `diffalign.rewards.guard.CheckedReward`);
            components whose reward has a ``submit`` (`diffalign.rewards.http`) are submitted per chunk and checked
            once on the whole epoch (rows and the step the loop set named as for a call), the others are called once
            on the whole epoch by `result`.
        metadata (`list[dict]`, *optional*): the epoch's `N` per-sample records (rows of the rollout order).

    Once a chunk's request has failed (e.g. the server is down), later chunks are not sent; `result` then raises.
    """

    def __init__(self, rewards: WeightedSum, metadata: list[dict[str, Any]] | None = None):
        self.rewards, self.metadata = rewards, metadata
        self.pending: dict[str, list[Future]] = {name: [] for name, reward in rewards.rewards.items()
                                                 if has_submit(_unguarded(reward))}

    def add(self, part: Any, start: int, stop: int) -> None:
        """Submits rows ``start:stop`` of the epoch (``part.images`` `(n, 3, H, W)` or `(n, F, 3, H, W)` in [0, 1],
        ``part.prompts``) to every asynchronous component; the signature of `group_rollout`'s ``on_chunk``."""
        for name, futures in self.pending.items():
            if any(f.done() and not f.cancelled() and f.exception() is not None for f in futures):
                continue  # a request failed: `result` reports it; sending more is pointless
            metadata = None if self.metadata is None else self.metadata[start:stop]
            try:
                future = _unguarded(self.rewards.rewards[name]).submit(part.images, list(part.prompts), metadata)
            except Exception as err:  # noqa: BLE001 - raised by `result`, through the WeightedSum's checks
                future = Future()
                future.set_exception(err)
            futures.append(future)

    def cancel(self) -> None:
        """Cancels every request not yet started."""
        for futures in self.pending.values():
            for future in futures:
                future.cancel()

    def result(self, images: torch.Tensor, prompts: list[str]) -> RewardOutput:
        """The epoch's `WeightedSum` output (see `WeightedSum.__call__`), waiting for the asynchronous components.

        Args:
            images (`torch.Tensor`): the epoch's `(N, 3, H, W)` images (or videos), in the order of the chunks.
            prompts (`list[str]`): the `N` prompts.

        Raises:
            RewardError: as a `WeightedSum` call: naming the component that failed (for a server, its error names the
                URL), returned scores of another shape (e.g. chunks missing after a failure) or non-finite scores.
        """
        if not self.pending:
            return self.rewards(images, prompts, self.metadata)
        from diffalign.rewards.guard import CheckedReward  # (the guard imports this module)

        try:
            components = {}
            for name, reward in self.rewards.rewards.items():
                if name not in self.pending:
                    components[name] = reward
                    continue
                checked = CheckedReward(name, Resolved(gather(self.pending[name], concat_outputs),
                                                       reward.differentiable))
                checked.step = getattr(reward, "step", None)  # the step the loop set (named in errors)
                components[name] = checked
            return WeightedSum(components, self.rewards.weights, self.rewards.normalize)(images, prompts,
                                                                                         self.metadata)
        finally:
            self.cancel()
