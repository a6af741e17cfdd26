"""kill -9 of `quantspec quantize` on the default (streaming) path, mid-run: nothing appears at
the destination, the next run removes the stale temporary folder, and a `--resume` run reuses
the blocks the killed run finished and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import make_tiny_model

LAYERS = 8


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "quantspec", *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the quantize arguments, the uninterrupted run's tensors); the tiny model's folder holds
    safetensors and a declared architecture, so the default path streams."""
    root = tmp_path_factory.mktemp("kill")
    tiny = make_tiny_model(root, "llama", num_hidden_layers=LAYERS)
    text = root / "calib.txt"
    text.write_text(" ".join(f"token{i % 97} word{i % 13} item{i % 7}" for i in range(20000)))
    args = ["quantize", str(tiny), "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--calib", str(text), "--calib-samples", "16", "--calib-seqlen", "128", "--no-progress"]
    clean = root / "clean"
    subprocess.run(cli(*args, "--out", str(clean)), check=True, env=ENV, timeout=600)
    assert json.loads((clean / "quant_report.json").read_text())["streaming"] is True
    return args, tensors(clean)


def kill_when(proc: subprocess.Popen, ready) -> None:
    """SIGKILL ``proc`` as soon as ``ready()`` holds; fail if it ends first."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def temp_folders(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def journaled(resume_dir: Path) -> int:
    try:
        return json.loads((resume_dir / "manifest.json").read_text())["done"]
    except (OSError, ValueError, KeyError):
        return 0


def assert_killed_mid_write(out: Path) -> None:
    """Nothing at the destination; the streaming path's temporary folder holds block shards."""
    assert not out.exists(), "a killed run must leave no folder at the destination"
    tmp = temp_folders(out)
    assert len(tmp) == 1 and list(tmp[0].glob("model-*.safetensors")), (
        "the kill must land on the streaming path after it wrote block shards", tmp)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_kill_then_resume_reuses_finished_blocks_bit_identical(tmp_path, setup):
    args, clean = setup
    out, resume_dir = tmp_path / "resumed", tmp_path / ".resumed.resume"
    proc = subprocess.Popen(cli(*args, "--out", str(out), "--resume"), env=ENV)
    kill_when(proc, lambda: journaled(resume_dir) >= 2)
    done = journaled(resume_dir)
    assert 2 <= done < LAYERS, done
    assert_killed_mid_write(out)

    subprocess.run(cli(*args, "--out", str(out), "--resume"), check=True, env=ENV, timeout=600)
    assert temp_folders(out) == [], "the stale temporary folder is removed by the next run"
    report = json.loads((out / "quant_report.json").read_text())
    assert report["streaming"] is True and report["resumed_blocks"] == done
    resumed = {e["block"] for e in report["layers"].values() if e.get("resumed")}
    assert resumed == set(range(done))
    assert_same(clean, tensors(out))
    assert not resume_dir.exists(), "the resume state is removed after a finished run"


def test_kill_without_resume_leaves_a_temp_folder_the_next_run_removes(tmp_path, setup):
    args, clean = setup
    out = tmp_path / "plain"
    proc = subprocess.Popen(cli(*args, "--out", str(out)), env=ENV)
    kill_when(proc, lambda: any(len(list(t.glob("model-*.safetensors"))) >= 2 for t in temp_folders(out)))
    assert_killed_mid_write(out)
    assert not (tmp_path / ".plain.resume").exists(), "no journal without --resume"

    subprocess.run(cli(*args, "--out", str(out)), check=True, env=ENV, timeout=600)
    assert temp_folders(out) == []
    assert json.loads((out / "quant_report.json").read_text())["resumed_blocks"] == 0
    assert_same(clean, tensors(out))
