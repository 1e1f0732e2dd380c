"""Old config keys kept working for one release, in one place: `migrate_config`.

A structured config (`diffalign.config.schemas`) declares its deprecated keys itself: a field made with
`diffalign.config.schemas.deprecated` is an alias of a renamed key (or a dropped one), a field made with
`diffalign.config.schemas.deprecated_values` has old values that map to new ones. `migrate_config`, run on the composed
config by the commands (`diffalign.cli`) and by the training loops, moves every alias that is set to its new key with
a `FutureWarning` naming the old key, the new key and the value carried over, and drops the aliases, so the rest of
the package reads only the new names. Setting an old key and its new key together is an error naming both.

The renames (until 0.3; docs/methods/algorithms.md#renamed-config-keys):

- ``method.num_train_timesteps`` (DGPO's M timesteps per epoch, the released code's name, which in diffusers is the
  1000-step training schedule) → ``method.timesteps_per_epoch``.

The old sampler keys (``sampler.eta`` of a flow SDE, ``sampler.sde_type``, ``sampler.name=sde`` / ``dpm_solver`` /
``euler``) are no longer migrated: the sampler options (`diffalign.samplers.base`) refuse them.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf, open_dict

from diffalign.config.checks import check_structured_keys


def override_keys(overrides: Iterable[str]) -> set[str]:
    """The config keys set by command-line overrides (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b``)."""
    return {item.split("=", 1)[0].lstrip("+~") for item in overrides}


def migrate_config(cfg: DictConfig, overrides: Iterable[str] = ()) -> DictConfig:
    """Moves the deprecated keys of every top-level node of `cfg` whose schema declares some (in place; returns
    `cfg`). A no-op on a config without them, so calling it twice is harmless.

    Args:
        cfg (`DictConfig`): a composed config.
        overrides (`Iterable[str]`): the command-line overrides (Hydra's ``overrides.task``), to tell a new key set by
            the user from one set by a config file.

    Warns:
        FutureWarning: for each old key or value used, naming its replacement and the value carried over.

    Raises:
        ValueError: when an old key and its new key are both set on the command line (both named), or a structured
            node holds a key its schema does not have (`diffalign.config.checks.check_structured_keys`).
    """
    check_structured_keys(cfg)  # a key added with + that no schema has (it would break the re-typing below)
    given = override_keys(overrides)
    for group in list(cfg.keys()):
        node = cfg._get_node(group)
        if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
            continue
        schema = OmegaConf.get_type(node)
        if not dataclasses.is_dataclass(schema):
            continue
        fields = dataclasses.fields(schema)
        aliases = [f for f in fields if "deprecated" in f.metadata]
        if not aliases and not any("deprecated_values" in f.metadata for f in fields):
            continue
        values = OmegaConf.to_container(node, resolve=False)
        _migrate_values(group, fields, values, cfg)
        for f in aliases:
            _migrate_alias(group, f, values, cfg, given)
        if aliases:  # the node without its aliases (they would reach the component's constructor), still typed
            with open_dict(cfg):
                cfg[group] = OmegaConf.merge(OmegaConf.structured(_current(schema)), values)
    return cfg


@functools.cache
def _current(schema: type) -> type:
    """`schema` without its deprecated aliases: a dataclass of the same name, module, fields (types and defaults) in
    the same order, so the migrated node keeps Hydra's type checks."""
    fields = []
    for f in dataclasses.fields(schema):
        if "deprecated" in f.metadata:
            continue
        default = (dataclasses.field(default_factory=f.default_factory) if f.default is dataclasses.MISSING
                   and f.default_factory is not dataclasses.MISSING else dataclasses.field(default=f.default))
        fields.append((f.name, f.type, default))
    return dataclasses.make_dataclass(schema.__name__, fields, namespace={"__module__": schema.__module__,
                                                                         "__qualname__": schema.__qualname__,
                                                                         "__doc__": schema.__doc__})


def _warn(message: str) -> None:
    warnings.warn(message, FutureWarning, stacklevel=3)


def _migrate_values(group: str, fields, values: dict, cfg: DictConfig) -> None:
    for f in fields:
        mapping = f.metadata.get("deprecated_values")
        if mapping is None:
            continue
        new = mapping(values.get(f.name), values, cfg)
        if new is not None:
            _warn(f"{group}.{f.name}={values[f.name]!r} is deprecated and will not be accepted from diffalign 0.3: "
                  f"using {group}.{f.name}={new!r}")
            values[f.name] = new


def _migrate_alias(group: str, f, values: dict, cfg: DictConfig, given: set[str]) -> None:
    info = f.metadata["deprecated"]
    value = values.pop(f.name, None)
    if value is None:
        return
    old_key = f"{group}.{f.name}"
    if info["renamed_to"] is None:
        _warn(f"{old_key}={value!r} is deprecated and ignored ({info['note']}); remove it (it is refused from "
              f"diffalign {info['remove_in']})")
        return
    new_key = f"{group}.{info['renamed_to']}"
    if new_key in given:
        raise ValueError(f"{old_key} and {new_key} are both set; {old_key} is the old name of {new_key}: set only "
                         f"{new_key}")
    new = info["convert"](value, values, cfg) if info["convert"] is not None else value
    _warn(f"{old_key} is deprecated and will be removed in diffalign {info['remove_in']}: use {new_key} instead; "
          f"using {new_key}={new!r}{info['note']}")
    values[info["renamed_to"]] = new
