"""`quantspec quantize --resume` after a kill -9 gives a checkpoint bit-identical to an
uninterrupted run, and a killed run leaves no folder at the destination."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from safetensors import safe_open

from helpers import make_tiny_model


def tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def cli(*args):
    return [sys.executable, "-m", "quantspec", *args]


def test_kill_then_resume_is_bit_identical(tmp_path):
    tiny = make_tiny_model(tmp_path, "llama", num_hidden_layers=8)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"token{i % 97} word{i % 13} item{i % 7}" for i in range(20000)))
    args = ["quantize", str(tiny), "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--calib", str(text), "--calib-samples", "16", "--calib-seqlen", "128", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    clean = tmp_path / "clean"
    subprocess.run(cli(*args, "--out", str(clean)), check=True, env=env, timeout=600)

    out = tmp_path / "resumed"
    resume_dir = tmp_path / ".resumed.resume"
    proc = subprocess.Popen(cli(*args, "--out", str(out), "--resume"), env=env)
    deadline = time.time() + 300
    done = 0
    while time.time() < deadline and proc.poll() is None:
        manifest = resume_dir / "manifest.json"
        if manifest.is_file():
            try:
                done = json.loads(manifest.read_text()).get("done", 0)
            except json.JSONDecodeError:
                done = 0
            if done >= 2:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed: make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 2 <= done < 8, done
    assert not out.exists(), "a killed run must leave no folder at the destination"
    subprocess.run(cli(*args, "--out", str(out), "--resume"), check=True, env=env, timeout=600)
    a, b = tensors(clean), tensors(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not resume_dir.exists(), "the resume state is removed after a finished run"
