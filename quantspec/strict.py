"""Dataclasses from user mappings (YAML, JSON, CLI), strictly: an unknown key is an error, and
so is a value its field's annotation does not allow (``check_types``, ``config_value``).

A leaf module (imports only ``quantspec.errors``) so that any layer can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from functools import cache
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from .errors import QuantspecError

T = TypeVar("T")


def reject_unknown(cls: type, data: Any, what: str = "", where: str | None = None) -> None:
    """Raise a QuantspecError naming the keys of ``data`` that are not fields of dataclass ``cls``.

    The message is ``unknown <what> field(s) [...] in <where>.`` (``what`` and ``where``
    optional), e.g. ``reject_unknown(Recipe, d, "recipe")``: ``unknown recipe field(s) [...].``
    """
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        kind = f"{what} " if what else ""
        place = f" in {where}" if where else ""
        raise QuantspecError(f"unknown {kind}field(s) {sorted(unknown)}{place}.", f"use only {sorted(known)}.")


def from_dict_strict(cls: type[T], data: Any, where: str, *, lists_as_tuples: bool = False) -> T:
    """``cls(**data)`` for dataclass ``cls``; ``None`` gives ``cls()``.

    QuantspecError (naming ``where``, e.g. ``recipe.gptq``) when ``data`` is not a mapping or
    has keys that are not fields of ``cls``. ``lists_as_tuples``: list values become tuples
    (for frozen, hashable dataclasses read from YAML)."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise QuantspecError(f"{where} must be a mapping.", f"write {where}: {{...}}.")
    reject_unknown(cls, data, where=where)
    if lists_as_tuples:
        data = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return cls(**data)


# Typed values of user mappings (recipe YAML, checkpoint configs): a bool takes only true/false,
# an int only integers (not bools), a float integers or floats (not bools), a str only strings;
# ``X | None`` also null, ``tuple[X, ...]`` a tuple or list of X. Recipe sections are checked against
# their dataclass annotations (``check_types``), checkpoint configs one value at a time
# (``config_value``), so that "false" or 1 never reads as a bool and "four" never reaches int().
_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
          list: "a list", dict: "a mapping"}


def admits(tp: Any, value: Any) -> bool:
    """Whether the annotation ``tp`` (a class, ``X | Y``, ``tuple[X, ...]``) allows ``value``."""
    if get_origin(tp) in (Union, UnionType):
        return any(admits(arg, value) for arg in get_args(tp))
    if get_origin(tp) is tuple:  # a YAML or JSON list too
        return isinstance(value, (tuple, list)) and all(admits(get_args(tp)[0], v) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is type(None):
        return value is None
    return isinstance(value, tp) if isinstance(tp, type) else True


def describe(tp: Any) -> str:
    """What ``tp`` allows, in words: "true or false", "an integer or null", "a list (each item a string)"."""
    if get_origin(tp) in (Union, UnionType):
        return " or ".join(describe(arg) for arg in get_args(tp))
    if get_origin(tp) is tuple:
        return f"a list (each item {describe(get_args(tp)[0])})"
    return _NAMES.get(tp) or f"a {getattr(tp, '__name__', tp)} mapping"


def _shown(value: Any) -> str:
    """``value`` as YAML / JSON write it (true, null, 0.5, gptq)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def check_types(cls: type, data: Mapping[str, Any], where: str) -> None:
    """Raise a QuantspecError naming the first value of ``data`` that the annotation of its
    field of dataclass ``cls`` does not allow (see ``admits``), e.g. ``recipe.scheme.symmetric=1
    is not true or false.``; keys that are not fields are ``reject_unknown``'s."""
    types = _field_types(cls)
    for f in fields(cls):
        if f.name in data and not admits(types[f.name], data[f.name]):
            default = "" if f.default is MISSING or isinstance(f.default, tuple) else f" (default {_shown(f.default)})"
            raise QuantspecError(f"{where}.{f.name}={data[f.name]!r} is not {describe(types[f.name])}.",
                                 f"set {where}.{f.name} to {describe(types[f.name])}{default}.")


def config_value(config: Mapping[str, Any], key: str, tp: Any, default: Any, where: str) -> Any:
    """``config[key]`` (``default`` where it is absent or null) when ``tp`` allows it (see
    ``admits``); else a QuantspecError naming ``where`` (e.g. "GPTQ quantization_config"),
    the key and its value."""
    value = config.get(key)
    value = default if value is None else value
    if not admits(tp, value):
        raise QuantspecError(f"{where} {key}={value!r} is not {describe(tp)}.",
                             f"write {key} as {describe(tp)} (JSON true/false and numbers are unquoted) "
                             "in config.json, or re-export the checkpoint.")
    return value
