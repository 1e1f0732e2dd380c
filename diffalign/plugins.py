"""Entry-point discovery for rewards, models and methods, fed into Hydra's `ConfigStore`.

An entry point's value is a config *dataclass* (cheap to import) whose ``_target_`` names the component class; the
class's module is imported only when the component is instantiated. Built-in components register the same way
(see ``pyproject.toml``). Call `register_configs()` once before composing a config.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import OmegaConf

from diffalign.rewards.combine import WeightedSum

GROUPS = {"diffalign.rewards": "reward", "diffalign.models": "model", "diffalign.methods": "method"}
"""Entry-point group → Hydra config group."""


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


def register_configs() -> dict[str, list[str]]:
    """Stores every reward, model and method config in Hydra's `ConfigStore`; returns `{config group: [names]}`.

    Rewards are stored with ``package="reward.<name>"`` so that the multi-select ``reward=[a,b]`` composes to
    ``cfg.reward.a`` and ``cfg.reward.b``; models and methods use their group as package (``cfg.model``,
    ``cfg.method``). Calling it again re-stores the same nodes.

    Raises:
        ValueError: if two distributions declare the same name in one group (both are named).
        ImportError: if an entry point cannot be loaded (named, with its value).
    """
    store, stored = ConfigStore.instance(), {}
    for group, config_group in GROUPS.items():
        eps = _entry_points(group)
        for name in sorted(eps):
            package = f"reward.{name}" if config_group == "reward" else config_group
            provider = eps[name].dist.name if eps[name].dist is not None else None
            store.store(
                group=config_group, name=name, node=_load(group, name, eps), package=package, provider=provider
            )
        stored[config_group] = sorted(eps)
    return stored


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


def build_selected_rewards(cfg_reward: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: reward}`` for every reward selected in the ``reward`` config node (``reward=[a,b]``), each built with
    `build_reward` from its node (the ``_target_`` key is the registered one and is dropped)."""
    return {name: build_reward(name, **{k: v for k, v in node.items() if k != "_target_"})
            for name, node in cfg_reward.items()}


def build_rewards(cfg_reward: Mapping[str, Any], weights: Mapping[str, float] | None = None) -> WeightedSum:
    """Builds the `WeightedSum` of the selected rewards from ``cfg.reward`` (`{name: config node}`).

    Each node is merged onto the registered config dataclass of its name (so a plain dict, a partial dict or `None`
    works, and unknown fields raise), then instantiated. `weights` defaults to 1.0 for every reward.

    Raises:
        ValueError: if `cfg_reward` is empty, a name is not a registered reward (the message lists the available
            names), or `weights` does not give exactly one weight per reward.
        omegaconf.errors.ConfigKeyError: if a node has a field its config does not.
        hydra.errors.InstantiationException: wrapping any error of a reward's constructor.
    """
    if not cfg_reward:
        raise ValueError("no reward selected; set e.g. reward=[jpeg_compressibility].")
    eps = _entry_points("diffalign.rewards")
    rewards = {}
    for name, node in cfg_reward.items():
        config_class = _load("diffalign.rewards", name, eps)
        rewards[name] = instantiate(OmegaConf.merge(OmegaConf.structured(config_class), node or {}))
    return WeightedSum(rewards, dict(weights) if weights is not None else {name: 1.0 for name in rewards})
