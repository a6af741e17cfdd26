"""The ``quantspec`` command: a thin layer of subcommands over the library.

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``, which
registers the parser and sets ``func`` to a ``run(args) -> int`` function.
Exit codes: 0 success, 2 bad input (QuantspecError, one line), 1 internal error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..errors import QuantspecError, one_line

SUBCOMMANDS = [
    "quantize",
    "eval",
    "generate",
    "inspect",
    "bench",
    "bench_specdec",
    "train_draft",
    "profile",
    "sweep",
    "serve_bench",
    "report",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse's usage errors as every other error: one line naming the problem and the fix, exit 2
    (argparse prints the whole usage block before its message)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)}. Fix: see `{self.prog} --help`.\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="quantspec",
        description="Quantize, run, speculate and measure Hugging Face causal LMs.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f".{name}", __package__)
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.{name}":
                continue  # subcommand not built yet
            raise
        module.add_parser(sub)
    return parser


_PACKAGE = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def one_line_warnings(debug: bool) -> Iterator[None]:
    """quantspec's own warnings shown as one line, ``quantspec: warning: ...``, as errors are (with
    --debug, and for other packages' warnings, Python's usual form with the source line). Only
    the display changes: a caller that records warnings still receives them."""
    formatted = warnings.formatwarning

    def fmt(message, category, filename, lineno, line=None):
        if debug or not issubclass(category, UserWarning) or _PACKAGE not in Path(filename).resolve().parents:
            return formatted(message, category, filename, lineno, line)
        return f"quantspec: warning: {message}\n"

    warnings.formatwarning = fmt
    try:
        yield
    finally:
        warnings.formatwarning = formatted


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the subcommand
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # a usage error (one line, OneLineParser) or --help: its exit code
        return int(exc.code or 0)
    args.debug = debug
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        from ._common import check_apart, check_destination

        for flag in ("out", "json"):  # where results go, checked before any model loads
            if getattr(args, flag, None):
                check_destination(getattr(args, flag), f"--{flag}")
        check_apart(args)
        with one_line_warnings(args.debug):
            return int(args.func(args) or 0)
    except QuantspecError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"quantspec: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("quantspec: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # internal error
        if args.debug:
            traceback.print_exc()
        else:
            print(
                f"quantspec: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
                file=sys.stderr,
            )
        return 1


if __name__ == "__main__":
    sys.exit(main())
