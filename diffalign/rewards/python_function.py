"""One-off rewards given as ``python:<module>:<function>``.

``reward=[python:my_pkg.rewards:sharpness]`` selects ``sharpness`` from ``my_pkg.rewards`` without any packaging; it
appears as ``cfg.reward.sharpness`` (so ``reward.sharpness.weight=0.5`` works). The function takes
``(images, prompts, metadata)`` like any reward and returns a `RewardOutput` or a `(B,)` tensor of scores. Set a
``differentiable = True`` attribute on the function if its scores carry gradients to the pixels.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hydra.core.config_store import ConfigStore

from diffalign.config.registry import REWARD_GROUPS, reward_names, reward_node
from diffalign.types import RewardOutput

PREFIX = "python:"


def parse_spec(spec: str) -> tuple[str, str]:
    """``"python:pkg.mod:fn"`` or ``"pkg.mod:fn"`` → ``("pkg.mod", "fn")``.

    Raises:
        ValueError: the spec is not ``[python:]<module>:<function>``.
    """
    body = spec.removeprefix(PREFIX)
    module, sep, function = body.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"reward {spec!r} must look like python:<module>:<function>, e.g. "
                         "python:my_pkg.rewards:sharpness")
    return module, function


def load_function(spec: str) -> Callable[..., Any]:
    """Imports the function named by `spec` (see `parse_spec`).

    Raises:
        ValueError: bad spec; ImportError: the module cannot be imported or has no such callable.
    """
    module_name, function_name = parse_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"reward {spec!r}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH?"
                          ) from err
    function = vars(module).get(function_name)
    if not callable(function):
        # a missing attribute of a module is an import problem for the user
        raise ImportError(f"reward {spec!r}: module {module_name!r} has no callable {function_name!r}")  # noqa: TRY004
    return function


@dataclass
class PythonFunctionConfig:
    """Config of `PythonFunction` (fields mirror its ``__init__``)."""

    _target_: str = "diffalign.rewards.python_function.PythonFunction"
    function: str = "???"


class PythonFunction:
    """Wraps a plain function as a reward.

    Args:
        function (`str`): ``[python:]<module>:<function>``.

    Call: forwards ``(images, prompts, metadata)``; a returned tensor becomes ``RewardOutput(scores=tensor.float())``.

    Raises:
        ValueError, ImportError: see `load_function`.
    """

    def __init__(self, function: str):
        self.function = load_function(function)
        self.name = parse_spec(function)[1]
        self.differentiable = bool(vars(self.function).get("differentiable", False))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        out = self.function(images, prompts, metadata)
        return out if isinstance(out, RewardOutput) else RewardOutput(scores=torch.as_tensor(out).float())


def python_config(spec: str) -> type:
    """`PythonFunctionConfig` with ``function`` defaulting to `spec`'s ``<module>:<function>``."""
    module, function = parse_spec(spec)
    return dataclasses.make_dataclass(f"PythonFunction_{function}", [("function", str, f"{module}:{function}")],
                                      bases=(PythonFunctionConfig,))


def register_python_reward(spec: str) -> str:
    """Stores the one-off reward ``python:<module>:<function>`` as an option of the ``reward`` and ``eval_reward``
    groups (option name: `spec`; config key: the function's name, so ``reward=[python:pkg.mod:sharpness]`` gives
    ``cfg.reward.sharpness`` with ``function: pkg.mod:sharpness``); returns that key.

    Raises:
        ValueError: `spec` is malformed, or the function's name is already a registered reward.
    """
    function = parse_spec(spec)[1]
    if function in reward_names():
        raise ValueError(f"reward {spec!r} would be stored as '{function}', which is already an installed reward; "
                         "rename the function")
    node = reward_node(python_config(spec), spec)
    for reward_group in REWARD_GROUPS:
        ConfigStore.instance().store(group=reward_group, name=spec, node=node, package=f"{reward_group}.{function}")
    return function
