"""Atomic single files (quantspec/checkpoint/atomic.py): temp name beside the file, fsync, rename."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from quantspec.checkpoint import atomic
from quantspec.checkpoint.atomic import (
    atomic_file,
    atomic_save_file,
    atomic_write_bytes,
    atomic_write_text,
)


def test_write_text_replaces_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "sub" / "a.json"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert [p.name for p in path.parent.iterdir()] == ["a.json"]


def test_failure_keeps_previous_file_and_removes_temporary(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".a.txt.")
            tmp.write_text("half")
            raise RuntimeError("writer fails")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_mode_and_default_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "default", b"x")
        atomic_write_bytes(tmp_path / "chosen", b"x", mode=0o600)
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "default").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "chosen").stat().st_mode) == 0o600


def test_save_file_fsyncs_then_renames(tmp_path, monkeypatch):
    events = []
    real_fsync_file, real_fsync_dir = atomic.fsync_file, atomic.fsync_dir
    monkeypatch.setattr(atomic, "fsync_file", lambda p: (events.append("fsync file"), real_fsync_file(p)))
    monkeypatch.setattr(atomic, "fsync_dir", lambda p: (events.append("fsync dir"), real_fsync_dir(p)))
    path = tmp_path / "w.safetensors"
    atomic_save_file({"w": torch.arange(6.0).reshape(2, 3)}, path, {"k": "v"})
    assert events == ["fsync file", "fsync dir"]
    assert torch.equal(load_file(path)["w"], torch.arange(6.0).reshape(2, 3))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_written_files_and_folders_get_plain_modes(tmp_path):
    """mkdtemp makes 0700 folders and safetensors 0600 files: a checkpoint must be readable by an
    engine running as another user, so it gets the modes a plain mkdir / open gives."""
    import stat

    import torch
    from safetensors.torch import save_file

    from quantspec.checkpoint.atomic import atomic_folder, atomic_save_file

    with atomic_folder(tmp_path / "ckpt") as tmp:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "sub").mkdir(mode=0o700)
    atomic_save_file({"w": torch.zeros(2)}, tmp_path / "head.safetensors")
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain.txt").write_text("x")
    assert mode(tmp_path / "ckpt") == mode(tmp_path / "ckpt" / "sub") == mode(tmp_path / "plain")
    assert mode(tmp_path / "ckpt" / "model.safetensors") == mode(tmp_path / "head.safetensors") \
        == mode(tmp_path / "plain.txt")
