"""Field checks that the components' ``check_config`` share: integers that are integers, numbers in their range, one of
a list of names, booleans, prompt files, seeds.

Every check reads ``node[key]`` of a composed config, does nothing when the key is absent (a component's own YAML may
not have it), and raises `ConfigError` (a `ValueError`) naming the field as ``<prefix>.<key>``, the value it got and
the fix; `diffalign.config.validation.validate_train_config` runs them before any model loads and the CLI prints the
message as ``diffalign: error: …``. A type that Hydra checks already (fields of the structured configs beside the
methods, data sets and reference strategies) fails earlier, at composition, with Hydra's own message naming
``full_key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

SEED_MAX = 2**32 - 1
"""The largest seed: `accelerate.utils.set_seed` seeds numpy, whose legacy seed is an unsigned 32-bit integer."""


class ConfigError(ValueError):
    """A setting of the run config is wrong; the message names the field, what it got and the fix."""


def _absent(node, key: str) -> bool:
    return node is None or key not in node


def _name(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _say(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _bound_text(ge=None, gt=None, le=None, lt=None) -> str:
    if ge is not None and le is not None and gt is None and lt is None:
        return f"in [{ge}, {le}]"
    parts = [f">= {ge}" if ge is not None else None, f"> {gt}" if gt is not None else None,
             f"<= {le}" if le is not None else None, f"< {lt}" if lt is not None else None]
    return " and ".join(p for p in parts if p)


def _in_bounds(value, ge=None, gt=None, le=None, lt=None) -> bool:
    return ((ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le)
            and (lt is None or value < lt))


def _present(node, key: str, prefix: str, nullable: bool, hint: str):
    """``(value, field name, hint tail)`` of a field to check, or None when it is absent or an allowed null."""
    if _absent(node, key):
        return None
    value = node[key]
    if value is None and nullable:
        return None
    return value, _name(prefix, key), f"; {hint}" if hint else ""


def integer(node, key: str, prefix: str, *, ge: int | None = None, le: int | None = None, nullable: bool = False,
            hint: str = "") -> None:
    """``<prefix>.<key>`` is an integer (not a float such as 2.5 or 1e3, not a bool) within [`ge`, `le`], or null when
    `nullable`.

    Raises:
        ConfigError: naming the field, the value and the fix (`hint` is appended).
    """
    field = _present(node, key, prefix, nullable, hint)
    if field is None:
        return
    value, name, tail = field
    wanted = "an integer" + (f" {_bound_text(ge=ge, le=le)}" if ge is not None or le is not None else "")
    wanted += " or null" if nullable else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            raise ConfigError(f"{name} must be {wanted}, got {value} (a float); write {name}={int(value)}{tail}")
        raise ConfigError(f"{name} must be {wanted}, got {_say(value)} ({type(value).__name__}){tail}")
    if not _in_bounds(value, ge=ge, le=le):
        raise ConfigError(f"{name} must be {wanted}, got {value}{tail}")


def number(node, key: str, prefix: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, nullable: bool = False, hint: str = "") -> None:
    """``<prefix>.<key>`` is a finite real number (an int is fine) within the given bounds, or null when `nullable`.

    Raises:
        ConfigError: naming the field, the value and the fix (`hint` is appended).
    """
    field = _present(node, key, prefix, nullable, hint)
    if field is None:
        return
    value, name, tail = field
    bounds = _bound_text(ge=ge, gt=gt, le=le, lt=lt)
    wanted = "a number" + (f" {bounds}" if bounds else "") + (" or null" if nullable else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{name} must be {wanted}, got {_say(value)} ({type(value).__name__}){tail}")
    if not _in_bounds(value, ge=ge, gt=gt, le=le, lt=lt):
        raise ConfigError(f"{name} must be {wanted}, got {value}{tail}")


def choice(node, key: str, prefix: str, choices, *, nullable: bool = False, hint: str = "") -> None:
    """``<prefix>.<key>`` is one of `choices` (or null when `nullable`).

    Raises:
        ConfigError: naming the field, the value and the valid choices.
    """
    if _absent(node, key):
        return
    value = node[key]
    if (value is None and nullable) or (value in tuple(choices) and not isinstance(value, bool)):
        return
    valid = ", ".join(repr(c) if isinstance(c, str) else str(c) for c in choices) + (", null" if nullable else "")
    raise ConfigError(f"{_name(prefix, key)}={_say(value)} must be one of ({valid})"
                      f"{'; ' + hint if hint else ''}")


def boolean(node, key: str, prefix: str, *, nullable: bool = False) -> None:
    """``<prefix>.<key>`` is true or false (a string such as "no" would count as true).

    Raises:
        ConfigError: naming the field and the value.
    """
    if _absent(node, key):
        return
    value = node[key]
    if isinstance(value, bool) or (value is None and nullable):
        return
    raise ConfigError(f"{_name(prefix, key)} must be true or false{' or null' if nullable else ''}, got {_say(value)} "
                      f"({type(value).__name__})")


def text(node, key: str, prefix: str, *, nullable: bool = False, hint: str = "") -> None:
    """``<prefix>.<key>`` is a non-empty string (or null when `nullable`).

    Raises:
        ConfigError: naming the field and the value.
    """
    if _absent(node, key):
        return
    value = node[key]
    if (value is None and nullable) or (isinstance(value, str) and value.strip()):
        return
    nullable_text = " or null" if nullable else ""
    raise ConfigError(f"{_name(prefix, key)} must be a non-empty string{nullable_text}, got {_say(value)}"
                      f"{'; ' + hint if hint else ''}")


def seed(node, key: str, prefix: str) -> None:
    """``<prefix>.<key>`` is a seed: an integer in [0, 2**32 - 1] (numpy's legacy seeding, which
    `accelerate.utils.set_seed` calls, refuses anything else).

    Raises:
        ConfigError: naming the field and the range.
    """
    integer(node, key, prefix, ge=0, le=SEED_MAX, hint="numpy seeds only these, e.g. 0")


def int_list(node, key: str, prefix: str, *, ge: int | None = None, min_length: int = 0, hint: str = "",
             unique: bool = False) -> None:
    """``<prefix>.<key>`` is a list of integers each >= `ge`, with at least `min_length` entries, all different when
    `unique` (seeds: a repeated one counts the same sample twice).

    Raises:
        ConfigError: naming the field and the offending entry.
    """
    if _absent(node, key):
        return
    values = node[key]
    name, tail = _name(prefix, key), f"; {hint}" if hint else ""
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ConfigError(f"{name} must be a list of integers, e.g. {name}=[0,1], got {_say(values)}{tail}")
    values = list(values)
    if len(values) < min_length:
        raise ConfigError(f"{name} needs at least {min_length} entries, got {values}{tail}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (ge is not None and value < ge):
            raise ConfigError(f"{name}={values}: every entry must be an integer{f' >= {ge}' if ge is not None else ''}"
                              f", got {_say(value)}{tail}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if unique and repeated:
        kept = ",".join(str(v) for v in dict.fromkeys(values))
        raise ConfigError(f"{name}={values} repeats {repeated}: each seed's samples would count twice (standard errors "
                          f"too small, images overwriting each other); pass distinct seeds, e.g. {name}=[{kept}]")

_NODE_CHECKS: dict[str, Callable] = {}


def node_check(node: str) -> Callable[[Callable], Callable]:
    """Function decorator: registers the check of the run config's `node`, run by
    `diffalign.config.validation.validate_train_config` before any model loads.

    A component's checks sit beside its fields (``diffalign/<component>/checks.py``) and register themselves here, so
    validation runs them without importing the component (the component imports `diffalign.config`, never the
    reverse). The modules are imported by `diffalign.config.schemas.discover`. The nodes and how validation calls
    their checks:

    ====================  =========================================================================================
    node                  call
    ====================  =========================================================================================
    ``"trainer"``         ``check(cfg, online=...)`` (`diffalign.train.checks.check_trainer_config`)
    ``"overrides"``       ``check(overrides, online=...)``: command-line overrides a loop would ignore
    ``"online"``          ``check(cfg)``, online methods only
    ``"sampler"``         ``check(cfg, flow_matching=..., online=...)`` (`diffalign.samplers.checks`)
    ``"sampler_node"``    ``check(node, where, flow_matching=..., model=...)``: ``eval.sampler``, ``monitor.sampler``
    ``"model"``           ``check(cfg)`` (`diffalign.models.checks`)
    ``"reward"``          ``check(node, prefix)``, once per selected reward (`diffalign.rewards.checks`)
    ====================  =========================================================================================

    Raises:
        ValueError: if another function already holds `node` (both named).
    """

    def register(check: Callable) -> Callable:
        held = _NODE_CHECKS.get(node)
        if held is not None and (held.__module__, held.__qualname__) != (check.__module__, check.__qualname__):
            raise ValueError(f"node check {node!r} is registered by both {held.__module__}.{held.__qualname__} and "
                             f"{check.__module__}.{check.__qualname__}; keep one")
        _NODE_CHECKS[node] = check
        return check

    return register


def registered_check(node: str) -> Callable:
    """The check registered for `node` (`node_check`), importing the components' modules first when it is not yet
    registered (`diffalign.config.schemas.discover`).

    Raises:
        LookupError: no module registers a check of `node`.
    """
    if node not in _NODE_CHECKS:
        from diffalign.config.schemas import discover

        discover()
    if node not in _NODE_CHECKS:
        raise LookupError(f"no check of the config node {node!r} is registered (diffalign.config.checks.node_check); "
                          f"registered: {sorted(_NODE_CHECKS)}")
    return _NODE_CHECKS[node]


RENAMED_KEYS = {
    "trainer.learning_rate": "trainer.optimizer.lr",
    "trainer.adam_beta1": "trainer.optimizer.betas (the first of the two, e.g. trainer.optimizer.betas=[0.9,0.999])",
    "trainer.adam_beta2": "trainer.optimizer.betas (the second of the two, e.g. trainer.optimizer.betas=[0.9,0.999])",
    "trainer.adam_weight_decay": "trainer.optimizer.weight_decay",
    "trainer.adam_epsilon": "trainer.optimizer.eps",
    "eval.num_inference_steps": "eval.sampler.num_inference_steps",
    "eval.guidance_scale": "eval.sampler.guidance_scale",
    "eval.eta": ("the sampler with its noise: sampler@eval.sampler=ddim eval.sampler.eta=<eta> for an eps/v model, "
                 "sampler@eval.sampler=flow_sde eval.sampler.noise_level=<a> for a flow model (the default, "
                 "sampler@eval.sampler=ode, is eta 0 for both)"),
    "monitor.num_inference_steps": "monitor.sampler.num_inference_steps",
    "monitor.guidance_scale": "monitor.sampler.guidance_scale",
}
"""Removed keys and what replaced each: refused with the new name (`check_renamed_keys`, `check_structured_keys`,
`check_node_keys`), never migrated. The optimizer became the ``trainer.optimizer`` node; evaluation and the monitors
sample with a sampler node (``eval.sampler``, ``monitor.sampler``)."""

_RENAMED_WHY = {
    "trainer": "the optimizer is the trainer.optimizer node; docs/guides/configuration.md#optimizer",
    "eval": "evaluation samples with the sampler node eval.sampler; docs/guides/evaluation.md",
    "monitor": "the monitors sample with the sampler node monitor.sampler; docs/guides/samplers.md",
}


def renamed_key_error(key: str) -> ConfigError:
    """The error for a removed key of `RENAMED_KEYS`: one line naming what replaced it."""
    return ConfigError(f"{key} was renamed: set {RENAMED_KEYS[key]} instead ({_RENAMED_WHY[key.split('.')[0]]})")


def check_renamed_keys(overrides) -> None:
    """Refuses command-line overrides (``key=value``, ``+key=value``, ``~key``) of a removed key of `RENAMED_KEYS`
    before Hydra composes (Hydra's own message would suggest adding the old key with ``+``).

    Raises:
        ConfigError: naming the new key.
    """
    for override in overrides:
        key = str(override).lstrip("+~").partition("=")[0]
        if key in RENAMED_KEYS:
            raise renamed_key_error(key)


RUN_MODEL_KEYS = ("init_lora",)
"""Keys configs/train.yaml adds to every ``model`` node, read by diffalign and taken out before the model is built
(`diffalign.lora.initial.model_config`): accepted on a model plugin's structured node (a ``diffalign.models`` entry
point's dataclass), which does not declare them."""


def check_structured_keys(cfg: DictConfig) -> None:
    """Refuses a key that a structured config node (``trainer``, ``online``, ``sampler``, ``eval``, ``data``,
    ``reference``, a method's or a reward's schema) does not have. Hydra refuses ``trainer.max_step=2`` itself, but
    its message suggests ``+trainer.max_step=2``, which adds the key and would otherwise run with it ignored.

    Raises:
        ConfigError: naming the key, the closest real keys and the fix.
    """
    for group, node in cfg.items():
        nodes = [(str(group), node)]
        if isinstance(node, DictConfig) and not dataclasses.is_dataclass(OmegaConf.get_type(node)):
            nodes = [(f"{group}.{k}", node[k]) for k in node  # reward.<name>: one schema per entry
                     if not OmegaConf.is_missing(node, k)]  # (a ``???`` value: its own check names it)
        for name, sub in nodes:
            if not isinstance(sub, DictConfig):
                continue
            schema = OmegaConf.get_type(sub)
            if dataclasses.is_dataclass(schema):
                check_node_keys(sub, name, schema, also=RUN_MODEL_KEYS if name == "model" else ())


def target_modality(target: str | None) -> str | None:
    """``"image"`` / ``"video"``: the ``modality`` class attribute of what a config's ``_target_`` builds (a class, a
    classmethod such as ``StableDiffusionPolicy.from_pretrained``, or a builder function annotated with the class it
    returns); None when it does not say (e.g. a plugin without the attribute) or cannot be imported."""
    return target_attribute(target, "modality")


def target_attribute(target: str | None, name: str):
    """Class attribute `name` of what a config's ``_target_`` builds (see `target_modality`); None when unknown."""
    if not target:
        return None
    import inspect
    import typing

    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 - an unimportable target is reported by instantiate, with its own message
        return None
    owner = obj.__self__ if inspect.ismethod(obj) and inspect.isclass(obj.__self__) else obj
    if not inspect.isclass(owner):
        try:
            owner = typing.get_type_hints(obj).get("return")
        except Exception:  # noqa: BLE001 - unresolvable annotations: the target does not say
            return None
    return getattr(owner, name, None) if inspect.isclass(owner) else None


LAUNCH_GROUPS = {"accelerate": "accelerate launch --config_file configs/accelerate/{option}.yaml -m diffalign.cli ..."}
"""Config folders that are not settings of a run (``diffalign-train --help`` lists them as groups) and how to use them."""


def _closest(key: str, known) -> str:
    close = difflib.get_close_matches(str(key), sorted(known), n=3)
    return f"did you mean {', '.join(close)}? " if close else ""


def check_top_level_keys(cfg: DictConfig, known, source: str = "train.yaml") -> None:
    """Refuses a top-level key of `cfg` that the primary config (`source`) does not have: ``+output=runs/x`` or
    ``+resume_from=...`` would add a key nothing reads, so the run would go on with the default. A launch config
    group added with ``+accelerate=fsdp`` gets the command that applies it.

    Args:
        known (`Iterable[str]`): the primary config's keys and config groups.

    Raises:
        ConfigError: naming the key, the closest real ones and the fix.
    """
    known = set(known)
    for key in cfg:
        if key in known:
            continue
        key = str(key)
        if key in LAUNCH_GROUPS:
            option = (cfg[key] or {}).get("distributed_type", "<option>") if isinstance(cfg[key], DictConfig) else key
            option = {"FSDP": "fsdp", "MULTI_GPU": "ddp", "DEEPSPEED": "deepspeed_zero2"}.get(str(option), option)
            raise ConfigError(f"+{key}=... is not a setting of the run: configs/{key}/ holds launch configs for "
                              f"`accelerate launch`, which the run cannot switch on by itself (it would run one "
                              f"process as before); drop +{key}=... and launch with "
                              f"`{LAUNCH_GROUPS[key].format(option=option)}` (docs/guides/reliability.md#distributed)")
        raise ConfigError(f"{key} is not a setting of {source}; {_closest(key, known)}drop +{key}=... (a + adds a key "
                          f"the run would ignore). Its settings: {', '.join(sorted(known))}")


def check_node_keys(node, name: str, schema: type, also: tuple[str, ...] = ()) -> None:
    """Refuses a key of config node `name` that its dataclass `schema` does not have (nor `also`), e.g.
    ``+monitor.evry=1`` on a plain node (it would otherwise crash or be ignored after the model loads) or a key added
    with ``+`` to a structured one (`check_structured_keys`); a key of `RENAMED_KEYS` names its new key.

    Raises:
        ConfigError: naming the key, the closest real ones and the fix.
    """
    if not isinstance(node, DictConfig):
        return
    fields = {f.name for f in dataclasses.fields(schema)} | set(also)
    for key in node:
        if f"{name}.{key}" in RENAMED_KEYS:
            raise renamed_key_error(f"{name}.{key}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=3)
            hint = f"did you mean {', '.join(f'{name}.{c}' for c in close)}? " if close else ""
            raise ConfigError(f"{name}.{key} is not a setting of {name} ({schema.__name__}); {hint}drop "
                              f"+{name}.{key}=... (a + adds a key the run would ignore). Its settings: "
                              f"{', '.join(sorted(fields))}")
