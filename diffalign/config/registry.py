"""Entry-point discovery for rewards, models and methods, fed into Hydra's `ConfigStore`.

An entry point's value is a config *dataclass* (cheap to import) whose ``_target_`` names the component class; the
class's module is imported only when the component is instantiated. Built-in components register the same way
(see ``pyproject.toml``). Call `register_configs()` once before composing a config.

Every reward option gets two extra fields besides its config's: ``weight`` (float, default 1.0) and ``normalize``
(``"none"`` or ``"zscore"``), read by `build_rewards` to build the `WeightedSum` (``reward.clip_score.weight=0.5``).
Rewards are stored twice: in the ``reward`` group (training, ``cfg.reward.<name>``) and in the ``eval_reward`` group
(evaluation and hacking monitors, ``cfg.eval_reward.<name>``; when none is selected, evaluation uses ``cfg.reward``).
A one-off reward ``python:<module>:<function>`` is stored by `register_python_reward` under the function's name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import warnings
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import OmegaConf

from diffalign.rewards.combine import WeightedSum
from diffalign.rewards.guard import CheckedReward, checked_rewards
from diffalign.rewards.python_function import PREFIX, PythonFunctionConfig, parse_spec
from diffalign.schemas import register_schemas

GROUPS = {"diffalign.rewards": "reward", "diffalign.models": "model", "diffalign.methods": "method"}
"""Entry-point group → Hydra config group."""
REWARD_GROUPS = ("reward", "eval_reward")
"""Hydra config groups holding every reward (training set, evaluation set)."""
COMBINE_FIELDS = {"weight": 1.0, "normalize": "none"}
"""Fields added to every reward option, consumed by `build_rewards` (not passed to the reward)."""
def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of `group` by name; raises ValueError when two distributions declare the same name."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in found:
            dists = [e.dist.name if e.dist is not None else "<unknown distribution>" for e in (found[ep.name], ep)]
            raise ValueError(
                f"entry point '{ep.name}' in group '{group}' is declared by both '{dists[0]}' ({found[ep.name].value}) "
                f"and '{dists[1]}' ({ep.value}); uninstall one or rename its entry point."
            )
        found[ep.name] = ep
    return found


def _load(group: str, name: str, eps: dict[str, importlib.metadata.EntryPoint]) -> type:
    if group == "diffalign.rewards" and name.startswith(PREFIX):
        return _python_config(name)
    if name not in eps:
        raise ValueError(f"unknown {GROUPS.get(group, group)} '{name}'; available: {sorted(eps)}.")
    try:
        return eps[name].load()
    except (ImportError, AttributeError) as err:
        raise ImportError(
            f"entry point '{name}' = '{eps[name].value}' in group '{group}' cannot be loaded: {err}. "
            "Install the package (or extra) that provides it."
        ) from err


def entry_point_configs(group: str = "diffalign.rewards") -> dict[str, type]:
    """Loads every entry point of `group`: `{name: config dataclass}`. Raises ValueError on duplicate names."""
    eps = _entry_points(group)
    return {name: _load(group, name, eps) for name in sorted(eps)}


def _python_config(spec: str) -> type:
    """`PythonFunctionConfig` with ``function`` defaulting to `spec`'s ``<module>:<function>``."""
    module, function = parse_spec(spec)
    return dataclasses.make_dataclass(f"PythonFunction_{function}", [("function", str, f"{module}:{function}")],
                                      bases=(PythonFunctionConfig,))


def _reward_node(config_class: type, name: str) -> type:
    """`config_class` extended by the `COMBINE_FIELDS` (a dataclass subclass, so Hydra still type-checks overrides).

    Raises:
        ValueError: if the config already has a field named like a combine field.
    """
    clash = sorted({f.name for f in dataclasses.fields(config_class)} & set(COMBINE_FIELDS))
    if clash:
        raise ValueError(f"reward '{name}' ({config_class.__qualname__}) has config field(s) {clash}, which diffalign "
                         "reserves for combining rewards (reward.<name>.weight / .normalize); rename them")
    return dataclasses.make_dataclass(f"{config_class.__name__}WithWeight",
                                      [("weight", float, COMBINE_FIELDS["weight"]),
                                       ("normalize", str, COMBINE_FIELDS["normalize"])], bases=(config_class,))


def register_configs() -> dict[str, list[str]]:
    """Stores every reward, model and method config in Hydra's `ConfigStore` (and diffalign's own structured configs,
    `diffalign.schemas.register_schemas`); returns `{config group: [names]}`.

    Rewards are stored with ``package="reward.<name>"`` so that the multi-select ``reward=[a,b]`` composes to
    ``cfg.reward.a`` and ``cfg.reward.b`` (and likewise in the ``eval_reward`` group), each with the extra fields
    ``weight`` and ``normalize``; models and methods use their group as package (``cfg.model``, ``cfg.method``).
    Calling it again re-stores the same nodes.

    Raises:
        ValueError: if two distributions declare the same name in one group (both are named), or a reward config has
            a field named ``weight`` or ``normalize``.
        ImportError: if one of diffalign's own entry points cannot be loaded (named, with its value). A third-party
            plugin that cannot be loaded is skipped with a warning naming it and the error, so one broken package
            does not stop runs that do not use it (selecting it then fails as an unknown option).
    """
    register_schemas()
    store, stored = ConfigStore.instance(), {}
    for group, config_group in GROUPS.items():
        eps = _entry_points(group)
        for name in sorted(eps):
            provider = eps[name].dist.name if eps[name].dist is not None else None
            try:
                node = _load(group, name, eps)
            except ImportError as err:
                if provider == "diffalign":
                    raise
                warnings.warn(f"skipping the {GROUPS.get(group, group)} plugin '{name}' from '{provider}': {err}",
                              stacklevel=2)
                eps.pop(name)
                continue
            if config_group == "reward":
                node = _reward_node(node, name)
                for reward_group in REWARD_GROUPS:
                    store.store(group=reward_group, name=name, node=node, package=f"{reward_group}.{name}",
                                provider=provider)
            else:
                store.store(group=config_group, name=name, node=node, package=config_group, provider=provider)
        stored[config_group] = sorted(eps)
    stored["eval_reward"] = stored["reward"]
    return stored


def register_python_reward(spec: str) -> str:
    """Stores the one-off reward ``python:<module>:<function>`` as an option of the ``reward`` and ``eval_reward``
    groups (option name: `spec`; config key: the function's name, so ``reward=[python:pkg.mod:sharpness]`` gives
    ``cfg.reward.sharpness`` with ``function: pkg.mod:sharpness``); returns that key.

    Raises:
        ValueError: `spec` is malformed, or the function's name is already a registered reward.
    """
    function = parse_spec(spec)[1]
    if function in _entry_points("diffalign.rewards"):
        raise ValueError(f"reward {spec!r} would be stored as '{function}', which is already an installed reward; "
                         "rename the function")
    node = _reward_node(_python_config(spec), spec)
    for reward_group in REWARD_GROUPS:
        ConfigStore.instance().store(group=reward_group, name=spec, node=node, package=f"{reward_group}.{function}")
    return function


def build_reward(name: str, **kwargs: Any) -> Any:
    """Instantiates the registered reward `name` with its config defaults overridden by `kwargs`.

    Raises:
        ValueError: if `name` is not registered (the message lists the available names).
        omegaconf.errors.ConfigKeyError: if a kwarg is not a field of the reward's config.
        hydra.errors.InstantiationException: wrapping any error of the reward's constructor (e.g. a bad value).
    """
    config = OmegaConf.merge(
        OmegaConf.structured(_load("diffalign.rewards", name, _entry_points("diffalign.rewards"))), kwargs
    )
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
    (`build_selected_rewards`, each wrapped by `diffalign.rewards.guard.CheckedReward`, which checks every output)."""
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
