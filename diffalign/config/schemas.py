"""The structured configs (Hydra schemas) of diffalign's own config groups, registered by each component's own file.

A dataclass decorated with `config_schema` beside its component::

    @config_schema("method", "dgpo")
    @dataclass
    class DGPOConfig:
        _target_: str = "diffalign.objectives.dgpo.DGPO"
        beta: float = 100.0
        ...

is stored in Hydra's `ConfigStore` as ``schema/method/dgpo``. A YAML option ``configs/<group>/<option>.yaml`` extends a
schema of its group (the first entry of its defaults list, ``/schema/<group>/<name>@_here_``) and sets only what
differs from it, so the dataclass holds every field's type and default and Hydra type-checks every override.

Discovery: `register_schemas` imports every module of `SCHEMA_PACKAGES` (so a new file there registers its own schema:
a new method is its objective file and its YAML option, with no list to edit) and stores every schema registered so
far, also those of modules imported some other way (a plugin, a test module). Plugins outside the package use the
entry points of `diffalign.config.registry` instead. Every command imports these modules before it can say a config
mistake, so none of them imports a model library (diffusers, transformers, peft, torchvision: seconds each) at its
top; those come with the models, imported where they are used (`diffalign.samplers.base.randn_tensor`, the lazy
`diffalign.models` package; tests/unit/config/test_startup.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

SCHEMA_PACKAGES = ("diffalign.objectives", "diffalign.data", "diffalign.reference", "diffalign.samplers",
                   "diffalign.train", "diffalign.evaluation", "diffalign.models.checks", "diffalign.rewards")
"""Packages (every module in them) and modules imported to find the `config_schema` registrations and the components'
config checks (`diffalign.config.checks.node_check`)."""

_REGISTRY: dict[str, dict[str, type]] = {}


def config_schema(group: str, name: str) -> Callable[[type], type]:
    """Class decorator: registers a dataclass as the schema ``schema/<group>/<name>`` (stored by `register_schemas`).

    Raises:
        TypeError: if the class is not a dataclass.
        ValueError: if another class already holds ``<group>/<name>`` (both named).
    """

    def register(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"config_schema({group!r}, {name!r}): {cls.__qualname__} is not a dataclass; decorate it "
                            "with @dataclass first (below @config_schema)")
        options = _REGISTRY.setdefault(group, {})
        held = options.get(name)
        if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"schema {group}/{name} is registered by both {held.__module__}.{held.__qualname__} and "
                             f"{cls.__module__}.{cls.__qualname__}; rename one")
        options[name] = cls
        return cls

    return register


def discover() -> dict[str, dict[str, type]]:
    """Imports every module of `SCHEMA_PACKAGES` and returns the registered schemas, ``{group: {name: dataclass}}``."""
    for package_name in SCHEMA_PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(getattr(package, "__path__", [])):
            importlib.import_module(f"{package_name}.{module.name}")
    return {group: dict(options) for group, options in _REGISTRY.items()}


def register_schemas() -> dict[str, dict[str, type]]:
    """Stores every schema (`discover`) in Hydra's `ConfigStore` as ``schema/<group>/<name>``; returns them."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    found = discover()
    for group, options in found.items():
        for name, cls in options.items():
            store.store(group=f"schema/{group}", name=name, node=cls, provider="diffalign")
    return found
