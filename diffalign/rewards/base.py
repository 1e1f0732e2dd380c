"""The reward interface (docs/guides/rewards.md#write-a-reward-plugin): every reward plugin is a callable with this
signature.

A plugin ships a reward class that satisfies `Reward` and a config dataclass beside it (``_target_`` pointing at the
class, fields mirroring ``__init__``), and declares the *config* in the ``diffalign.rewards`` entry-point group:

```toml
[project.entry-points."diffalign.rewards"]
my_reward = "my_package.rewards:MyRewardConfig"
```

For a one-off reward there is also the ``python:<module>:<function>`` form: ``reward=[python:my_pkg.rewards:sharpness]``
selects the function ``sharpness(images, prompts, metadata) -> RewardOutput | Tensor`` (see
`diffalign.rewards.python_function`) under the key ``reward.sharpness``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from diffalign.types import RewardOutput


class RewardError(RuntimeError):
    """A reward failed or returned unusable scores; the message names the reward, and where known the training step,
    the batch and the prompts involved.

    Raised by `WeightedSum` and `diffalign.rewards.reward_set.score_or_raise`, so a training loop stops (after saving a
    checkpoint, `diffalign.rewards.reward_set.stop_on_reward_error`) instead of training on NaN or missing scores.
    Nothing is ever replaced by zero.

    Args:
        reward_name (`str`): the name of the failing reward (its key in the reward config).
        message (`str`): what went wrong.
        step (`int`, *optional*): the global optimizer step the run was at.
        batch_index (`int`, *optional*): the index of the reward call (batch) within its stage, 0-based.
        prompts (`list[str]`, *optional*): the prompts of the offending rows (or of the whole batch when the reward
            raised); at most 3 are quoted in the message.

    Attributes:
        checkpoint (`pathlib.Path` or `None`): set by `stop_on_reward_error` to the checkpoint saved before stopping.
    """

    def __init__(self, reward_name: str, message: str, *, step: int | None = None, batch_index: int | None = None,
                 prompts: list[str] | None = None):
        where = []
        if step is not None:
            where.append(f"step {step}")
        if batch_index is not None:
            where.append(f"batch {batch_index}")
        if prompts:
            quoted = ", ".join(repr(p) for p in prompts[:3]) + (f" and {len(prompts) - 3} more" if len(prompts) > 3
                                                                else "")
            where.append(f"prompt {quoted}" if len(prompts) == 1 else f"prompts {quoted}")
        super().__init__(f"reward '{reward_name}': {message}" + (f" ({'; '.join(where)})" if where else ""))
        self.reward_name, self.detail = reward_name, message
        self.step, self.batch_index, self.prompts = step, batch_index, list(prompts or [])
        self.checkpoint = None


@runtime_checkable
class Reward(Protocol):
    """A reward model or rule.

    Contract (docs/guides/rewards.md#write-a-reward-plugin): scores `(B,)` float32 on any device, higher is better,
    finite; optional dense ``maps`` `(B, H, W)` (or `(B, F, H, W)` for videos); a sample's score does not depend on the
    rest of the batch. A non-differentiable reward runs under `torch.no_grad()`; model-based rewards keep their model
    on their own ``device``/``dtype`` and move the input there. Failures raise; they never return zeros.

    Attributes:
        differentiable (`bool`): whether the scores can be back-propagated to the input pixels (needed by methods
            that train through the sampler); a class attribute for single rewards, an instance attribute for rewards
            where it is a config option (the CLIP family).
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
            depend on the other samples of the batch (HPSv2 and Q-Align reports;
            docs/guides/field_cases.md#rewards-do-not-depend-on-batch-composition).
        """
        ...
