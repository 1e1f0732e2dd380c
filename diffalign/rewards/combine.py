"""Weighted sum of several rewards (the multi-select ``reward=[a,b]`` of the configs)."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from diffalign.rewards.base import Reward, RewardError
from diffalign.types import RewardOutput

logger = logging.getLogger(__name__)


class WeightedSum:
    r"""Combines rewards as $s = \sum_k w_k\, s_k$.

    Each component is called on the full batch. A component that raises, returns scores of the wrong shape or
    returns non-finite scores makes the call raise `RewardError` naming that component (after logging it), so a run
    never trains on a silently missing or NaN reward; the caller decides whether to skip the batch or stop.

    Args:
        rewards (`dict[str, Reward]`): the components by name (the keys of ``cfg.reward``); at least one.
        weights (`dict[str, float]`): one finite weight per component, same keys as `rewards`.

    Attributes:
        differentiable (`bool`): true when every component is differentiable.
        name (`str`): ``"weighted_sum"``.

    Raises:
        ValueError: if `rewards` is empty, the keys of `weights` differ from those of `rewards`, or a weight is not
            finite.
    """

    name = "weighted_sum"

    def __init__(self, rewards: dict[str, Reward], weights: dict[str, float]):
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
        self.rewards = dict(rewards)
        self.weights = {name: float(weights[name]) for name in rewards}
        self.differentiable = all(reward.differentiable for reward in self.rewards.values())

    def __repr__(self) -> str:
        return f"WeightedSum({', '.join(f'{n}×{w}' for n, w in self.weights.items())})"

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
            unweighted `(B,)` float32 scores and ``info["<name>/<key>"]`` each component's own info entries;
            ``maps`` is the weighted sum of the components' dense maps when every component returns one (else
            `None`, with each available map kept in ``info["maps/<name>"]``).

        Raises:
            RewardError: naming the component that raised, returned scores not of shape `(B,)`, or non-finite scores.
        """
        batch_size = images.shape[0]
        total: torch.Tensor | None = None
        info: dict[str, Any] = {}
        maps: dict[str, torch.Tensor] = {}
        for name, reward in self.rewards.items():
            try:
                out = reward(images, prompts, metadata)
            except Exception as err:
                logger.exception("reward '%s' raised on a batch of %d", name, batch_size)
                raise RewardError(name, f"raised {type(err).__name__}: {err}") from err
            scores = out.scores
            if scores.shape != (batch_size,):
                raise RewardError(name, f"returned scores of shape {tuple(scores.shape)}, expected ({batch_size},).")
            scores = scores.float()
            bad = ~torch.isfinite(scores)
            if bad.any():
                logger.error("reward '%s' returned non-finite scores at batch rows %s", name, bad.nonzero().flatten())
                raise RewardError(
                    name, f"returned non-finite scores at batch rows {bad.nonzero().flatten().tolist()}."
                )
            info[f"scores/{name}"] = scores
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
