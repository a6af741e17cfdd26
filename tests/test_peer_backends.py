"""The peer backends (Marlin through vLLM, gemlite, torch's int4 tiles): what each declares it
cannot run, checked here without a GPU; on a GPU (``-m gpu``), each one that can run against the
reference.

GPU tolerances (relative Frobenius error against the reference on the same fp16/bf16 x): the
kernels accumulate in fp32 but take scales (and gemlite's fused zeros) in the activation dtype
and round the output: fp16 1e-2, bf16 3e-2.
"""

from __future__ import annotations

import pytest
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.kernels.backend import backend_reasons, choose_backend, get_backend
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.rtn import rtn

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
W4 = QuantScheme(bits=4, group_size=128)


@pytest.mark.parametrize("name,scheme,dtype,device,why", [
    ("marlin", W4, torch.float16, CPU, "runs on NVIDIA GPUs, not cpu"),
    ("marlin", W4, torch.float32, CUDA, "activations must be fp16 or bf16"),
    ("marlin", QuantScheme(bits=3, group_size=128), torch.float16, CUDA, "4 or 8 bits"),
    ("marlin", QuantScheme(bits=8, group_size=128, symmetric=False), torch.float16, CUDA, "zero points"),
    ("marlin", W4, torch.float16, CUDA, "multiple of the group size"),
    ("marlin", QuantScheme(bits=4, weights="nvfp4", group_size=16), torch.float16, CUDA, "weight-only"),
    ("gemlite", W4, torch.float16, CPU, "runs on CUDA / ROCm GPUs, not cpu"),
    ("gemlite", QuantScheme(bits=3, group_size=128), torch.float16, CUDA, "bits"),
    ("gemlite", QuantScheme(bits=4, group_size=-1), torch.float16, CUDA, "per-channel"),
    ("gemlite", W4, torch.float32, CUDA, "activations must be fp16 or bf16"),
])
def test_declared_limits(name, scheme, dtype, device, why):
    k = 200 if why == "multiple of the group size" else 512
    reason = get_backend(name).cannot_run(scheme, 256, k, device, dtype)
    assert reason is not None and why in reason, reason


@pytest.mark.parametrize("name,library", [("marlin", "vllm"), ("gemlite", "gemlite")])
def test_a_missing_library_is_named(name, library, monkeypatch):
    """On a GPU-less machine without the library the reason names it (the device check passes
    for this test: it is the library that is missing)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == library else real(n, *a))
    monkeypatch.setattr(torch.version, "hip", None)
    reason = get_backend(name).cannot_run(W4, 256, 512, CUDA, torch.float16)
    assert reason is not None and "not installed" in reason and f"pip install {library}" in reason


def test_peers_come_after_ours_and_reasons_cover_every_backend():
    reasons = backend_reasons(W4, 256, 512, CPU, torch.float32)
    names = list(reasons)
    assert names.index("cpu") < names.index("tinygemm") < names.index("reference")
    assert reasons["reference"] is None and reasons["tinygemm"] is None
    assert choose_backend(W4, 256, 512, CPU, torch.float32)[0].name == "cpu"


PEERS = ("marlin", "gemlite", "tinygemm")
GPU_CASES = [(bits, gs, sym) for bits in (4, 8) for gs in (-1, 64, 128) for sym in (True, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("bits,gs,sym", GPU_CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.bfloat16, 3e-2)], ids=["fp16", "bf16"])
def test_gpu_matches_reference(name, bits, gs, sym, dtype, tol):
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    scheme = QuantScheme(bits=bits, group_size=gs, symmetric=sym)
    n, k = 512, 1024
    backend = get_backend(name)
    reason = backend.cannot_run(scheme, n, k, CUDA, dtype)
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    result = rtn(torch.randn(n, k), scheme).to("cuda")
    ref = ReferenceBackend()
    prepared = backend.prepare(result, dtype)
    for m in (1, 7, 64):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        y = backend.linear(x, prepared, scheme, n, k, None)
        want = ref.linear(x.float(), ref.prepare(result, torch.float32), scheme, n, k, None)
        err = float((y.float() - want).norm() / want.norm())
        assert err < tol, (m, err)


def test_benchmark_times_the_peers_that_run(tmp_path):
    """kernel_speed.py --peers: tinygemm runs on this CPU and is timed and checked against the
    reference; the GPU peers are listed with their reasons."""
    import json
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_speed.py"
    mod = runpy.run_path(str(script))
    args = mod["parse_args"](["--dry-run", "--peers", "--schemes", "w4g128", "--m", "1", "--out", str(tmp_path)])[0]
    rows = mod["run_dry"](args)
    assert rows and all(r["tinygemm_us"] > 0 and r["tinygemm_rel_err_vs_ref"] < 1e-2 for r in rows)
    assert all(set(r["peers_cannot_run"]) == {"marlin", "gemlite"} for r in rows)
    assert "tinygemm us" in (tmp_path / "kernels-dry-run-cpu.md").read_text()
    assert json.loads((tmp_path / "kernels-dry-run-cpu.json").read_text())["meta"]["peers"]


def test_benchmark_reads_the_floor_under_the_interpreter(tmp_path):
    """kernel_speed's read-only kernel (the floor of the bytes a layer moves) reads every word
    once and is set against ours in each row (Triton's interpreter, in a fresh process: the
    interpreter is chosen when Triton is imported)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_speed.py"
    check = (f"import runpy, torch; mod = runpy.run_path({str(script)!r}); "
             "buf = torch.arange(10000, dtype=torch.int32); out = torch.empty(3, dtype=torch.int32); "
             "assert int(mod['read_floor_fn']()(buf, out).sum()) == int(buf.sum()); "
             f"mod['main'](['--dry-run', '--schemes', 'w4g128', '--m', '1', '--no-reference', '--out', {str(tmp_path)!r}])")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads((tmp_path / "kernels-dry-run-cpu.json").read_text())["rows"]
    assert rows and all(r["read_us"] > 0 and r["vs_read"] == round(r["quant_us"] / r["read_us"], 3) for r in rows)
    assert "read floor us" in (tmp_path / "kernels-dry-run-cpu.md").read_text()
