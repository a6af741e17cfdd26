"""Small helpers shared by the subcommands."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..checkpoint.atomic import atomic_write_text
from ..errors import QuantspecError


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so readers never see half a file."""
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def check_destination(path: str | os.PathLike, flag: str) -> None:
    """Refuse, before any work, a ``flag`` destination (a folder to create or a file to write)
    whose nearest existing ancestor is not a folder this process can create things in."""
    target = Path(path).expanduser().absolute()
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    try:  # a folder made and removed there: what permissions alone do not say (read-only mounts, /proc)
        os.rmdir(tempfile.mkdtemp(prefix=".quantspec-probe-", dir=ancestor))
    except OSError as exc:
        raise QuantspecError(f"{flag} {path} cannot be written: nothing can be created in {ancestor} "
                             f"({exc.strerror or type(exc).__name__}).", f"give {flag} a path in a writable folder.") from None


INPUT_FLAGS = ("model", "target", "path", "checkpoints", "quantized", "draft", "prompts", "recipe", "calib",
               "load_scales", "sweep", "tasks_path", "include_path")  # what a command reads
OUTPUT_FLAGS = ("out", "json", "save_scales")  # what it writes


def local_inputs(args) -> list[tuple[str, Path]]:
    """(flag, resolved path) of every input of ``args`` that is a local file or folder (a draft
    spec's ``self:``/``eagle:`` prefix removed; hub ids, aliases and dataset names are not paths)."""
    found = []
    for name in INPUT_FLAGS:
        value = getattr(args, name, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(item, (str, os.PathLike)):
                continue
            text = str(item)
            for prefix in ("self:", "eagle:"):
                text = text.removeprefix(prefix)
            path = Path(text).expanduser()
            if text.strip() and path.exists():
                found.append((name, path.resolve()))
    return found


def check_apart(args) -> None:
    """Refuse, before any work, a destination that would change an input: ``--out``/``--json``
    that is an input, an existing file inside an input folder, or (``--overwrite``) a folder
    holding an input; and a ``--json`` that is a folder."""
    inputs = local_inputs(args)
    for name in OUTPUT_FLAGS:
        value = getattr(args, name, None)
        if not value:
            continue
        flag = "--" + name.replace("_", "-")
        dest = Path(value).expanduser().resolve()
        if name != "out" and dest.is_dir():
            raise QuantspecError(f"{flag} {value} is a folder.", f"give {flag} a file name.")
        for source_flag, source in inputs:
            what = "the input" if source_flag in ("model", "target", "path") else f"the --{source_flag.replace('_', '-')} input"
            if dest == source or (dest.is_file() and source in dest.parents):
                raise QuantspecError(f"{flag} {value} would overwrite {what} {source}.",
                                     f"choose a {flag} outside {source}.")
            if getattr(args, "overwrite", False) and dest in source.parents:
                raise QuantspecError(f"{flag} {value} holds {what} {source}, which --overwrite would delete.",
                                     f"choose a {flag} that does not contain {source}.")
