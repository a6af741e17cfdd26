"""Dataclasses from user mappings (YAML, JSON, CLI), strictly: an unknown key is an error.

A leaf module (imports only ``quantspec.errors``) so that any layer can use it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

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
