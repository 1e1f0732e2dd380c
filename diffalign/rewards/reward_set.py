"""Failure handling for rewards inside training loops: nothing is silently replaced by zero.

- `score_or_raise` calls rewards and checks their output; a reward that raises, returns scores that are not `(B,)`
  or returns NaN/inf raises `RewardError` naming the reward, the step, the batch and the prompt(s).
- `CheckedReward` wraps a reward so that every call goes through `score_or_raise` (for code that calls rewards
  itself, such as on-policy data preparation and evaluation); it counts its calls as the batch index. Its ``submit``
  does the same for a reward scored in the background (`diffalign.rewards.futures`, `diffalign.rewards.http`).
- `stop_on_reward_error` is the loops' context manager: on a `RewardError` it saves a checkpoint, logs where and
  why, and re-raises; the CLI turns it into a clean exit with that message.

Usage in a loop (``diffalign/train/preference.py``)::

    rewards = checked_rewards(build_selected_rewards(cfg.reward))
    with stop_on_reward_error(lambda: write_checkpoint(global_step), log=accelerator.print):
        for step in ...:
            set_reward_step(rewards, global_step)
            outputs = score_or_raise(rewards, images, prompts, metadata, step=global_step, batch_index=i)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from diffalign.rewards.base import Reward, RewardError
from diffalign.rewards.futures import Resolved, completed, has_submit, then
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)


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
        """Starts scoring a batch (`diffalign.rewards.futures.submit`): with the wrapped reward's own ``submit`` when
        it has one, its result checked by `score_or_raise` when it arrives (the future then fails with the
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
    `diffalign.rewards.combine.WeightedSum`: its components), and restarts their batch count if `reset_calls`."""
    for reward in getattr(rewards, "rewards", rewards).values():
        reward.step = step
        if reset_calls:
            reward.calls = 0


@contextlib.contextmanager
def stop_on_reward_error(save_checkpoint: Callable[[], Path | None], log: Callable[[str], None] = print
                         ) -> Iterator[None]:
    """Saves a checkpoint and re-raises when the body raises `RewardError`.

    Args:
        save_checkpoint (`Callable[[], Path | None]`): writes a checkpoint of the current state and returns its folder
            (or `None` where this process does not write checkpoints). Called only on a `RewardError`.
        log (`Callable[[str], None]`, defaults to `print`): where the stop message goes.

    Raises:
        RewardError: the reward's error with the saved folder as ``checkpoint`` and in the message ("— checkpoint
            saved to <folder>; fix or deselect the reward, then resume with resume=latest"); the message names the
            reward, the step, the batch and the prompt(s) (the original error chained; re-raised as it is where this
            process wrote no checkpoint). If saving itself fails, that error is raised from the reward's.
    """
    try:
        yield
    except RewardError as err:
        try:
            err.checkpoint = save_checkpoint()
        except Exception as save_err:  # noqa: BLE001 (any failure to save is reported with the reward's error)
            raise RuntimeError(f"{err}; saving a checkpoint before stopping also failed: {save_err}") from err
        where = f"checkpoint saved to {err.checkpoint}" if err.checkpoint is not None else "no checkpoint written"
        log(f"[diffalign] stopping: {err}; {where}. Fix or deselect the reward, then resume with resume=latest.")
        if err.checkpoint is None:
            raise
        stop = RewardError(err.reward_name, f"{err.detail} — {where}; fix or deselect the reward, then resume with "
                           "resume=latest", step=err.step, batch_index=err.batch_index, prompts=err.prompts)
        stop.checkpoint = err.checkpoint
        raise stop from err
