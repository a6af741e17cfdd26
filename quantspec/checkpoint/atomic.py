"""Write a folder atomically: build it in a temporary sibling, rename it into place at the end.

A crash, a kill or a full disk leaves no partial folder at the destination (at worst a hidden
``.<name>.tmp-*`` sibling, removed on the next successful write, and removed at once when the
failure is a Python exception).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import QuantspecError


def check_destination(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing destination unless ``overwrite``; call this before any work starts."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise QuantspecError(
            f"output folder {out} already exists.",
            "pass --overwrite to replace it, or choose another --out.",
        )
    if out.exists() and not out.is_dir():
        raise QuantspecError(f"output path {out} exists and is not a folder.", "choose another --out.")
    return out


def _clean_stale(parent: Path, name: str) -> None:
    for stale in parent.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def atomic_folder(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``out``, on failure it is removed."""
    out = check_destination(out, overwrite)
    parent = out.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(parent, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        for f in tmp.rglob("*"):  # flush file contents before the rename makes them visible
            if f.is_file():
                with open(f, "rb+") as fh:
                    os.fsync(fh.fileno())
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-old-", dir=parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise QuantspecError(
                f"the disk is full while writing {out} (temporary files removed).",
                "free space or write to another disk with --out.",
            ) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
