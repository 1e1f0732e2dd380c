"""One-off rewards given as ``python:<module>:<function>``.

``reward=[python:my_pkg.rewards:sharpness]`` selects ``sharpness`` from ``my_pkg.rewards`` without any packaging; it
appears as ``cfg.reward.sharpness`` (so ``reward.sharpness.weight=0.5`` works). The function takes
``(images, prompts, metadata)`` like any reward and returns a `RewardOutput` or a `(B,)` tensor of scores. Set a
``differentiable = True`` attribute on the function if its scores carry gradients to the pixels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
