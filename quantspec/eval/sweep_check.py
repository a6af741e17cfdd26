"""Checking a sweep before any point runs (``SweepConfig`` calls these when it is built).

Values are type-checked against the config classes' annotations (``strict.check_types``) before
their own checks read them; the sweep-wide settings are those every point's commands share; each
point's quantize command is parsed by ``quantspec quantize``'s own parser and resolved to the recipe
it would run (``quantize_recipe``), which must make that point and fit its format.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import QuantspecError, one_line
from ..strict import check_types, from_dict_strict, reject_unknown
from .sweep_steps import point_steps

if TYPE_CHECKING:
    from .sweep import SweepConfig, SweepPoint


def from_dict_typed(cls: type, data: Any, where: str) -> Any:
    """``from_dict_strict`` with every value type-checked first (before ``cls``'s own checks read it)."""
    if isinstance(data, dict):
        reject_unknown(cls, data, where=where)
        check_types(cls, data, f"sweep {where}")
    return from_dict_strict(cls, data, where, lists_as_tuples=True)


def command_words(value: Any, where: str) -> tuple[str, ...]:
    """Command-line words from YAML: a list of strings (numbers become words); null is none."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(w, (str, int, float)) and not isinstance(w, bool) for w in value):
        raise QuantspecError(f"sweep {where} must be a list of command-line words, got {one_line(repr(value), 80)}.",
                             f'write e.g. {where}: [--calib, c4, --calib-samples, "32"].')
    return tuple(str(w) for w in value)


def point_words(point: Any, i: int) -> Any:
    if isinstance(point, dict) and "extra_args" in point:
        return {**point, "extra_args": command_words(point["extra_args"], f"points[{i}].extra_args")}
    return point


def check_data_name(name: str, where: str) -> None:
    """QuantspecError unless ``name`` is a data set ``data.sources.load_text`` knows or an existing file."""
    from ..data.sources import source_names

    known = source_names()
    if str(name).strip().lower() in known or Path(str(name)).expanduser().is_file():
        return
    raise QuantspecError(f"sweep {where}: unknown data set {name!r} (and no such file).",
                         f"use one of {known}, or the path of an existing .txt or .jsonl file.")


def _prefixed(where: str, exc: QuantspecError) -> QuantspecError:
    return QuantspecError(f"sweep {where}: {one_line(exc.problem)}", exc.fix)


def check_settings(cfg: SweepConfig) -> None:
    """The sweep-wide settings every point's commands share: a model that can be found (a local
    path must exist; a hub id is looked up when it runs), a dtype and device the commands accept."""
    from ..models.source import check_model_spec, resolve_device, resolve_dtype

    if cfg.timeout_s < 1:
        raise QuantspecError(f"sweep timeout_s must be at least 1 second, got {cfg.timeout_s}.", "set e.g. timeout_s: 3600.")
    for key, check in (("model", lambda: check_model_spec(cfg.model)), ("dtype", lambda: resolve_dtype(cfg.dtype, "cpu")),
                       ("device", lambda: cfg.device is None or resolve_device(cfg.device))):
        try:
            check()
        except QuantspecError as exc:
            raise _prefixed(key, exc) from None


class _Refused(argparse.ArgumentParser):
    """An argparse parser that prints nothing and whose usage errors (and exits, e.g. --help) are QuantspecErrors."""

    def _print_message(self, message: str, file=None) -> None:
        pass

    def exit(self, status: int = 0, message: str | None = None):
        message = message or "its quantize command (quantize_args + extra_args) would stop at once (-h/--help?)"
        raise QuantspecError(one_line(message).rstrip(".") + ".",
                             "correct quantize_args or the point's extra_args (see `quantspec quantize --help`).")

    def error(self, message: str):
        self.exit(2, f"its quantize command (quantize_args + extra_args) is refused: {message}")


@lru_cache(maxsize=1)
def quantize_parser() -> argparse.ArgumentParser:
    """``quantspec quantize``'s own parser (its flags, choices and value types)."""
    from ..cli import quantize

    top = _Refused(prog="quantspec")
    quantize.add_parser(top.add_subparsers(dest="command"))
    return top


def quantize_recipe(point: SweepPoint, cfg: SweepConfig, parser: argparse.ArgumentParser | None = None):
    """The recipe a point's quantize step will run: its command line (with the sweep's
    quantize_args and the point's extra_args) parsed and resolved as ``quantspec quantize`` does."""
    from ..cli.quantize import recipe_from_args

    step = point_steps(point, cfg, Path("OUT") / "points" / point.name)[0]
    return recipe_from_args((parser or quantize_parser()).parse_args(step.argv[3:]))


def check_point(point: SweepPoint, cfg: SweepConfig, parser: argparse.ArgumentParser | None = None) -> None:
    """QuantspecError naming the point when its recipe is impossible, its quantize command would be
    refused, or its format cannot hold its scheme (on a layer of any common shape, 4096 x 4096)."""
    from ..formats import get_format

    if point.is_dense:
        return
    try:
        point.validate()
        recipe = quantize_recipe(point, cfg, parser)
        made = replace(point, method=recipe.method, bits=recipe.scheme.bits, group_size=recipe.scheme.group_size,
                       format=recipe.format)
        if made.name != point.name:  # a flag in quantize_args / extra_args overrides the point's own
            raise QuantspecError(f"its quantize command would make {made.name} instead.",
                                 "drop the flag of quantize_args or extra_args that overrides the point's "
                                 "method, bits, group size or format.")
        reason = get_format(recipe.format).cannot_hold(recipe.scheme, 4096, 4096)
        if reason:
            raise QuantspecError(f"the {recipe.format} format cannot hold it: {reason}.",
                                 "pick a format that holds this scheme (compressed-tensors holds every one) or another scheme.")
    except QuantspecError as exc:
        raise _prefixed(f"point {point.name}", exc) from None
