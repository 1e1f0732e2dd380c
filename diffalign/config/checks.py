"""Field checks that the components' ``check_config`` share: integers that are integers, numbers in their range, one of
a list of names, booleans, prompt files, seeds.

Every check reads ``node[key]`` of a composed config, does nothing when the key is absent (a component's own YAML may
not have it), and raises `ConfigError` (a `ValueError`) naming the field as ``<prefix>.<key>``, the value it got and
the fix; `diffalign.validation.validate_train_config` runs them before any model loads and the CLI prints the message
as ``diffalign: error: …``. A type that Hydra checks already (fields of the structured configs beside the methods,
data sets and reference strategies) fails earlier, at composition, with Hydra's own message naming ``full_key``.
"""

from __future__ import annotations

import math
import numbers

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


def int_list(node, key: str, prefix: str, *, ge: int | None = None, min_length: int = 0, hint: str = "") -> None:
    """``<prefix>.<key>`` is a list of integers each >= `ge`, with at least `min_length` entries.

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
