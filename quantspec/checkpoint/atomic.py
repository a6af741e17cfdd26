"""Write a folder atomically: build it in a temporary sibling, rename it into place at the end.

A crash, a kill or a full disk leaves no partial folder at the destination (at worst a hidden
``.<name>.tmp-XXXXXXXX`` sibling, removed on the next write, and removed at once when the
failure is a Python exception).

Replacing an existing folder (``overwrite``) takes two renames: the previous folder to the
backup ``.<name>.backup``, then the new one to the destination; the backup is removed only
after the second rename is on disk (the parent folder is fsynced after each rename). A Python
exception between the two renames puts the previous folder back at once; after a kill there,
the next ``check_destination`` (every write starts with it) finds the backup without a
destination and renames it back. The cleanup of temporary folders matches only the
``.tmp-`` + random-suffix names that ``tempfile.mkdtemp`` makes, never the backup (nor another
destination's folders, e.g. those of a checkpoint named ``<name>.tmp-x``).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import QuantspecError


def backup_path(out: Path) -> Path:
    """Where the previous folder waits while ``out`` is replaced."""
    return out.parent / f".{out.name}.backup"


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (renames, new files) durable (no-op on Windows)."""
    if os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def restore_interrupted_swap(out: Path) -> bool:
    """Undo a replacement of ``out`` killed between its two renames: the backup goes back to
    ``out``. With ``out`` present the replacement finished and its backup is dropped. Returns
    whether the previous folder was restored."""
    backup = backup_path(out)
    if not backup.is_dir():
        return False
    if out.exists():
        shutil.rmtree(backup)
        return False
    os.replace(backup, out)
    fsync_dir(out.parent)
    return True


def check_destination(out: str | os.PathLike, overwrite: bool) -> Path:
    """Refuse an existing destination unless ``overwrite``; call this before any work starts.

    First restores a folder that an interrupted ``--overwrite`` left as its backup."""
    out = Path(out).absolute()
    restore_interrupted_swap(out)
    if out.exists() and not overwrite:
        raise QuantspecError(
            f"output folder {out} already exists.",
            "pass --overwrite to replace it, or choose another --out.",
        )
    if out.exists() and not out.is_dir():
        raise QuantspecError(f"output path {out} exists and is not a folder.", "choose another --out.")
    return out


def _clean_stale(parent: Path, name: str) -> None:
    """Remove the temporary folders earlier writes of ``name`` left (``mkdtemp``'s names only)."""
    stale = re.compile(rf"\.{re.escape(name)}\.tmp-[a-z0-9_]+")
    for path in parent.glob(f".{name}.tmp-*"):
        if stale.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)


def _flush(tmp: Path) -> None:
    """fsync every file and folder under ``tmp`` before the rename makes them visible."""
    for path in [tmp, *tmp.rglob("*")]:
        if path.is_dir():
            fsync_dir(path)
        elif path.is_file():
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, replacing an existing ``out`` through its backup."""
    if not out.exists():
        os.replace(tmp, out)
        fsync_dir(out.parent)
        return
    backup = backup_path(out)
    os.replace(out, backup)
    fsync_dir(out.parent)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(backup, out)
        fsync_dir(out.parent)
        raise
    fsync_dir(out.parent)
    shutil.rmtree(backup, ignore_errors=True)


@contextmanager
def atomic_folder(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``out``, on failure it is removed."""
    out = check_destination(out, overwrite)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    _clean_stale(parent, out.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    try:
        yield tmp
        _flush(tmp)
        _swap_in(tmp, out)
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
