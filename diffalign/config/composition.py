"""One line for a config mistake that Hydra finds while composing: a key a node does not have
(``trainer.max_step=2``), a value of the wrong type (``trainer.max_steps=two``, ``eval.seeds=3``), an option a config
group does not have (``recipe=tiny_dpoo``, ``method=diffusion-dpo``), and a key that a config file sets but the
option selected on the command line does not have (``recipe=tiny_ddpo`` sets ``sampler.eta``; ``sampler=flow_sde``
has none).

Hydra reports these in several lines whose advice is wrong for diffalign (``To append to your config use
+trainer.max_step=2``: the run then refuses the added key). `composition_error` composes the config once with Hydra's
compose API, before ``hydra.main`` composes it again, only to catch these errors; `describe_composition_error` turns
Hydra's `ConfigCompositionException` / `MissingConfigException` and OmegaConf's `ConfigKeyError` / `ValidationError`
(which carry ``full_key`` and ``object_type``) into one line naming the key or option, the closest real ones
(`difflib`, as `diffalign.config.checks.check_node_keys`) and the fix. An error it cannot name is left to Hydra.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path

from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from diffalign.config.compose import CONFIG_DIR
from diffalign.config.schemas import discover

_PLAIN_RUN_FLAGS = ("help", "hydra_help", "multirun", "info", "shell_completion", "experimental_rerun", "config_path",
                    "config_name", "config_dir")
"""Hydra command-line flags under which no single composition of the shipped config is checked (``--help``, ``-m``,
``--info``, ``-cn`` ...): ``hydra.main`` handles them as before."""


def run_overrides(argv: list[str]) -> list[str] | None:
    """The overrides of a command line that composes the shipped config once (a run, also with ``--cfg job``), as
    ``hydra.main`` parses them; None for a command line this check leaves to Hydra: ``HYDRA_FULL_ERROR=1`` in the
    environment (the user asks for Hydra's own error), ``--help``, ``--hydra-help``, ``-m`` (a sweep composes once per
    job), ``--info``, ``--config-name`` / ``--config-dir`` / ``--config-path``, or a command line Hydra's parser
    refuses."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return None
    from hydra._internal.utils import get_args_parser

    try:
        args = get_args_parser().parse_args(argv)
    except (SystemExit, Exception):  # noqa: BLE001 - (--version, a bad flag: Hydra's parser says it)
        return None
    if any(getattr(args, flag, None) for flag in _PLAIN_RUN_FLAGS):
        return None
    return list(args.overrides)


def composition_error(config_name: str, overrides: list[str]) -> str | None:
    """Composes the shipped config `config_name` (``train``, ``evaluate``) with `overrides` as ``hydra.main`` would
    (same config folder, config name and overrides; `diffalign.config.compose.setup_hydra` must have run), and
    returns the one-line message for a composition error `describe_composition_error` can name; None when the config
    composes, or for any other error (Hydra reports it when it composes the config itself).

    Args:
        config_name (`str`): the primary config's name (without ``.yaml``).
        overrides (`list[str]`): the command line's overrides (`run_overrides`).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # (inside a Hydra app or another compose: not ours to reset)
        return None
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            compose(config_name=config_name, overrides=list(overrides))
    except Exception as err:  # noqa: BLE001 - anything not named below is left to hydra.main, which reports it
        try:
            return describe_composition_error(err, overrides, config_name)
        except Exception:  # noqa: BLE001 - a message that cannot be made leaves Hydra's own
            return None
    return None


def describe_composition_error(err: BaseException, overrides: list[str], config_name: str = "train") -> str | None:
    """One line for a Hydra composition error, or None when it is not one of these:

    - an unknown option of a config group (`MissingConfigException` with the group's options): ``recipe=tiny_dpoo is
      not an option of recipe; did you mean tiny_dpo? pass recipe=tiny_dpo (the options: ...)``;
    - a key a node does not have (``Could not override 'trainer.max_step'``, an OmegaConf `ConfigKeyError` /
      `ConfigAttributeError`): ``trainer.max_step is not a setting of trainer (TrainerConfig); did you mean
      trainer.max_steps? pass trainer.max_steps=2 ...``; a sampler node's message says ``is not a field of
      sampler=<option>`` and names the option's noise parameter;
    - a value of the wrong type (``Error merging override trainer.max_steps=two``, an OmegaConf `ValidationError`):
      ``trainer.max_steps=two: trainer.max_steps must be an integer, got 'two' (TrainerConfig.max_steps: int); pass
      e.g. trainer.max_steps=1000``;
    - either of the last two set by a config file rather than the command line (``In 'recipe/tiny_ddpo': ...``): the
      message names the file (``configs/recipe/tiny_ddpo.yaml sets sampler.eta, which is not a field of
      sampler=flow_sde ...``).

    Args:
        err: the exception raised by Hydra's ``compose``.
        overrides (`list[str]`): the command line's overrides (to name the one at fault as the user wrote it).
        config_name (`str`): the primary config (a top-level key is named as a setting of ``<config_name>.yaml``).
    """
    from hydra.errors import ConfigCompositionException, MissingConfigException

    if isinstance(err, MissingConfigException):
        return _missing_option(err, overrides)
    if not isinstance(err, ConfigCompositionException):
        return None
    cause = err.__cause__ or err.__context__
    if not isinstance(cause, OmegaConfBaseException) or not getattr(cause, "full_key", None):
        return None
    text = str(err)
    merging = re.match(r"Error merging override (.+)$", text.splitlines()[0]) if text else None
    in_file = re.match(r"In '([^']+)': ", text) or re.match(r"Error merging '([^']+)' with schema", text)
    full_key = str(cause.full_key)
    override = merging.group(1) if merging else _override_of(full_key, overrides)
    source = None if override is not None or in_file is None else _config_file(in_file.group(1))
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key(cause, full_key, override, source, f"{config_name}.yaml")
    if isinstance(cause, ValidationError):
        return _bad_value(cause, full_key, override, source)
    return None


def _missing_option(err, overrides: list[str]) -> str | None:
    """``recipe=tiny_dpoo is not an option of recipe; did you mean tiny_dpo? ...`` for Hydra's "Could not find
    'recipe/tiny_dpoo'"; the option as the user selected it (``sampler@data.sampler=...``), or the config file whose
    defaults list selects it. None for a missing config that is not an option of a group."""
    options = list(getattr(err, "options", None) or [])
    missing = getattr(err, "missing_cfg_file", None)
    if not options or not missing or "/" not in str(missing):
        return None
    group, _, name = str(missing).rpartition("/")
    select = None
    for override in overrides:
        key, sep, value = str(override).lstrip("+~").partition("=")
        if sep and key.split("@")[0] == group and name in [v.strip() for v in value.strip("[] ").split(",")]:
            select = key
            break
    close = _closest(name, options)
    listed = f"(the options: {', '.join(sorted(options))})"
    if select is None:
        parent = re.match(r"In '([^']+)': ", str(err))
        where = _config_file(parent.group(1)) if parent else "a config file"
        fix = f"did you mean {', '.join(close)}? select {group}: {close[0]} there" if close else "select one there"
        return f"{where} selects {group}={name}, which is not an option of {group}; {fix} {listed}"
    fix = f"did you mean {', '.join(close)}? pass {select}={close[0]}" if close else f"pass {select}=<option>"
    return f"{select}={name} is not an option of {group}; {fix} {listed}"


def _override_of(full_key: str, overrides: list[str]) -> str | None:
    """The command-line override of `full_key` (``key=value``, ``+key=value``, ``++key=value``), or None."""
    for override in overrides:
        key, sep, _ = str(override).lstrip("+~").partition("=")
        if sep and key == full_key:
            return str(override).lstrip("+")
    return None


def _config_file(config_path: str) -> str:
    """How to name the config `config_path` (``recipe/tiny_ddpo``): ``configs/recipe/tiny_ddpo.yaml`` when the file
    ships in the config folder, else the config's path in Hydra's terms (a ConfigStore node, a plugin's config)."""
    if (Path(CONFIG_DIR) / f"{config_path}.yaml").is_file():
        return f"configs/{config_path}.yaml"
    return f"the config {config_path}"


def _closest(word: str, known) -> list[str]:
    return difflib.get_close_matches(str(word), sorted(str(k) for k in known), n=3)


def _schema_options() -> dict[type, tuple[str, str | None]]:
    """``{schema dataclass: (config group, option name)}`` of every registered schema (`discover`); the option is None
    in a group of one schema (``trainer``, ``eval``: the node is named by its path alone)."""
    return {cls: (group, name if len(options) > 1 else None) for group, options in discover().items()
            for name, cls in options.items()}


def _fields(schema) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else {}


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _node(parent: str, schema) -> tuple[str, str | None, str | None]:
    """How to name the node at `parent` with dataclass `schema`: ``(name, group, option)``; the name is ``trainer
    (TrainerConfig)``, ``method=flow_grpo (FlowGRPOConfig)`` or ``sampler@data.sampler=dpm_ode (DPMSolverSampler)``
    (a node of a config group of several options, selected with ``<group>[@<node>]=<option>``)."""
    type_name = getattr(schema, "__name__", None)
    group, option = _schema_options().get(schema, (None, None)) if isinstance(schema, type) else (None, None)
    if group is not None and option is not None:
        select = group if parent == group else f"{group}@{parent}"
        return f"{select}={option} ({type_name})", group, option
    return (f"{parent} ({type_name})" if type_name and type_name != "dict" else parent), group, option


def _say(value) -> str:
    """A value as it is written on the command line (``[0,1]``, ``null``, ``true``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(_say(v) for v in value)}]"
    return str(value)


def _sampler_noise_hint(key: str, schema, group: str | None, parent: str) -> str:
    """For a sampler node: its noise parameter, and which sampler options do have `key` (and for which models)."""
    if group != "sampler":
        return ""
    owners = [(name, _default(_fields(cls)["model_family"]) if "model_family" in _fields(cls) else None)
              for name, cls in sorted(discover().get("sampler", {}).items()) if key in _fields(cls)]
    noise = getattr(schema, "noise_field", None)
    family = _default(_fields(schema)["model_family"]) if "model_family" in _fields(schema) else None
    parts = []
    if family:
        parts.append(f"it samples {_FAMILY.get(family, family)} models")
    if noise and noise != key:
        parts.append(f"its noise is {parent}.{noise}")
    if owners:
        named = ", ".join(f"sampler={name}" + (f" ({_FAMILY.get(fam, fam)} models)" if fam else "")
                          for name, fam in owners[:3])
        parts.append(f"{key} belongs to {named}")
    return f" ({'; '.join(parts)})" if parts else ""


_FAMILY = {"eps": "eps/v-prediction", "flow": "rectified-flow", "any": "eps/v and flow"}
_NOISE_FIELDS = ("eta", "noise_level")
"""The samplers' noise parameters (``noise_field``): DDIM's η, the flow SDEs' a."""


def _unknown_key(cause, full_key: str, override: str | None, source: str | None, primary: str) -> str:
    parent, _, key = full_key.rpartition(".")
    schema = cause.object_type
    fields = _fields(schema)
    known = list(fields) if fields else [str(k) for k in getattr(cause.parent_node, "keys", list)()
                                         if parent or str(k) != "hydra"]
    name, group, _ = _node(parent, schema) if parent else (primary, None, None)
    what = "a field" if group == "sampler" else "a setting"
    hint = _sampler_noise_hint(key, schema, group, parent)
    close = _closest(key, known)
    noise = getattr(schema, "noise_field", None) if group == "sampler" else None
    if noise and noise != key and key in _NOISE_FIELDS:  # (DDIM's eta on a flow SDE, or the reverse)
        close = [noise]
    settings = f"Its {'fields' if group == 'sampler' else 'settings'}: {', '.join(sorted(known))}" if known else ""
    if source is not None:
        return (f"{source} sets {full_key}, which is not {what} of {name}{hint}: that file was written for another "
                f"option; select the option it was written for, or use a copy of it without {full_key}. {settings}")
    value = override.partition("=")[2] if override else None
    if close:
        fix = (f"did you mean {', '.join(f'{parent}.{c}' if parent else c for c in close)}? pass "
               f"{parent + '.' if parent else ''}{close[0]}" + (f"={value}" if value is not None else "=..."))
    else:
        fix = f"drop {override or full_key}"
    return (f"{full_key} is not {what} of {name}{hint}; {fix} (a + would add a key the run refuses). "
            f"{settings}").rstrip()


_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text", "Any": "any value"}


def _type_text(annotation) -> str:
    """``int`` → "an integer", ``list[int]`` → "a list of integers", ``float | None`` → "a number or null"."""
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else str(annotation)
    text = (text or str(annotation)).replace("typing.", "").replace("Optional[", "").strip()
    if text.endswith("| None") or text.startswith("None |"):
        inner = text.replace("| None", "").replace("None |", "").strip()
        return f"{_type_text(inner)} or null"
    match = re.fullmatch(r"(?:list|List|tuple|Tuple|Sequence)\[(\w+)(?:, \.\.\.)?\]", text)
    if match:
        item = _TYPES.get(match.group(1), match.group(1))
        plural = {"an integer": "integers", "a number": "numbers", "text": "texts"}.get(item, item)
        return f"a list of {plural}"
    return _TYPES.get(text, text)


def _whole(value) -> int | None:
    """`value` as an int when it is a float with no fraction (``1e3`` → 1000), else None."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() else None


def _bad_value(cause, full_key: str, override: str | None, source: str | None) -> str:
    key = full_key.rpartition(".")[2]
    schema = cause.object_type
    field = _fields(schema).get(key)
    value = override.partition("=")[2] if override else _say(cause.value)
    if field is None:
        reason = str(cause.msg).splitlines()[0] if getattr(cause, "msg", None) else type(cause).__name__
        expected, where, example = None, reason, None
    else:
        expected = _type_text(field.type)
        annotation = field.type.__name__ if isinstance(field.type, type) else field.type
        where = f"{getattr(schema, '__name__', schema)}.{key}: {annotation}"
        default = _default(field)
        is_list = expected.startswith("a list") and not str(value).lstrip().startswith("[")
        example = f"[{value}]" if is_list else (_say(default) if default is not None else None)
        if expected.startswith("an integer") and _whole(value) is not None:  # (1e3, 2.0: a float; write 1000, 2)
            example = str(_whole(value))
    if source is not None:
        must = f"it must be {expected}" if expected else "it is refused"
        return f"{source} sets {full_key} to {value!r}, but {must} ({where}); fix that file"
    must = f"{full_key} must be {expected}, got {value!r}" if expected else f"{full_key}={value} is refused"
    fix = f"; pass e.g. {full_key}={example}" if example is not None else ""
    return f"{override or full_key}: {must} ({where}){fix}"
