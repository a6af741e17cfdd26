"""Write a file or a folder atomically: build it under a temporary sibling name, rename it into
place at the end.

Files (``atomic_file``, ``atomic_write_text``, ``atomic_write_bytes``, ``atomic_save_file``):
written under a fresh hidden name ``.<name>.<random>.tmp`` in the same folder, fsynced, then
``os.replace``d onto the destination (the folder is fsynced after the rename); readers see the
previous file or the new one, never a part of one. A Python exception removes the temporary
file; a kill can leave it behind (nothing reads those names).

Folders that are only ever created, never replaced (caches whose every build is the same):
``sibling_temp_folder`` + ``rename_folder_into_place``; the caller decides what a folder that
another process renamed into place first means.

Folders (``atomic_folder``):

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
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import QuantspecError

if TYPE_CHECKING:
    import torch


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


def fsync_file(path: Path) -> None:
    """Flush the data of file ``path`` to disk."""
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


def _rename(src: Path, dst: Path) -> None:
    """``os.replace(src, dst)``, then fsync the parent folder so that the rename is durable."""
    os.replace(src, dst)
    fsync_dir(dst.parent)


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
    _rename(backup, out)
    return True


def check_destination(out: str | os.PathLike, overwrite: bool, marks: tuple[str, ...] = ()) -> Path:
    """Refuse an existing destination unless ``overwrite``; call this before any work starts.
    ``marks``: files of which an existing non-empty folder must hold one for ``overwrite`` to
    replace it (what this kind of output writes), so that no other folder is deleted.

    First restores a folder that an interrupted ``--overwrite`` left as its backup."""
    out = Path(out).absolute()
    restore_interrupted_swap(out)
    if out.exists() and not out.is_dir():
        raise QuantspecError(f"output path {out} exists and is a file.", "choose another --out.")
    if out.exists() and not overwrite:
        raise QuantspecError(
            f"output folder {out} already exists.",
            "pass --overwrite to replace it, or choose another --out.",
        )
    if out.exists() and marks and any(out.iterdir()) and not any((out / m).exists() for m in marks):
        raise QuantspecError(f"--overwrite would delete {out}, which holds no {' or '.join(marks)}: not an "
                             "output of this kind.", "choose another --out, or empty that folder yourself.")
    return out


def _clean_stale(parent: Path, name: str) -> None:
    """Remove the temporary folders earlier writes of ``name`` left (``mkdtemp``'s names only)."""
    stale = re.compile(rf"\.{re.escape(name)}\.tmp-[a-z0-9_]+")
    for path in parent.glob(f".{name}.tmp-*"):
        if stale.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)


def new_mode(folder: bool) -> int:
    """The permission bits ``mkdir`` / ``open`` give a new folder / file under the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def _plain_modes(tmp: Path) -> None:
    """Give ``tmp`` (``mkdtemp``: 0700) and everything under it the bits of a plain new folder or
    file (safetensors writes 0600), so that an engine running as another user can read it."""
    folder, file = new_mode(True), new_mode(False)
    for path in [tmp, *tmp.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, folder if path.is_dir() else file)


def _flush(tmp: Path) -> None:
    """fsync every file and folder under ``tmp`` before the rename makes them visible."""
    for path in [tmp, *tmp.rglob("*")]:
        if path.is_dir():
            fsync_dir(path)
        elif path.is_file():
            fsync_file(path)


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``, replacing an existing ``out`` through its backup."""
    if not out.exists():
        _rename(tmp, out)
        return
    backup = backup_path(out)
    _rename(out, backup)
    try:
        os.replace(tmp, out)
    except BaseException:
        _rename(backup, out)
        raise
    fsync_dir(out.parent)
    shutil.rmtree(backup, ignore_errors=True)


def rename_folder_into_place(tmp: Path, out: Path) -> None:
    """fsync every file and folder under ``tmp``, then rename it to ``out`` (no folder, or an
    empty one, may be there: ``os.replace`` refuses a non-empty one) and fsync the parent."""
    _plain_modes(tmp)
    _flush(tmp)
    _rename(tmp, out)


@contextmanager
def sibling_temp_folder(out: Path) -> Iterator[Path]:
    """A new folder ``.<name>.tmp-XXXXXXXX`` beside ``out`` (the parent is created), removed
    on exit unless it was renamed away."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_folder(out: str | os.PathLike, overwrite: bool = False, marks: tuple[str, ...] = ()) -> Iterator[Path]:
    """Yield a temporary folder; on success it replaces ``out``, on failure it is removed
    (``marks``: ``check_destination``'s)."""
    out = check_destination(out, overwrite, marks)
    _clean_stale(out.parent, out.name)
    with sibling_temp_folder(out) as tmp:
        try:
            yield tmp
            _plain_modes(tmp)
            _flush(tmp)
            _swap_in(tmp, out)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # sibling_temp_folder removes tmp on the way out
                raise QuantspecError(
                    f"the disk is full while writing {out} (temporary files removed).",
                    "free space or write to another disk with --out.",
                ) from exc
            raise


def _new_temp_file(path: Path) -> Path:
    """Create an empty file ``.<name>.<random>.tmp`` beside ``path`` (mode as ``open`` gives)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


@contextmanager
def atomic_file(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield the name of a new empty file beside ``path`` (the parent is created) to write;
    on success it is fsynced, given permission bits ``mode`` (default: those of a new file)
    and renamed onto ``path``; on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp_file(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.chmod(tmp, new_mode(False) if mode is None else mode)  # a writer that recreated it (safetensors: 0600)
        _rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)``, atomically (see ``atomic_file``)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """``Path(path).write_bytes(data)``, atomically (see ``atomic_file``)."""
    with atomic_file(path, mode) as tmp:
        tmp.write_bytes(data)


def atomic_save_file(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, atomically (see ``atomic_file``).
    The tensors must be contiguous (as for ``save_file``)."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata)
