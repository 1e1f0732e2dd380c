"""A run's reward set, the one path every reward takes: build → guard → combine (and, for rewards scored in the
background, asynchronous scoring). Nothing is silently replaced by zero.

- Build: `build_reward` instantiates a registered reward by name (its config dataclass merged with the given
  settings); `build_rewards` builds the selected rewards of ``cfg.reward``, guards each and combines them.
- Guard: `score_or_raise` calls rewards and checks their output; a reward that raises, returns scores that are not
  `(B,)` or returns NaN/inf raises `RewardError` naming the reward, the step, the batch and the prompt(s).
  `CheckedReward` wraps a reward so that every call goes through `score_or_raise` (for code that calls rewards itself,
  such as on-policy data preparation and evaluation); it counts its calls as the batch index. Its ``submit`` does the
  same for a reward scored in the background. `stop_on_reward_error` is the loops' context manager: on a `RewardError`
  it saves a checkpoint and re-raises with the checkpoint's folder in the message; the CLI prints that message once,
  as its exit line.
- Combine: `WeightedSum`, the weighted sum of the multi-select ``reward=[a,b]`` (``reward.<name>.weight`` and
  ``reward.<name>.normalize``), and `reward_metrics` for the trackers.
- Asynchronous scoring (docs/guides/rewards.md#rewards-served-over-http): a reward may offer ``submit(images, prompts,
metadata) ->
  concurrent.futures.Future[RewardOutput]`` besides its call (`diffalign.rewards.http.HttpReward` does: the batch goes
  to a reward server in a background thread). `submit` starts scoring one batch (the reward's own ``submit``, else
  the reward is called now and the future is already done); `ChunkScorer` scores the rollout chunks of an online epoch
  as they are made (`diffalign.samplers.groups.group_rollout` calls its `ChunkScorer.add` after every chunk) and
  returns the epoch's `WeightedSum` output, the same as one call on the whole epoch. Every future's result goes
  through the same checks as a call, so a reward that fails in a background thread still stops the run with a
  checkpoint, naming the reward.

Usage in a loop (``diffalign/train/preference.py``)::

    rewards = checked_rewards(build_selected_rewards(cfg.reward))
    with stop_on_reward_error(lambda: write_checkpoint(global_step)):
        for step in ...:
            set_reward_step(rewards, global_step)
            outputs = score_or_raise(rewards, images, prompts, metadata, step=global_step, batch_index=i)
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from diffalign.config.registry import COMBINE_FIELDS, reward_config
from diffalign.rewards.base import Reward, RewardError
from diffalign.rewards.python_function import PREFIX, PythonFunctionConfig, python_config
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)


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
    `diffalign.rewards.reward_set.score_or_raise` check an output that was computed elsewhere."""

    def __init__(self, future: Future, differentiable: bool = False):
        self.future, self.differentiable = future, differentiable

    def __call__(self, images: Any, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        return self.future.result()


def _unguarded(reward: Any) -> Any:
    """The reward a `diffalign.rewards.reward_set.CheckedReward` guards (any other reward: itself)."""
    return getattr(reward, "reward", reward)


def score_or_raise(
    rewards: Mapping[str, Reward],
    images: Any,
    prompts: list[str],
    metadata: list[dict[str, Any]] | None = None,
    *,
    step: int | None = None,
    batch_index: int | None = None,
) -> dict[str, RewardOutput]:
    """Scores a batch with every reward and checks each output.

    Args:
        rewards (`Mapping[str, Reward]`): rewards by name (a single reward: ``{"name": reward}``; a `WeightedSum`
            works too, and a failing component keeps its own name).
        images: `(B, C, H, W)` images or `(B, F, C, H, W)` videos (or what the rewards accept).
        prompts (`list[str]`): the `B` prompts.
        metadata (`list[dict]`, *optional*): `B` per-sample records.
        step (`int`, *optional*): global step, for the error message.
        batch_index (`int`, *optional*): index of this batch within its stage, for the error message.

    Returns:
        `dict[str, RewardOutput]`: each reward's output, ``scores`` as float32 `(B,)`.

    Raises:
        RewardError: a reward raised (its prompts are the batch's), returned scores not of shape `(B,)`, or returned
            NaN/inf (its prompts are those of the non-finite rows). The original exception is chained.
    """
    batch_size = len(prompts)
    outputs = {}
    for name, reward in rewards.items():
        try:
            out = reward(images, prompts, metadata)
        except RewardError as err:  # e.g. a WeightedSum component: keep its name (and where, unless given here)
            raise RewardError(err.reward_name, err.detail, step=err.step if step is None else step,
                              batch_index=err.batch_index if batch_index is None else batch_index,
                              prompts=err.prompts or list(prompts)) from err
        except Exception as err:
            logger.exception("reward '%s' raised at step %s, batch %s", name, step, batch_index)
            raise RewardError(name, f"raised {type(err).__name__}: {err}", step=step, batch_index=batch_index,
                              prompts=list(prompts)) from err
        scores = out.scores
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (batch_size,):
            shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise RewardError(name, f"returned scores of shape {shape}, expected ({batch_size},)", step=step,
                              batch_index=batch_index)
        bad = (~torch.isfinite(scores.detach())).nonzero().flatten().tolist()
        if bad:
            logger.error("reward '%s' returned non-finite scores at rows %s (step %s, batch %s)", name, bad, step,
                         batch_index)
            raise RewardError(name, f"returned non-finite scores {scores.detach()[bad].tolist()} at batch rows {bad}",
                              step=step, batch_index=batch_index, prompts=[prompts[i] for i in bad])
        outputs[name] = RewardOutput(scores=scores.float(), info=out.info, maps=out.maps)
    return outputs


class CheckedReward:
    """A reward whose every call goes through `score_or_raise`.

    Args:
        name (`str`): the reward's config key, named in errors.
        reward (`Reward`): the wrapped reward.

    Attributes:
        step (`int` or `None`): the global step named in errors; the loop sets it (`set_reward_step`).
        calls (`int`): calls so far; the batch index named in errors.
        differentiable (`bool`), name (`str`): those of the wrapped reward / its key.
    """

    def __init__(self, name: str, reward: Reward):
        self.name, self.reward = name, reward
        self.differentiable = getattr(reward, "differentiable", False)  # (a plain callable: not differentiable)
        self.step: int | None = None
        self.calls = 0

    def __repr__(self) -> str:
        return f"CheckedReward({self.name!r}, {self.reward!r})"

    def __getattr__(self, attribute: str) -> Any:
        """Other attributes are the wrapped reward's (e.g. ``check_prompts``, a reward's own settings)."""
        if attribute == "reward":  # (not set yet, e.g. while unpickling)
            raise AttributeError(attribute)
        return getattr(self.reward, attribute)

    def __call__(self, images: Any, prompts: list[str], metadata: list[dict[str, Any]] | None = None) -> RewardOutput:
        batch_index, self.calls = self.calls, self.calls + 1
        return score_or_raise({self.name: self.reward}, images, prompts, metadata, step=self.step,
                              batch_index=batch_index)[self.name]

    def submit(self, images: Any, prompts: list[str], metadata: list[dict[str, Any]] | None = None) -> Future:
        """Starts scoring a batch (`diffalign.rewards.reward_set.submit`): with the wrapped reward's own ``submit``
        when it has one, its result checked by `score_or_raise` when it arrives (the future then fails with the
        `RewardError`); a synchronous reward is called now, as by a call (its `RewardError` raises here)."""
        if not has_submit(self.reward):
            return completed(self(images, prompts, metadata))
        batch_index, self.calls = self.calls, self.calls + 1
        step, prompts = self.step, list(prompts)
        try:
            pending = self.reward.submit(images, prompts, metadata)
        except Exception as err:  # noqa: BLE001 - reported through score_or_raise below, like a call's error
            pending = Future()
            pending.set_exception(err)
        return then(pending, lambda done: score_or_raise({self.name: Resolved(done)}, images, prompts, metadata,
                                                         step=step, batch_index=batch_index)[self.name])


def checked_rewards(rewards: Mapping[str, Reward]) -> dict[str, CheckedReward]:
    """``{name: CheckedReward(name, reward)}`` for every reward (a reward already guarded is kept as it is)."""
    return {name: reward if isinstance(reward, CheckedReward) else CheckedReward(name, reward)
            for name, reward in rewards.items()}


def set_reward_step(rewards, step: int, reset_calls: bool = False) -> None:
    """Sets the step named in errors on every `CheckedReward` of `rewards` (a ``{name: CheckedReward}`` mapping, or a
    `diffalign.rewards.reward_set.WeightedSum`: its components), and restarts their batch count if `reset_calls`."""
    for reward in getattr(rewards, "rewards", rewards).values():
        reward.step = step
        if reset_calls:
            reward.calls = 0


@contextlib.contextmanager
def stop_on_reward_error(save_checkpoint: Callable[[], Path | None]) -> Iterator[None]:
    """Saves a checkpoint and re-raises when the body raises `RewardError`. It prints nothing: the raised error's
    message is the one report of the failure (``diffalign-train`` exits with it; a library caller sees it raised).

    Args:
        save_checkpoint (`Callable[[], Path | None]`): writes a checkpoint of the current state and returns its folder
            (or `None` where this process does not write checkpoints). Called only on a `RewardError`.

    Raises:
        RewardError: the reward's error with the saved folder as ``checkpoint`` and in the message ("— checkpoint
            saved to <folder>; fix or deselect the reward, then continue with output_dir=<its parent> resume=latest");
            the message names the reward, the step, the batch and the prompt(s) (the original error chained; re-raised
            as it is where this process wrote no checkpoint). If saving itself fails, that error is raised from the
            reward's.
    """
    try:
        yield
    except RewardError as err:
        try:
            err.checkpoint = save_checkpoint()
        except Exception as save_err:  # noqa: BLE001 (any failure to save is reported with the reward's error)
            raise RuntimeError(f"{err}; saving a checkpoint before stopping also failed: {save_err}") from err
        if err.checkpoint is None:
            raise
        from diffalign.runtime.faults import resume_hint

        stop = RewardError(err.reward_name, f"{err.detail} — checkpoint saved to {err.checkpoint}; fix or deselect "
                           f"the reward, then {resume_hint(Path(err.checkpoint).parent)}", step=err.step,
                           batch_index=err.batch_index, prompts=err.prompts)
        stop.checkpoint = err.checkpoint
        raise stop from err


NORMALIZE = ("none", "zscore")
ZSCORE_EPS = 1e-6


def zscore(scores: torch.Tensor, eps: float = ZSCORE_EPS) -> torch.Tensor:
    r"""Batch z-score $(s - \bar s) / (\sigma + \epsilon)$ with the population std $\sigma$ of the batch.

    A batch of one, or a batch whose scores are all equal, gives zeros (nothing to rank). Note that a z-scored reward
    depends on the rest of the batch by construction (so batch-independence,
    docs/guides/field_cases.md#rewards-do-not-depend-on-batch-composition, holds only for ``normalize="none"``).

    Args:
        scores (`torch.Tensor`): `(B,)` float scores.
        eps (`float`, defaults to 1e-6): added to the std.

    Returns:
        `torch.Tensor`: `(B,)` float32.
    """
    scores = scores.float()
    return (scores - scores.mean()) / (scores.std(unbiased=False) + eps)


class WeightedSum:
    r"""Combines rewards as $s = \sum_k w_k\, n_k(s_k)$, where $n_k$ is the identity (``"none"``) or the batch
    z-score (``"zscore"``, `zscore`) chosen per reward.

    Each component is called on the full batch through its guard (`diffalign.rewards.reward_set.CheckedReward`; a
    component given unguarded is wrapped): a component that raises, returns scores of the wrong shape or returns
    non-finite scores makes the call raise `RewardError` naming that component (after logging it), so a run never
    trains on a silently missing or NaN reward; the caller decides whether to skip the batch or stop.

    Args:
        rewards (`dict[str, Reward]`): the components by name (the keys of ``cfg.reward``); at least one.
        weights (`dict[str, float]`): one finite weight per component, same keys as `rewards`.
        normalize (`dict[str, str]`, *optional*): ``"none"`` or ``"zscore"`` per component (missing names:
            ``"none"``); applied before weighting.

    Attributes:
        rewards (`dict[str, CheckedReward]`): the guarded components (their ``step`` is the one named in errors,
            `diffalign.rewards.reward_set.set_reward_step`).
        differentiable (`bool`): true when every component is differentiable.
        name (`str`): ``"weighted_sum"``.

    Raises:
        ValueError: if `rewards` is empty, the keys of `weights` differ from those of `rewards`, a weight is not
            finite, or a normalisation is unknown or names no reward.
    """

    name = "weighted_sum"

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float], normalize: dict[str, str] | None = None):
        if not rewards:
            raise ValueError("WeightedSum needs at least one reward; select one, e.g. reward=[jpeg_compressibility].")
        if set(weights) != set(rewards):
            raise ValueError(
                f"reward weights are given for {sorted(weights)} but the rewards are {sorted(rewards)}; "
                "give exactly one weight per selected reward."
            )
        for name, weight in weights.items():
            if not math.isfinite(weight):
                raise ValueError(f"reward weight for '{name}' is {weight}; use a finite number.")
        normalize = dict(normalize or {})
        for name, mode in normalize.items():
            if name not in rewards:
                raise ValueError(f"normalisation given for '{name}', which is not among the rewards {sorted(rewards)}")
            if mode not in NORMALIZE:
                raise ValueError(f"reward.{name}.normalize={mode!r} must be one of {NORMALIZE}")
        self.rewards = checked_rewards(rewards)
        self.weights = {name: float(weights[name]) for name in rewards}
        self.normalize = {name: normalize.get(name, "none") for name in rewards}
        self.differentiable = all(reward.differentiable for reward in self.rewards.values())

    def __repr__(self) -> str:
        return "WeightedSum(" + ", ".join(f"{n}×{w}" + ("(zscore)" if self.normalize[n] == "zscore" else "")
                                          for n, w in self.weights.items()) + ")"

    def __call__(
        self,
        images: torch.Tensor,
        prompts: list[str],
        metadata: list[dict[str, Any]] | None = None,
    ) -> RewardOutput:
        """Scores a batch with every component and sums the weighted scores.

        Args:
            images (`torch.Tensor`): `(B, C, H, W)` images or `(B, F, C, H, W)` videos, float in [0, 1].
            prompts (`list[str]`): `B` prompts.
            metadata (`list[dict]`, *optional*): `B` per-sample records passed to every component.

        Returns:
            `RewardOutput`: ``scores`` `(B,)` float32 weighted sum; ``info["scores/<name>"]`` holds each component's
            raw `(B,)` float32 scores (before normalisation and weighting), ``info["normalized/<name>"]`` the
            z-scored ones for ``"zscore"`` components, and ``info["<name>/<key>"]`` each component's own info entries;
            ``maps`` is the weighted sum of the components' dense maps when every component returns one (else
            `None`, with each available map kept in ``info["maps/<name>"]``).

        Raises:
            RewardError: naming the component that raised, returned scores not of shape `(B,)`, or non-finite scores.
        """
        total: torch.Tensor | None = None
        info: dict[str, Any] = {}
        maps: dict[str, torch.Tensor] = {}
        for name, reward in self.rewards.items():
            out = reward(images, prompts, metadata)  # checked: (B,) finite float32 scores, or RewardError
            scores = out.scores
            info[f"scores/{name}"] = scores
            if self.normalize[name] == "zscore":
                scores = zscore(scores)
                info[f"normalized/{name}"] = scores
            info.update({f"{name}/{key}": value for key, value in out.info.items()})
            if out.maps is not None:
                maps[name] = out.maps
                info[f"maps/{name}"] = out.maps
            weighted = self.weights[name] * scores
            total = weighted if total is None else total + weighted.to(total.device)
        combined_maps = None
        if len(maps) == len(self.rewards):
            combined_maps = sum(self.weights[name] * m.float() for name, m in maps.items())
        return RewardOutput(scores=total, info=info, maps=combined_maps)


def reward_metrics(out: RewardOutput, prefix: str = "reward") -> dict[str, float]:
    """Scalars for the trackers from a `WeightedSum` output: ``<prefix>/mean``, ``<prefix>/std`` of the total and
    ``<prefix>/<name>/mean``, ``<prefix>/<name>/std`` of each component's raw scores (one entry per component, so
    each is logged separately)."""
    metrics = {f"{prefix}/mean": float(out.scores.float().mean()),
               f"{prefix}/std": float(out.scores.float().std(unbiased=False))}
    for key, value in out.info.items():
        if key.startswith("scores/"):
            name = key[len("scores/"):]
            metrics[f"{prefix}/{name}/mean"] = float(value.float().mean())
            metrics[f"{prefix}/{name}/std"] = float(value.float().std(unbiased=False))
    return metrics


class ChunkScorer:
    """Scores an online epoch's rollouts chunk by chunk as they are made, so that a reward server scores chunk k while
    the policy samples chunk k + 1; the result equals one `WeightedSum` call on the whole epoch.

        scorer = ChunkScorer(rewards, metadata)
        traj, group_ids = group_rollout(..., on_chunk=scorer.add)
        scored = scorer.result(traj.images, traj.prompts)   # raises RewardError like rewards(...) would

    Args:
        rewards (`WeightedSum`): the run's rewards (guarded components, `diffalign.rewards.reward_set.CheckedReward`);
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


def build_reward(name: str, **kwargs: Any) -> Any:
    """Instantiates the registered reward `name` with its config defaults overridden by `kwargs`.

    Raises:
        ValueError: if `name` is not registered (the message lists the available names).
        omegaconf.errors.ConfigKeyError: if a kwarg is not a field of the reward's config.
        hydra.errors.InstantiationException: wrapping any error of the reward's constructor (e.g. a bad value).
    """
    config_class = python_config(name) if name.startswith(PREFIX) else reward_config(name)
    config = OmegaConf.merge(OmegaConf.structured(config_class), kwargs)
    return instantiate(config)


def _reward_kwargs(name: str, node: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """(registered name, config kwargs) of a selected reward node: drops ``_target_`` and the combine fields; a
    ``python:`` one-off (key = function name) is built from its ``function`` field."""
    node = dict(node or {})
    target = node.pop("_target_", None)
    for key in COMBINE_FIELDS:
        node.pop(key, None)
    if target == PythonFunctionConfig._target_:
        return f"{PREFIX}{node['function']}", node
    return name, node


def build_selected_rewards(cfg_reward: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: reward}`` for every reward selected in a reward config node (``reward=[a,b]`` or
    ``eval_reward=[a,b]``), each built with `build_reward` from its node (``_target_``, ``weight`` and ``normalize``
    are dropped)."""
    rewards = {}
    for name, node in cfg_reward.items():
        registered, kwargs = _reward_kwargs(name, node)
        rewards[name] = build_reward(registered, **kwargs)
    return rewards


def build_checked_rewards(cfg_reward: Mapping[str, Any]) -> dict[str, CheckedReward]:
    """Build → guard: ``{name: CheckedReward}`` for every reward selected in a reward config node
    (`build_selected_rewards`, each wrapped by `diffalign.rewards.reward_set.CheckedReward`, which checks every
    output)."""
    return checked_rewards(build_selected_rewards(cfg_reward))


def build_rewards(cfg_reward: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> WeightedSum:
    """Build → guard → combine: the `WeightedSum` of the selected rewards of ``cfg.reward`` (`{name: config node}`),
    each component guarded (`build_checked_rewards`), the one path every reward of a run takes.

    Each node is merged onto the registered config dataclass of its name (so a plain dict, a partial dict or `None`
    works, and unknown fields raise), then instantiated. The weights are `weights` when given, else each node's
    ``weight`` (default 1.0); each node's ``normalize`` (default ``"none"``) is applied before weighting.

    Raises:
        ValueError: if `cfg_reward` is empty, a name is not a registered reward (the message lists the available
            names), `weights` does not give exactly one weight per reward, or a ``normalize`` value is unknown.
        omegaconf.errors.ConfigKeyError: if a node has a field its config does not.
        hydra.errors.InstantiationException: wrapping any error of a reward's constructor.
    """
    if not cfg_reward:
        raise ValueError("no reward selected; set e.g. reward=[jpeg_compressibility].")
    rewards = build_checked_rewards(cfg_reward)
    nodes = {name: dict(node or {}) for name, node in cfg_reward.items()}
    if weights is None:
        weights = {name: float(nodes[name].get("weight", COMBINE_FIELDS["weight"])) for name in rewards}
    normalize = {name: nodes[name].get("normalize", COMBINE_FIELDS["normalize"]) for name in rewards}
    return WeightedSum(rewards, dict(weights), normalize)
