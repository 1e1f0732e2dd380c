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

from hydra.core.config_store import ConfigStore

from diffalign.config.schemas import register_schemas

GROUPS = {"diffalign.rewards": "reward", "diffalign.models": "model", "diffalign.methods": "method"}
"""Entry-point group → Hydra config group."""
REWARD_GROUPS = ("reward", "eval_reward")
"""Hydra config groups holding every reward (training set, evaluation set)."""
COMBINE_FIELDS = {"weight": 1.0, "normalize": "none"}
"""Fields added to every reward option, consumed by `diffalign.rewards.reward_set.build_rewards` (not passed to the
reward)."""


def entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
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


def load_entry_point(group: str, name: str, eps: dict[str, importlib.metadata.EntryPoint]) -> type:
    """The config dataclass of entry point `name` of `group` (`eps`: `entry_points(group)`).

    Raises:
        ValueError: `name` is not an entry point of `group` (the message lists the available names).
        ImportError: the entry point cannot be loaded (named, with its value).
    """
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
    eps = entry_points(group)
    return {name: load_entry_point(group, name, eps) for name in sorted(eps)}


def reward_node(config_class: type, name: str) -> type:
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
    `diffalign.config.schemas.register_schemas`); returns `{config group: [names]}`.

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
        eps = entry_points(group)
        for name in sorted(eps):
            provider = eps[name].dist.name if eps[name].dist is not None else None
            try:
                node = load_entry_point(group, name, eps)
            except ImportError as err:
                if provider == "diffalign":
                    raise
                warnings.warn(f"skipping the {GROUPS.get(group, group)} plugin '{name}' from '{provider}': {err}",
                              stacklevel=2)
                eps.pop(name)
                continue
            if config_group == "reward":
                node = reward_node(node, name)
                for reward_group in REWARD_GROUPS:
                    store.store(group=reward_group, name=name, node=node, package=f"{reward_group}.{name}",
                                provider=provider)
            else:
                store.store(group=config_group, name=name, node=node, package=config_group, provider=provider)
        stored[config_group] = sorted(eps)
    stored["eval_reward"] = stored["reward"]
    return stored
