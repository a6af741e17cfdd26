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
