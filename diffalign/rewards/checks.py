"""A selected reward's settings, checked before any model loads (`diffalign.config.validation`): the combine fields
every reward option carries (``weight``, ``normalize``) and the fields the shipped rewards share (``value_range``,
``device``, ``dtype``, ``scale``, ``quality``). A reward class may add its own checks as a classmethod
``check_config(node, prefix)``; it runs after these. Types are checked by Hydra already (the reward configs are
dataclasses); these are the ranges and names.
"""

from __future__ import annotations

import re

from diffalign.config.checks import ConfigError, choice, integer, node_check, number, target_attribute
from diffalign.rewards.reward_set import NORMALIZE

DTYPES = ("float32", "float16", "bfloat16")


def _check_device(node, prefix: str) -> None:
    if "device" not in node:
        return
    device = str(node.device)
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):
        raise ConfigError(f"{prefix}.device={device!r} is not a device name; use cpu, cuda or cuda:<index>")
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ConfigError(f"{prefix}.device={device} but {torch.cuda.device_count()} CUDA devices are visible "
                              f"here; pass {prefix}.device=cpu")


@node_check("reward")
def check_reward_config(node, prefix: str) -> None:
    """Checks one selected reward's node ``cfg.<reward|eval_reward>.<name>`` (`prefix`), then the reward class's own
    ``check_config(node, prefix)``.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if not node:
        return
    number(node, "weight", prefix, hint="the reward's weight in the weighted sum (negative: minimise it)")
    choice(node, "normalize", prefix, NORMALIZE, hint="zscore: standardise over the batch before weighting")
    if "value_range" in node:
        lo_hi = list(node.value_range) if node.value_range is not None else []
        if len(lo_hi) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lo_hi) \
                or not lo_hi[0] < lo_hi[1]:
            raise ConfigError(f"{prefix}.value_range must be two numbers [low, high] with low < high, e.g. [0.0, 1.0] "
                              f"(or [-1.0, 1.0] for VAE-convention images), got {node.value_range}")
    choice(node, "dtype", prefix, DTYPES)
    number(node, "scale", prefix, gt=0)
    integer(node, "quality", prefix, ge=1, le=100, hint="a JPEG quality (DDPO uses 95)")
    _check_device(node, prefix)
    check = target_attribute(node.get("_target_"), "check_config")
    if check is not None:
        check(node, prefix)
