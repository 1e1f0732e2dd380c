"""The structured configs (`diffalign.config.schemas`, registered by each component's file) are the source of truth of
their groups' types and defaults: each mirrors its component's `__init__` (or is the one argument its component is built
from, as the methods are), each YAML option extends its schema and sets only what differs from it, and Hydra
type-checks overrides against it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import yaml
from conftest import compose_cfg
from hydra.errors import ConfigCompositionException
from hydra.utils import get_class

from diffalign.config.compose import CONFIG_DIR
from diffalign.config.schemas import discover

SCHEMAS = {group: {name: cls for name, cls in options.items() if cls.__module__.startswith("diffalign.")}
           for group, options in discover().items()
           if group != "reward"}  # (diffalign's own; test modules register others. A reward's config is its option
# itself, with no YAML option: tests/unit/config/test_plugins.py checks its fields against the reward's __init__)
OPTIONS = [(group, name) for group, options in SCHEMAS.items() for name in options]


def schema(group: str, name: str) -> type:
    return SCHEMAS[group][name]


def defaults(config: type) -> dict:
    """Each field's default (``default_factory`` called)."""
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(config)}


BUILT = [(group, name) for group, name in OPTIONS if "_target_" in defaults(schema(group, name))]


@pytest.mark.parametrize("group,name", BUILT)
def test_schema_fields_mirror_the_components_init(group, name):
    config = schema(group, name)
    fields = {k: v for k, v in defaults(config).items() if k != "_target_"}
    params = {k: p for k, p in inspect.signature(get_class(config._target_).__init__).parameters.items()
              if k != "self"}
    if list(params) == ["config", "fields"]:  # built from its config object (a method: diffalign.methods.method_config)
        assert params["config"].annotation == f"{config.__name__} | None", (group, name)
        return
    assert list(fields) == list(params), (group, name)
    for key, param in params.items():
        default = fields[key]
        if param.default is inspect.Parameter.empty:
            assert default == "???", (group, name, key)  # required: Hydra's MISSING
        else:
            expected = list(param.default) if isinstance(param.default, tuple) else param.default  # (YAML: lists)
            assert default == expected, (group, name, key)


@pytest.mark.parametrize("group,name", OPTIONS)
def test_yaml_options_extend_their_schema_and_set_only_what_differs(group, name):
    raw = yaml.safe_load((Path(CONFIG_DIR) / group / f"{name}.yaml").read_text())
    first, *nested, last = raw["defaults"]
    assert (first, last) == (f"/schema/{group}/{name}@_here_", "_self_")
    # between them only nodes of another group placed under a field of the schema (data.sampler: /sampler@sampler)
    assert all(len(entry) == 1 and next(iter(entry)).split("@")[1] in defaults(schema(group, name))
               for entry in nested), nested
    schema_defaults = defaults(schema(group, name))
    for key, value in raw.items():
        if key != "defaults":
            assert key in schema_defaults and value != schema_defaults[key], (group, name, key)


def test_yaml_options_are_exactly_the_schemas():
    for group, options in SCHEMAS.items():
        yaml_options = {p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml")}
        derived = {o for o in yaml_options if o not in options}  # options that extend another option (e.g. *_tiny)
        for option in derived:
            assert yaml.safe_load((Path(CONFIG_DIR) / group / f"{option}.yaml").read_text())["defaults"][0] in options
        assert set(options) <= yaml_options, group


@pytest.mark.parametrize("overrides", [
    ["method.beta=abc"], ["method=dgpo", "method.timesteps_per_epoch=1.5"], ["reference=ema", "reference.decay=fast"],
    ["trainer.max_steps=many"], ["online.group_size=1.5"], ["eval.enabled=maybe"],
    ["sampler=flow_sde", "sampler.noise_level=high"], ["sampler=ddim", "sampler.eta=fast"],
])
def test_overrides_are_type_checked_by_hydra(overrides):
    compose_cfg(overrides[:-1] + [overrides[-1].split("=")[0] + "=1"])  # the key exists there
    with pytest.raises(ConfigCompositionException):
        compose_cfg(overrides)


def test_a_key_of_another_sampler_option_is_refused():
    with pytest.raises(ConfigCompositionException):
        compose_cfg(["sampler=ddim", "sampler.noise_level=0.5"])  # the flow SDEs' field, not DDIM's


def test_a_default_comes_from_the_schema_and_an_option_overrides_it():
    dgpo = compose_cfg(["method=dgpo"]).method
    assert dgpo.old_policy_switch_step == 200 and dgpo.beta_kl == 0.02  # schema default; the YAML's override
    assert compose_cfg(["method=diffusion_dpo_tiny"]).method.beta == 1000.0
    assert compose_cfg(["reference=pool", "seed=7"]).reference.seed == 7
