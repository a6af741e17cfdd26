"""Data-parallel calibration (issue 29): ``torchrun --nproc-per-node 2 quantspec quantize`` with
gloo on this CPU splits the calibration samples across two processes and gives the checkpoint
one process gives.

Tolerance: the Hessians are summed in another order (fp32, differences ~1e-7 relative), so a
weight on a rounding boundary may round the other way, and GPTQ carries that flip's error along
its row and into later blocks' inputs: at most 1% of the packed code words may differ (without
act-order; with it a near-tie in diag(H) also reorders columns), and the two checkpoints' logits
differ by less than a tenth of their distance to the float model's. The reduction itself is
checked exactly: two processes' Hessians reduce to the Hessian of all their rows (1e-6).

AWQ's tolerances are in its test's docstring.
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
from torch import nn

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
    # fp32 Hessians: bf16 products (the default on a CPU with native bf16) round each process's
    # chunk of rows apart, so two processes would differ from one by more than summation order
    recipe = []
    if method == "gptq":
        (out.parent / f"{out.name}-recipe.yaml").write_text("method: gptq\ngptq: {hessian_dtype: float32}\n")
        recipe = ["--recipe", str(out.parent / f"{out.name}-recipe.yaml")]
    cmd = [*launcher, "quantize", str(folder), *recipe, "--method", method, "--out", str(out), "--calib", str(calib),
           *ARGS, "--calib-samples", "4"]
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


def test_methods_without_reductions_refuse_to_split_calibration():
    """A method that reduces nothing (``data_parallel`` False) is refused before any work, and
    before any collective call (no process group is needed to be refused)."""
    from helpers import tiny_model

    from quantspec.errors import QuantspecError
    from quantspec.quant.arch_infer import get_arch
    from quantspec.quant.calibrate import run_blockwise
    from quantspec.quant.distributed import ProcessGroupReducer
    from quantspec.quant.method import BlockMethod

    class Local(BlockMethod):
        pass

    model = tiny_model("llama")
    ids = torch.randint(3, 300, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(QuantspecError, match="Local cannot split calibration across processes"):
        run_blockwise(model, get_arch(model), ids, Local(), {}, progress=False, reducer=ProcessGroupReducer(0, 2))


W3 = {"bits": 3, "group_size": 32, "symmetric": False}
# small search samples, so that the sequence choices matter: of 5 sequences of 32 tokens the
# searches use sequence 0 only (rank 1 of 2 holds none of them), the clip checks 1 and 4 (one
# per rank); token samples of 10 tokens per sequence, cut to 48 (rank 1's 20 cut to 18)
AWQ_SMALL = {"search_tokens": 32, "clip_tokens": 48, "clip_check_seqs": 2}


def _awq_tiny(reducer, ids: torch.Tensor, scales: Path) -> dict:
    """AWQ at W3 g32 with clipping on a tiny Llama (fp32, 4 heads, 2 KV heads: o_proj is in no
    pair and judged on its own output) under ``reducer``: results, parameters and report."""
    from helpers import tiny_model

    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.arch_infer import get_arch
    from quantspec.quant.awq import AWQMethod, AWQSettings
    from quantspec.quant.calibrate import run_blockwise
    from quantspec.quant.options import AWQOptions
    from quantspec.quant.resume import result_tensors

    model = tiny_model("llama")
    plan = {n: QuantScheme(**W3) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    method = AWQMethod(AWQSettings(awq=AWQOptions(clip=True, save_scales=str(scales)), **AWQ_SMALL))
    report: dict = {}
    results = run_blockwise(model, get_arch(model), ids, method, plan, progress=False, report=report, reducer=reducer)
    return {"results": result_tensors(results, ""), "params": model.state_dict(), "report": report, "plan": list(plan)}


def _awq_process(rank: int, world: int, port: int, ids: torch.Tensor, out: Path) -> None:
    import torch.distributed as dist

    from quantspec.quant.distributed import ProcessGroupReducer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run = _awq_tiny(ProcessGroupReducer(rank, world), ids, out / f"scales{rank}.safetensors")
        torch.save(run, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


DECISIONS = ("awq_alpha", "awq_duo", "awq_objective", "clipped")
MEASURES = ("awq_loss", "awq_loss_rtn", "clip_gain", "clip_block_gain")


def test_awq_under_two_gloo_processes_makes_the_one_process_choices(tmp_path):
    """AWQ (W3 g32, clip search, the pair, block and model-level clip checks) with 5 samples split
    3 + 2 across two gloo processes, against one process on all 5.

    Exact: both processes end with the same results and parameters, bit for bit, and write one
    scales file (rank 0); every decision equals the one process's: each pair's candidate scale
    (alpha, duo), its objective (the consuming module's output or the Linears'), which Linears
    keep clips, the model-level check's verdict.
    Tolerances, from summation order: mean |x|, the losses and the clip error curves are sums
    over the processes' sums (float64 across processes, fp32 within), not over all tokens at
    once, so they differ from one process's in the last bits (about 1e-7 relative); the
    scales built from them too, and so the folded norm weights (fp32): relative 1e-5. A scaled
    weight within that of a rounding boundary may round the other way: at most 0.1% of the
    entries of the results (codes, fp16 scales, zero points) may differ (none did when this
    test was written). Reported losses and gains: relative 1e-5; the KLs of the model-level
    check (sums of terms of both signs over the vocabulary): relative 1e-3.
    """
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from quantspec.quant.distributed import Reducer

    ids = torch.randint(3, 300, (5, 32), generator=torch.Generator().manual_seed(0))
    mp.spawn(_awq_process, args=(2, _free_port(), ids, tmp_path), nprocs=2, join=True)
    two, peer = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for part in ("results", "params"):
        assert all(torch.equal(two[part][k], peer[part][k]) for k in two[part]), part
    assert (tmp_path / "scales0.safetensors").is_file() and not (tmp_path / "scales1.safetensors").exists()
    torch.set_num_threads(1)
    one = _awq_tiny(Reducer(), ids, tmp_path / "one.safetensors")

    layers = one["plan"]
    checked = [n for n in layers if "clip_model_check" in one["report"][n]]
    assert checked and any("clip_block_gain" in one["report"][n] for n in layers)  # every check ran
    for n in layers:
        a, b = one["report"][n], two["report"][n]
        assert {k: a.get(k) for k in DECISIONS} == {k: b.get(k) for k in DECISIONS}, n
        assert a.keys() == b.keys(), n
        for k in MEASURES:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5), (n, k)
    for n in checked:
        a, b = one["report"][n]["clip_model_check"], two["report"][n]["clip_model_check"]
        assert a["kept"] == b["kept"]
        assert b["kl_clipped"] == pytest.approx(a["kl_clipped"], rel=1e-3)
        assert b["kl_unclipped"] == pytest.approx(a["kl_unclipped"], rel=1e-3)
    assert one["results"].keys() == two["results"].keys()
    differ = sum(int((one["results"][k] != two["results"][k]).sum()) for k in one["results"])
    assert differ <= 1e-3 * sum(t.numel() for t in one["results"].values())
    dense = [k for k in one["params"] if k.rpartition(".")[0] not in layers]  # norms (scales folded), embeddings
    assert any("layernorm" in k for k in dense)
    for k in dense:
        assert torch.allclose(two["params"][k], one["params"][k], rtol=1e-5, atol=0), k
    sa, sb = load_file(str(tmp_path / "one.safetensors")), load_file(str(tmp_path / "scales0.safetensors"))
    assert sa.keys() == sb.keys() and any(k.endswith(".clip") for k in sa)
    for k in sa:
        assert torch.allclose(sb[k], sa[k], rtol=1e-5, atol=0), k


@pytest.mark.parametrize("n,world", [(5, 2), (7, 3), (2, 2)])
def test_uneven_shares_choose_the_one_process_rows(n, world):
    """The rows a process keeps of a choice over all rows (``Share.local``; ``spread`` of a
    token sample), taken in rank order over ``tensor_split``'s shares, are the one process's."""
    from quantspec.quant.awq.objective import held_out, spread
    from quantspec.quant.distributed import Share

    sizes = [len(p) for p in torch.tensor_split(torch.arange(n), world)]
    shares = [Share(sum(sizes[:r]), sizes[r], n) for r in range(world)]
    for chosen in (held_out(n, {0}, 2), held_out(n, set(), n), [n - 1]):
        assert [s.offset + i for s in shares for i in s.local(chosen)] == chosen
    rows = torch.arange(3 * n + 1, dtype=torch.float32)[:, None]  # a token sample of 3n + 1 rows
    parts = torch.tensor_split(rows, world)
    samples = [Share(sum(len(p) for p in parts[:r]), len(parts[r]), len(rows)) for r in range(world)]
    for t in (1, n, 3 * n, 3 * n + 1, 4 * n):
        assert torch.equal(torch.cat([spread(p, t, s) for p, s in zip(parts, samples)]), spread(rows, t)), t


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


def test_pair_objective_ignores_the_early_stop_bound_across_processes():
    """A process's running sum of squared errors is only a part of a candidate's loss, so under
    data-parallel calibration (``Reducer.active``; here a Reducer of world 2 whose reductions
    are identities stands for the process group) every part is evaluated, however low the
    bound; one process still stops after the part that passes it."""
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.awq import PART_TOKENS, PairObjective
    from quantspec.quant.distributed import Reducer
    from quantspec.quant.smoothing import ResolvedPair

    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 32, generator=gen))
    pair = ResolvedPair("", None, ("lin",), (lin,))
    x = torch.randn(3 * PART_TOKENS, 32, generator=gen)
    planned, s = {"lin": QuantScheme(**W3)}, torch.ones(32)
    parts = []
    counted = lin.register_forward_hook(lambda *a: parts.append(1))
    try:
        one, split = (PairObjective(pair, planned, x, None, reducer=r) for r in (Reducer(), Reducer(0, 2)))
        full = one(s)
        parts.clear()
        assert one(s, 0.0) <= full and len(parts) == 1
        parts.clear()
        assert split(s, 0.0) == full and len(parts) == 3
    finally:
        counted.remove()
