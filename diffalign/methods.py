"""The method contract: what the two training loops ask of a method (an objective built from ``cfg.method``).

A method is one objective file and one ``configs/method/*.yaml``. It declares what it needs and the loops read those
declarations; they hold no method names. Every method has

- ``data_flow`` (`str`, class attribute): which loop runs it and what data it consumes: "online_groups" or
  "online_trajectories" (`ONLINE_FLOWS`, `diffalign.train.online`), "pairs" or "winners" (`PREFERENCE_FLOWS`,
  `diffalign.train.preference`);
- ``check_config(cfg, num_processes=None)`` (classmethod): its own checks of the composed run config, run by
  `diffalign.config.validation.validate_train_config` before any model loads and again by the loop (errors name the
  field and the fix); e.g. the model family it trains (a model config's class says ``flow_matching``) or the sampler it
  needs;
- a constructor that only checks and stores its arguments (cheap, no side effects): validation builds the method
  once from ``cfg.method`` so that its argument checks run before any model loads
  (`diffalign.config.validation.construct`). It is built from its config dataclass, as trl's trainers take their
  ``args``: ``Method(config=None, **fields)`` (`method_config`), so each default is written once, in the dataclass
  that ``configs/method/<name>.yaml`` extends;
- ``setup(policy)``: called once, after the reference strategy's setup and before the optimizer collects the
  trainable parameters (adapters it needs go on the denoiser here);
- ``checkpoint_states()``: ``{file stem: object with state_dict / load_state_dict}`` saved with every checkpoint and
  read back on resume (e.g. DGPO's θ⁻ as ``old_policy_state``); empty for most methods.

A preference method (`PreferenceMethod`) is then called as ``method(policy, batch, generator=..., reference=...)`` with
a `PreferenceBatch` ("pairs") or `WinnerBatch` ("winners"). An online method (`OnlineMethod`) declares how the epoch's
rollouts are made and scored (``rollout_policy``, ``log_prob_reduction``, ``advantage``) and splits the epoch into
optimizer updates itself:

    for update in method.plan(policy, epoch):      # one optimizer step each
        for unit in update:                        # its micro-batches, gradients accumulated
            loss, metrics = method.loss(policy, unit, reference=reference)

This module also holds what the online loop and the online methods share: the `OnlineEpoch` handed to a method, the
epoch's random streams (`epoch_generator`), the split of an epoch's units into updates (`split_updates`) and the
rollout policy of on-policy methods (`CurrentPolicy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from diffalign.advantages import ADVANTAGE_KINDS  # noqa: F401 (what `OnlineMethod.advantage` may be)
from diffalign.types import PreferenceBatch, Trajectory, WinnerBatch

ONLINE_FLOWS = ("online_groups", "online_trajectories")
PREFERENCE_FLOWS = ("pairs", "winners")
BATCH_TYPES = {"pairs": PreferenceBatch, "winners": WinnerBatch}  # what a preference method is called with
# stream tags of an online epoch's draws (`stream_seed`; diffalign.samplers.groups uses 0 and 1, the preference
# loop 20)
PROMPTS, TIMESTEPS, NOISE, SHUFFLE = 10, 11, 12, 13

_COMMON = ("data_flow", "check_config", "setup", "checkpoint_states")
ONLINE_MEMBERS = (*_COMMON, "rollout_policy", "log_prob_reduction", "advantage", "epoch_updates", "prepare", "plan",
                  "loss")
PREFERENCE_MEMBERS = _COMMON


C = TypeVar("C")


def method_config(schema: type[C], config: C | None, fields: dict[str, Any]) -> C:
    """The config a method is built from: `config` (by default `schema`'s defaults, the one place a method's defaults
    are written) with `fields` set on it, the keyword arguments the method was called with (Hydra passes those of the
    ``method`` node). A method's constructor is ``__init__(self, config=None, **fields)`` and starts with this call.

    Raises:
        TypeError: `config` is not a `schema`, or a key of `fields` is not one of its fields (naming it and the fields).
    """
    if config is None:
        config = schema()
    elif not isinstance(config, schema):
        raise TypeError(f"method: config must be a {schema.__name__}, got {type(config).__name__}")
    names = sorted(f.name for f in dataclasses.fields(schema) if f.name != "_target_")
    for key in fields:
        if key not in names:
            raise TypeError(f"method.{key} is not a setting of {schema.__name__}; its settings: {', '.join(names)}")
    return dataclasses.replace(config, **fields)


def stream_seed(seed: int, epoch: int, group: int, member: int, stream: int) -> int:
    """A 63-bit seed for one random stream, from ``SeedSequence([seed, epoch, group, member, stream])``."""
    return int(np.random.SeedSequence([seed, epoch, group, member, stream]).generate_state(1, np.uint64)[0] >> 1)


def epoch_generator(seed: int, epoch: int, tag: int, extra: int = 0) -> torch.Generator:
    """A CPU generator for one of an online epoch's random streams (`tag`: `PROMPTS`, `TIMESTEPS`, `SHUFFLE`, ...)."""
    return torch.Generator().manual_seed(stream_seed(seed, epoch, extra, 0, tag))


def split_updates(units: list, parts: int) -> list[list]:
    """`units` in `parts` contiguous, nearly equal chunks (empty ones dropped): the optimizer updates of an epoch."""
    bounds = np.linspace(0, len(units), parts + 1).round().astype(int)
    return [units[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@dataclass
class OnlineEpoch:
    """One online epoch as the loop hands it to a method, after rollouts, rewards and advantages.

    Attributes:
        trajectory (`Trajectory`): this process's `N` rollouts (after best-of-n selection).
        advantages (`torch.Tensor`): `(N,)` advantages, or `(N, R)` one per reward (``advantage="per_reward"``).
        group_ids (`torch.Tensor`): `(N,)` int64 global group id of each row.
        group_size (`int`): G, the samples per prompt (``online.group_size``).
        reward_weights (`torch.Tensor`): `(R,)` the selected rewards' weights, in selection order.
        seed, epoch (`int`): the run's seed and the 0-based epoch (key the method's random streams).
        batch_size (`int`): rows per micro-batch on this process (``trainer.batch_size``).
        updates (`int`): optimizer updates per pass over the epoch (``online.updates_per_epoch``).
        inner_epochs (`int`): passes over the epoch (``online.num_inner_epochs``).
        num_processes (`int`): the number of processes.
        split (`str`): how the epoch's rows are spread over the processes (``online.split``): "groups" (whole groups
            per process) or "members" (a share of every group on each process).
        note (`Callable[[str], None]`): prints a message once per run (the same text again is dropped).
    """

    trajectory: Trajectory
    advantages: torch.Tensor
    group_ids: torch.Tensor
    group_size: int
    reward_weights: torch.Tensor
    seed: int
    epoch: int
    batch_size: int
    updates: int
    inner_epochs: int
    num_processes: int
    split: str
    note: Callable[[str], None]


class CurrentPolicy:
    """The rollout policy of an on-policy method: θ itself (nothing to step or save)."""

    def use(self, policy) -> contextlib.AbstractContextManager:
        """Runs the block with θ unchanged."""
        return contextlib.nullcontext(policy)

    def after_update(self) -> None:
        pass


class RolloutPolicy(Protocol):
    """The policy an online method samples its epochs with (`CurrentPolicy`, or
    `diffalign.reference.old_policy.EmaRolloutPolicy` for DGPO's θ⁻); ``after_update()`` follows every optimizer
    step."""

    def use(self, policy) -> contextlib.AbstractContextManager: ...

    def after_update(self) -> None: ...


class PreferenceMethod(Protocol):
    """A method of the preference loop (data flow "pairs" or "winners"; see the module docstring)."""

    data_flow: str

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None: ...

    def setup(self, policy) -> None: ...

    def checkpoint_states(self) -> dict[str, Any]: ...

    def __call__(self, policy, batch, *, generator, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class OnlineMethod(Protocol):
    """A method of the online loop (see the module docstring).

    Attributes:
        rollout_policy (`RolloutPolicy`): samples the epochs (valid after ``setup``).
        log_prob_reduction (`str`): how the rollouts store step log-probs: "mean" `(B, K)` or "per_position"
            `(B, K, *grid)`.
        advantage (`str`): the advantages the method trains on (`ADVANTAGE_KINDS`): "group" (group-normalised reward),
            "per_prompt" (DDPO's running per-prompt statistics) or "per_reward" (one group advantage per reward).
    """

    data_flow: str
    rollout_policy: RolloutPolicy
    log_prob_reduction: str
    advantage: str

    @classmethod
    def check_config(cls, cfg, num_processes: int | None = None) -> None:
        """Raises ValueError for a config the method cannot run (`num_processes`: None before the launch)."""

    def setup(self, policy) -> None: ...

    def checkpoint_states(self) -> dict[str, Any]: ...

    def epoch_updates(self, updates_per_epoch: int, num_inner_epochs: int) -> int:
        """Optimizer updates per epoch (sizes the LR schedule)."""

    def prepare(self, policy, epoch: OnlineEpoch) -> dict[str, float]:
        """Called once per epoch before `plan`; returns entries for the epoch's log (with their prefix)."""

    def plan(self, policy, epoch: OnlineEpoch) -> Iterator[list]:
        """The epoch's optimizer updates, each a list of units (micro-batches) for `loss`."""

    def loss(self, policy, unit, *, reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scalar loss of one unit and its detached metrics."""


def check_method(objective, target: str, flows: tuple[str, ...], members: tuple[str, ...], loop: str) -> None:
    """Refuses an objective the loop cannot run: a data flow outside `flows`, or members of the contract missing.

    Raises:
        ValueError: naming ``method=<target>``, its data flow or its missing members.
    """
    flow = getattr(objective, "data_flow", None)
    if flow not in flows:
        allowed = f"one of {flows}" if loop == "online" else " or ".join(repr(f) for f in flows)
        raise ValueError(f"method={target} consumes {flow!r} data; the {loop} loop runs methods whose data_flow is "
                         f"{allowed}")
    missing = [m for m in members if not hasattr(objective, m)]
    if missing:
        raise ValueError(f"method={target} lacks {missing} of the method contract (diffalign.methods); a {flow!r} "
                         "method defines them all")
