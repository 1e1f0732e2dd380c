"""The reward interface: every reward plugin is a callable with this signature.

A plugin ships a reward class that satisfies `Reward` and a config dataclass beside it (``_target_`` pointing at the
class, fields mirroring ``__init__``), and declares the *config* in the ``diffalign.rewards`` entry-point group:

```toml
[project.entry-points."diffalign.rewards"]
my_reward = "my_package.rewards:MyRewardConfig"
```
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from diffalign.types import RewardOutput


class RewardError(RuntimeError):
    """A reward failed or returned unusable scores; the message names the reward.

    Raised by `WeightedSum` so a training loop can decide whether to skip the batch or stop, instead of training
    on NaN or missing scores.

    Args:
        reward_name (`str`): the name of the failing reward (its key in the reward config).
        message (`str`): what went wrong.
    """

    def __init__(self, reward_name: str, message: str):
        super().__init__(f"reward '{reward_name}': {message}")
        self.reward_name = reward_name


@runtime_checkable
class Reward(Protocol):
    """A reward model or rule.

    Attributes:
        differentiable (`bool`): whether the scores can be back-propagated to the input pixels (needed by methods
            that train through the sampler); a class attribute for single rewards.
        name (`str`): short identifier used in logs and metric keys, e.g. ``"jpeg_compressibility"``.
    """

    differentiable: bool
    name: str

    def __call__(
        self,
        images: torch.Tensor,
        prompts: list[str],
        metadata: list[dict[str, Any]] | None = None,
    ) -> RewardOutput:
        """Scores a batch.

        Args:
            images (`torch.Tensor`):
                Images of shape `(B, C, H, W)` or videos of shape `(B, F, C, H, W)`, float in [0, 1], RGB.
            prompts (`list[str]`): the `B` prompts the samples were generated from.
            metadata (`list[dict]`, *optional*): `B` per-sample records, e.g. GenEval ``include`` constraints.

        Returns:
            `RewardOutput` with ``scores`` of shape `(B,)`, float32, higher is better. A sample's score must not
            depend on the other samples of the batch (FIELD_CASES C21).
        """
        ...
