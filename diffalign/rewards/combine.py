"""Weighted sum of several rewards (the multi-select ``reward=[a,b]`` of the configs, with
``reward.<name>.weight`` and ``reward.<name>.normalize``).

The last stage of the one path every reward takes (`diffalign.plugins.build_rewards`): build → guard
(`diffalign.rewards.guard.CheckedReward`, which alone checks what a reward returns) → combine (`WeightedSum`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffalign.rewards.base import Reward
from diffalign.types import RewardOutput

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

    Each component is called on the full batch through its guard (`diffalign.rewards.guard.CheckedReward`; a
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
            `diffalign.rewards.guard.set_reward_step`).
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
        from diffalign.rewards.guard import checked_rewards  # (guard → futures → combine: imported here)

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
