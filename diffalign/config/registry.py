"""The config options of rewards, models and methods, fed into Hydra's `ConfigStore`: diffalign's own and those of
third-party packages (Python entry points).

diffalign's own components register themselves from their own files, with no list to edit and no re-install: a method
or a reward decorates its config dataclass with `diffalign.config.schemas.config_schema` (``("method", "dgpo")``,
``("reward", "brightness")``), found by importing every module of its package (`diffalign.config.schemas.discover`).
A third-party package adds its rewards, models and methods through the entry-point groups of `GROUPS`
(``[project.entry-points."diffalign.rewards"]``); an entry point's value is a config *dataclass* (cheap to import)
whose ``_target_`` names the component class, imported only when the component is instantiated. Call
`register_configs()` once before composing a config.

Every reward option gets two extra fields besides its config's: ``weight`` (float, default 1.0) and ``normalize``
(``"none"`` or ``"zscore"``), read by `build_rewards` to build the `WeightedSum` (``reward.clip_score.weight=0.5``).
Rewards are stored twice: in the ``reward`` group (training, ``cfg.reward.<name>``) and in the ``eval_reward`` group
(evaluation and hacking monitors, ``cfg.eval_reward.<name>``; when none is selected, evaluation uses ``cfg.reward``).
A one-off reward ``python:<module>:<function>`` is stored by `diffalign.rewards.python_function.register_python_reward`
under the function's name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import warnings
from pathlib import Path

from hydra.core.config_store import ConfigStore

from diffalign.config.schemas import discover, register_schemas

GROUPS = {"diffalign.rewards": "reward", "diffalign.models": "model", "diffalign.methods": "method"}
"""Entry-point group → Hydra config group."""
SAMPLER_OPTIONS = Path(__file__).resolve().parents[1] / "configs" / "sampler"
"""The shipped sampler options (YAML); a plugin's sampler without a file here is stored as an option itself."""
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


def registered_reward_configs() -> dict[str, type]:
    """The rewards registered from their own files, ``{name: config dataclass}``: every config decorated with
    ``config_schema("reward", name)`` in a module of ``diffalign/rewards`` (diffalign's own; a new reward file is found
    without an entry point or a re-install) or in a module imported some other way (e.g. a test module)."""
    return discover().get("reward", {})


def _names_the_same_config(ep: importlib.metadata.EntryPoint, config_class: type) -> bool:
    """Whether entry point `ep` names `config_class` itself (an install made while diffalign still declared its own
    rewards as entry points)."""
    return ep.value.replace(" ", "") == f"{config_class.__module__}:{config_class.__qualname__}"


def _third_party_rewards(builtin: dict[str, type]) -> dict[str, importlib.metadata.EntryPoint]:
    """The ``diffalign.rewards`` entry points that are not diffalign's own rewards.

    Raises:
        ValueError: an entry point takes the name of a built-in reward (both named).
    """
    eps = entry_points("diffalign.rewards")
    for name, ep in list(eps.items()):
        if name in builtin:
            if not _names_the_same_config(ep, builtin[name]):
                provider = ep.dist.name if ep.dist is not None else "<unknown distribution>"
                raise ValueError(f"reward entry point '{name}' = '{ep.value}' of '{provider}' takes the name of "
                                 f"diffalign's reward {builtin[name].__module__}.{builtin[name].__qualname__}; rename "
                                 "the entry point")
            eps.pop(name)
    return eps


def reward_names() -> list[str]:
    """Every reward's name, diffalign's own (`registered_reward_configs`) and the third-party entry points', sorted
    (without loading the entry points)."""
    builtin = registered_reward_configs()
    return sorted({*builtin, *_third_party_rewards(builtin)})


def reward_config(name: str) -> type:
    """The config dataclass of the reward `name`: diffalign's own, else a third-party entry point's (loaded now).

    Raises:
        ValueError: `name` is no reward (the message lists the available ones), or an entry point takes the name of a
            built-in reward.
        ImportError: the entry point cannot be loaded (named, with its value).
    """
    builtin = registered_reward_configs()
    eps = _third_party_rewards(builtin)
    if name in builtin:
        return builtin[name]
    if name not in eps:
        raise ValueError(f"unknown reward '{name}'; available: {sorted({*builtin, *eps})}.")
    return load_entry_point("diffalign.rewards", name, eps)


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
    `diffalign.config.schemas.register_schemas`, among them its own rewards); returns `{config group: [names]}`.

    Rewards are stored with ``package="reward.<name>"`` so that the multi-select ``reward=[a,b]`` composes to
    ``cfg.reward.a`` and ``cfg.reward.b`` (and likewise in the ``eval_reward`` group), each with the extra fields
    ``weight`` and ``normalize``; models and methods use their group as package (``cfg.model``, ``cfg.method``).
    The schemas are stored after the entry points are loaded, so that those a plugin's modules register (a sampler
    with ``@register_sampler``) are among them; a plugin's sampler is also stored as the option ``sampler/<name>``
    (`_store_plugin_samplers`). Calling it again re-stores the same nodes.

    Raises:
        ValueError: if two distributions declare the same name in one group (both are named), an entry point takes
            the name of one of diffalign's own rewards, or a reward config has a field named ``weight`` or
            ``normalize``.
        ImportError: if one of diffalign's own entry points cannot be loaded (named, with its value). A third-party
            plugin that cannot be loaded is skipped with a warning naming it and the error, so one broken package
            does not stop runs that do not use it (selecting it then fails as an unknown option).
    """
    store, stored, plugin_packages = ConfigStore.instance(), {}, set()
    for group, config_group in GROUPS.items():
        registered = registered_reward_configs() if config_group == "reward" else {}
        nodes = {name: (config, config.__module__.split(".")[0]) for name, config in registered.items()}
        eps = _third_party_rewards(registered) if config_group == "reward" else entry_points(group)
        for name in sorted(eps):
            provider = eps[name].dist.name if eps[name].dist is not None else None
            try:
                nodes[name] = (load_entry_point(group, name, eps), provider)
                if provider != "diffalign":
                    plugin_packages.add(eps[name].module.split(".")[0])
            except ImportError as err:
                if provider == "diffalign":
                    raise
                warnings.warn(f"skipping the {GROUPS.get(group, group)} plugin '{name}' from '{provider}': {err}",
                              stacklevel=2)
        for name, (node, provider) in sorted(nodes.items()):
            if config_group == "reward":
                node = reward_node(node, name)
                for reward_group in REWARD_GROUPS:
                    store.store(group=reward_group, name=name, node=node, package=f"{reward_group}.{name}",
                                provider=provider)
            else:
                store.store(group=config_group, name=name, node=node, package=config_group, provider=provider)
        stored[config_group] = sorted(nodes)
    stored["eval_reward"] = stored["reward"]
    # after the entry points: a plugin's module may register schemas too (a sampler: @register_sampler), and those
    # stored before it was imported would be missing (then sampler=<its name> could not be composed)
    schemas = register_schemas()
    _store_plugin_samplers(store, schemas.get("sampler", {}), plugin_packages)
    return stored


def _store_plugin_samplers(store: ConfigStore, samplers: dict[str, type], plugin_packages: set[str]) -> None:
    """Stores each sampler schema registered by a plugin (a module of a package one of whose entry points was loaded,
    `plugin_packages`) and without a shipped YAML option as the option ``sampler/<name>`` itself, so ``sampler=<name>``
    (and ``sampler@eval.sampler=<name>``) selects it with the schema's defaults. Other modules' samplers (a test
    module's) keep their own YAML option on Hydra's search path: a ConfigStore node of the same name would be matched
    to it as its schema (Hydra's deprecated automatic schema matching)."""
    for name, cls in samplers.items():
        if cls.__module__.split(".")[0] in plugin_packages and not (SAMPLER_OPTIONS / f"{name}.yaml").is_file():
            store.store(group="sampler", name=name, node=cls, provider=cls.__module__.split(".")[0])
