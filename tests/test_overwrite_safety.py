"""``--overwrite`` never loses the previous checkpoint (quantspec/checkpoint/atomic.py).

A replacement is two renames (previous folder -> backup, new folder -> destination). Failures
are injected between them: a Python exception (in process) and a SIGKILL (a subprocess whose
second rename kills it), then the next run must find the previous checkpoint at the
destination; the cleanup of stale temporary folders must leave backups (and other checkpoints'
folders) alone; the parent folder is fsynced after each rename.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from quantspec.checkpoint import atomic
from quantspec.checkpoint.atomic import atomic_folder, check_destination
from quantspec.errors import QuantspecError

# Replaces ``sys.argv[1]`` (absolute) with a folder holding config.json = "new", and is killed
# (SIGKILL: no Python cleanup) when it renames the new folder onto the destination.
KILLED_AT_SECOND_RENAME = """
import os, sys
from pathlib import Path
from quantspec.checkpoint.atomic import atomic_folder
out = Path(sys.argv[1])
real_replace = os.replace
def replace(src, dst):
    if Path(dst) == out and Path(src).name.startswith("." + out.name + ".tmp-"):
        os.kill(os.getpid(), 9)
    return real_replace(src, dst)
os.replace = replace
with atomic_folder(out, overwrite=True) as tmp:
    (tmp / "config.json").write_text("new")
"""


def write_checkpoint(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(text)
    return folder


def content(folder: Path) -> str:
    return (folder / "config.json").read_text()


@pytest.fixture
def killed_overwrite(tmp_path) -> Path:
    """A checkpoint "old" whose ``--overwrite`` was killed between the two renames."""
    out = write_checkpoint(tmp_path / "ckpt", "old")
    proc = subprocess.run([sys.executable, "-c", KILLED_AT_SECOND_RENAME, str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not out.exists()  # killed with the previous folder moved away, the new not in place
    return out


def test_next_run_restores_previous_checkpoint_before_refusing(killed_overwrite):
    out = killed_overwrite
    with pytest.raises(QuantspecError, match="already exists"):
        check_destination(out, overwrite=False)
    assert content(out) == "old"


def test_next_failed_overwrite_keeps_previous_checkpoint(killed_overwrite):
    """The stale-folder cleanup of the next run must not delete the backup."""
    out = killed_overwrite
    with pytest.raises(RuntimeError, match="later run"):
        with atomic_folder(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("half")
            raise RuntimeError("a later run fails")
    assert content(out) == "old"
    assert [p.name for p in out.parent.iterdir()] == ["ckpt"]  # no backup, no temporary left


def test_next_overwrite_replaces_and_cleans_up(killed_overwrite):
    out = killed_overwrite
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("newer")
    assert content(out) == "newer"
    assert [p.name for p in out.parent.iterdir()] == ["ckpt"]


def test_exception_at_second_rename_puts_previous_back(tmp_path, monkeypatch):
    out = write_checkpoint(tmp_path / "ckpt", "old")
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst) == out and Path(src).name.startswith(".ckpt.tmp-"):
            raise OSError(errno.EIO, "injected failure of the second rename")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(OSError, match="injected"):
        with atomic_folder(out, overwrite=True) as tmp:
            (tmp / "config.json").write_text("new")
    assert content(out) == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_cleanup_matches_only_temporary_folders(tmp_path):
    """Simulated leftovers of a killed overwrite (backup, no destination, a stale temporary),
    beside another checkpoint's folders whose names start like ours (``ckpt.tmp-x``)."""
    out = tmp_path / "ckpt"
    write_checkpoint(tmp_path / ".ckpt.backup", "old")
    write_checkpoint(tmp_path / ".ckpt.tmp-k3j4_5g6", "stale")
    others = [write_checkpoint(tmp_path / n, "other")
              for n in ("ckpt.tmp-x", ".ckpt.tmp-x.backup", ".ckpt.tmp-x.tmp-abcd1234")]
    with pytest.raises(RuntimeError):
        with atomic_folder(out, overwrite=True):
            raise RuntimeError("fails after the cleanup")
    assert content(out) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", *(p.name for p in others)])
    assert all(content(p) == "other" for p in others)


def test_finished_swap_drops_its_backup(tmp_path):
    """Killed after the second rename, before the backup was removed: the destination is the
    new checkpoint, and the next run removes the backup."""
    out = write_checkpoint(tmp_path / "ckpt", "new")
    write_checkpoint(tmp_path / ".ckpt.backup", "old")
    with pytest.raises(QuantspecError, match="already exists"):
        check_destination(out, overwrite=False)
    assert content(out) == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("existing", [True, False], ids=["overwrite", "new"])
def test_parent_folder_fsynced_after_each_rename(tmp_path, monkeypatch, existing):
    out = tmp_path / "ckpt"
    if existing:
        write_checkpoint(out, "old")
    events = []
    real_replace, real_fsync = os.replace, atomic.fsync_dir

    def replace(src, dst):
        events.append(("rename", Path(src).name, Path(dst).name))
        return real_replace(src, dst)

    def fsync_dir(path):
        if Path(path) == tmp_path:
            events.append(("fsync parent",))
        return real_fsync(path)

    monkeypatch.setattr(atomic.os, "replace", replace)
    monkeypatch.setattr(atomic, "fsync_dir", fsync_dir)
    with atomic_folder(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text("new")
    tmp_name = next(e[1] for e in events if e[0] == "rename" and e[2] == "ckpt")
    swap = [("rename", "ckpt", ".ckpt.backup"), ("fsync parent",)] if existing else []
    assert events == [*swap, ("rename", tmp_name, "ckpt"), ("fsync parent",)]
    assert content(out) == "new"
