"""Data-parallel calibration (issue 29): ``torchrun --nproc-per-node 2 quantspec quantize`` with
gloo on this CPU splits the calibration samples across two processes and gives the checkpoint
one process gives.

Tolerance: the Hessians are summed in another order (fp32, differences ~1e-7 relative), so a
weight on a rounding boundary may round the other way, and GPTQ carries that flip's error along
its row and into later blocks' inputs: at most 1% of the packed code words may differ (without
act-order; with it a near-tie in diag(H) also reorders columns), and the two checkpoints' logits
differ by less than a tenth of their distance to the float model's. The reduction itself is
checked exactly: two processes' Hessians reduce to the Hessian of all their rows (1e-6).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import calib_text, checkpoint_tensors, make_tiny_model

ARGS = ["--calib-seqlen", "32", "--no-act-order", "--no-progress", "--no-compare"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantize(folder: Path, out: Path, calib: Path, method: str, processes: int) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "quantspec"] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
        f"--master-port={_free_port()}", "-m", "quantspec"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [*launcher, "quantize", str(folder), "--method", method, "--out", str(out), "--calib", str(calib), *ARGS,
           "--calib-samples", "4"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def calib(tmp_path) -> Path:
    return calib_text(tmp_path)


def test_two_gloo_processes_give_the_one_process_checkpoint(tmp_path, calib):
    folder = make_tiny_model(tmp_path, "qwen3_moe")
    one = _quantize(folder, tmp_path / "one", calib, "gptq", 1)
    two = _quantize(folder, tmp_path / "two", calib, "gptq", 2)
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 alone writes and reports
    a, b = checkpoint_tensors(tmp_path / "one"), checkpoint_tensors(tmp_path / "two")
    assert a.keys() == b.keys()
    differ = sum(int((a[k] != b[k]).sum()) for k in a if a[k].dtype == torch.int32)
    words = sum(a[k].numel() for k in a if a[k].dtype == torch.int32)
    assert differ <= 0.01 * words  # GPTQ spreads a flipped rounding along its row and into later blocks
    import quantspec
    from helpers import tiny_model

    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = tiny_model("qwen3_moe")(ids).logits
        l1 = quantspec.load_quantized(tmp_path / "one", backend="reference", dtype="float32")(ids).logits
        l2 = quantspec.load_quantized(tmp_path / "two", backend="reference", dtype="float32")(ids).logits
    assert (l1 - l2).norm() <= 0.1 * (l1 - dense).norm()  # far inside the quantization error
    ra = json.loads((tmp_path / "one" / "quant_report.json").read_text())
    rb = json.loads((tmp_path / "two" / "quant_report.json").read_text())
    assert rb["processes"] == 2 and ra["processes"] == 1
    routed = {n: e["routed_tokens"] for n, e in ra["layers"].items() if "routed_tokens" in e}
    assert routed and routed == {n: e["routed_tokens"] for n, e in rb["layers"].items() if "routed_tokens" in e}


def test_smoothquant_under_two_gloo_processes_is_the_one_process_checkpoint(tmp_path, calib):
    """SmoothQuant's statistic (max |x| per channel) reduces exactly (a maximum has no order),
    and RTN needs none: the two checkpoints are bit-identical."""
    folder = make_tiny_model(tmp_path, "llama")
    runs = [_quantize(folder, tmp_path / str(n), calib, "smoothquant", n) for n in (1, 2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = checkpoint_tensors(tmp_path / "1"), checkpoint_tensors(tmp_path / "2")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_methods_without_reductions_refuse_torchrun(tmp_path, calib):
    folder = make_tiny_model(tmp_path, "llama")
    run = _quantize(folder, tmp_path / "q", calib, "awq", 2)
    assert run.returncode != 0
    assert "awq cannot split its calibration across processes" in run.stderr
    assert not (tmp_path / "q").exists()


def _reduce_hessians(rank: int, world: int, port: int, rows: list[torch.Tensor], out: Path) -> None:
    import torch.distributed as dist

    from quantspec.quant.distributed import ProcessGroupReducer
    from quantspec.quant.hessian import accumulate_hessian, make_empty_hessian

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = rows[rank]
        H, n = accumulate_hessian(make_empty_hessian(x.shape[-1], x.device), x, 0)
        H, n = ProcessGroupReducer(rank, world).hessian(H, n)
        if rank == 0:
            torch.save({"H": H, "n": n}, out)
    finally:
        dist.destroy_process_group()


def test_hessians_reduce_to_the_hessian_of_all_rows(tmp_path):
    """Unequal shares (5 and 11 rows): the row-weighted mean, not the plain mean."""
    import torch.multiprocessing as mp

    from quantspec.quant.hessian import accumulate_hessian, make_empty_hessian

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(5, 16, generator=gen), torch.randn(11, 16, generator=gen) * 3]
    mp.spawn(_reduce_hessians, args=(2, _free_port(), rows, tmp_path / "h.pt"), nprocs=2, join=True)
    got = torch.load(tmp_path / "h.pt")
    want, n = accumulate_hessian(make_empty_hessian(16, torch.device("cpu")), torch.cat(rows), 0)
    assert got["n"] == n == 16
    assert torch.allclose(got["H"], want, rtol=1e-6, atol=1e-6)
