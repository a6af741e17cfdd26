"""The cpu backend against the reference backend.

Tolerances (relative Frobenius error of y against the reference):
* C++ extension, weight-only: activations are quantized to int8 per block of <= 128 columns,
  which costs ~0.5-1% relative error (observed <= 0.9% on Gaussian data): EXT_TOL = 2e-2.
  Against the reference run on the *same* block-quantized activations the kernel must agree to
  fp32 accumulation order: EXACT_TOL = 1e-5 (this is what catches indexing/packing bugs).
* torch's packed ops (no compiler): bf16 activations and bf16 scales: TORCH_TOL = 1.5e-2.
* W8A8: both paths quantize per token as the reference and multiply exactly: EXACT_TOL.
* bf16 inputs add the rounding of the bf16 output (2^-9): BF16_TOL = 2.5e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

from quantspec.kernels import cpu as cpu_mod
from quantspec.kernels.cpu import (
    CpuBackend,
    layout_columns,
    panels_supported,
    prepare_ext,
    prepare_torch,
)
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import QuantScheme

EXT_TOL, EXACT_TOL, TORCH_TOL, BF16_TOL = 2e-2, 1e-5, 1.5e-2, 2.5e-2
MS = (1, 2, 5, 16, 33)
SHAPES = ((48, 256), (200, 200))

needs_ext = pytest.mark.skipif(load_cpu_ext() is None, reason="no C++ compiler / build failed")
# the extension's layouts: rows everywhere, panels where the CPU has AVX-512 VNNI
LAYOUTS = ("rows", pytest.param("panels", marks=pytest.mark.skipif(
    not panels_supported(), reason="the panel layout needs AVX-512 VNNI")))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12))


def make_result(bits, group_size, symmetric, act_order, n, k, seed=0):
    torch.manual_seed(seed)
    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric, act_order=act_order)
    result = rtn(torch.randn(n, k), scheme)
    if act_order:
        perm = torch.randperm(k)
        result.g_idx = (perm // scheme.group_len(k)).to(torch.int32)
    return result


def reference(result, x, bias=None):
    ref = ReferenceBackend()
    n, k = result.shape
    return ref.linear(x, ref.prepare(result, x.dtype), result.scheme, n, k, bias)


def block_quantized_x(x: torch.Tensor, prepared: dict) -> torch.Tensor:
    """What the extension sees: x gathered, int8 per block, dequantized, scattered back."""
    k = x.shape[1]
    block = int(prepared["meta"][2])
    kp = layout_columns(prepared)
    src = prepared["src"].long() if prepared["src"].numel() else torch.arange(kp).clamp(max=k)
    xl = torch.nn.functional.pad(x.float(), (0, 1))[:, src].reshape(x.shape[0], -1, block)
    scale = (xl.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-10)
    xhat = (torch.round(xl / scale).clamp(-127, 127) * scale).reshape(x.shape[0], kp)
    out = torch.zeros(x.shape[0], k + 1)
    out[:, src] = xhat
    return out[:, :k]


CASES = [
    (bits, gs, sym, act)
    for bits in (4, 8)
    for gs in (-1, 32, 64, 128)
    for sym in (True, False)
    for act in (False, True)
    if not (act and gs == -1)
]


@needs_ext
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_extension_matches_reference(bits, gs, sym, act, layout):
    backend = CpuBackend()
    for n, k in SHAPES + ((37, 576),):  # 37 rows: a partial 16-row panel
        result = make_result(bits, gs, sym, act, n, k)
        prepared = prepare_ext(result, layout)
        bias = torch.randn(n)
        for m in MS:
            x = torch.randn(m, k)
            y = backend.linear(x, prepared, result.scheme, n, k, bias)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert rel_err(y, reference(result, x, bias)) < EXT_TOL, (n, k, m)
            exact = reference(result, block_quantized_x(x, prepared), bias)
            assert rel_err(y, exact) < EXACT_TOL, (n, k, m)


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_torch_fallback_matches_reference(bits, gs, sym, act):
    backend = CpuBackend()
    for n, k in SHAPES:
        result = make_result(bits, gs, sym, act, n, k, seed=1)
        prepared = prepare_torch(result)
        for m in (1, 5, 33):
            x = torch.randn(m, k)
            y = backend.linear(x, prepared, result.scheme, n, k, None)
            assert rel_err(y, reference(result, x)) < TORCH_TOL, (n, k, m)


@needs_ext
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bits", (2, 3))
def test_low_bits_share_the_nibble_kernel(bits, layout):
    result = make_result(bits, 32, False, True, 48, 200)
    prepared = prepare_ext(result, layout)
    x = torch.randn(5, 200)
    y = CpuBackend().linear(x, prepared, result.scheme, 48, 200, None)
    assert rel_err(y, reference(result, block_quantized_x(x, prepared))) < EXACT_TOL


@pytest.mark.parametrize("layout", LAYOUTS + ("torch",))
def test_w8a8_matches_per_token_reference(layout):
    use_ext = layout != "torch"
    if use_ext and load_cpu_ext() is None:
        pytest.skip("no C++ compiler / build failed")
    torch.manual_seed(2)
    scheme = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
    backend = CpuBackend()
    for n, k in SHAPES:
        result = rtn(torch.randn(n, k), scheme)
        prepared = prepare_ext(result, layout) if use_ext else prepare_torch(result)
        for m in MS:
            x = torch.randn(m, k) * torch.linspace(0.1, 3.0, k)  # uneven channels
            y = backend.linear(x, prepared, scheme, n, k, None)
            assert rel_err(y, reference(result, x)) < EXACT_TOL, (n, k, m)


def _amx_or_skip():
    ext = load_cpu_ext()
    if ext is None or not panels_supported() or not ext.has_amx():
        pytest.skip("needs a CPU and OS with AMX-INT8 (the panel layout's tile path)")
    return ext


@pytest.mark.parametrize("bits,gs,sym,act", [
    (4, 128, True, False), (4, 32, False, True), (4, -1, False, False), (8, 64, True, True),
    (8, -1, False, False), (2, 64, False, False)])
def test_amx_tiles_equal_the_vnni_loop(bits, gs, sym, act):
    """The AMX path forms the same exact int32 block sums as the VNNI loop and scales them in the
    same order: bit-identical outputs, for full and partial 16-row tiles and panel triples."""
    ext = _amx_or_skip()
    for n, k in ((200, 256), (48, 512), (16, 64)):
        result = make_result(bits, gs, sym, act, n, k)
        p = prepare_ext(result, "panels")
        _, ext_bits, block, _ = p["meta"].tolist()
        for m in (8, 16, 17, 40):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            args = (x, p["w"], p["scales"], p["zeros"], p["src"], None, 4 if ext_bits <= 4 else 8,
                    block, n)
            assert torch.equal(ext.qgemm_panel_path(*args, 1), ext.qgemm_panel_path(*args, 0))


def test_amx_w8a8_whole_row_blocks_equal_the_vnni_loop():
    ext = _amx_or_skip()
    scheme = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
    for n, k in ((200, 256), (64, 1024), (40, 200)):
        p = prepare_ext(rtn(torch.randn(n, k), scheme), "panels")
        block = int(p["meta"][2])
        x = torch.randn(24, k)
        args = (x, p["w"], p["scales"], p["zeros"], p["src"], None, 8, block, n)
        vnni = ext.qgemm_panel_path(*args, 0)
        assert torch.equal(ext.qgemm_panel_path(*args, -1), vnni)  # auto: tiles where they fit
        if block % 64 == 0:
            assert torch.equal(ext.qgemm_panel_path(*args, 1), vnni)
        else:  # a row of 200 columns is no whole number of 64-byte tile rows
            with pytest.raises(RuntimeError, match="does not tile"):
                ext.qgemm_panel_path(*args, 1)


def test_amx_request_is_refused_where_tiles_cannot_run():
    ext = load_cpu_ext()
    if ext is None or not panels_supported():
        pytest.skip("needs the panel layout (AVX-512 VNNI)")
    if ext.has_amx():
        pytest.skip("this CPU runs AMX: the refusal is for CPUs without it")
    p = prepare_ext(make_result(4, 128, True, False, 32, 256), "panels")
    with pytest.raises(RuntimeError, match="AMX"):
        ext.qgemm_panel_path(torch.randn(16, 256), p["w"], p["scales"], p["zeros"], p["src"],
                             None, 4, int(p["meta"][2]), 32, 1)


@needs_ext
def test_bf16_and_leading_dims():
    result = make_result(4, 128, True, False, 48, 256)
    backend = CpuBackend()
    prepared = backend.prepare(result, torch.bfloat16)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    y = backend.linear(x, prepared, result.scheme, 48, 256, None)
    assert y.shape == (2, 3, 48) and y.dtype == torch.bfloat16
    assert rel_err(y, reference(result, x)) < BF16_TOL


@needs_ext
@pytest.mark.parametrize("bits,gs,k", [(4, 32, 200), (4, 64, 200), (4, 128, 200), (4, 64, 576),
                                       (4, 128, 384), (8, 64, 200), (8, -1, 200), (8, -1, 224)])
def test_scalar_path_matches_simd_path(bits, gs, k):
    """The rows layout's AVX2 path against its portable loop, for 1..19 activation rows (tiles
    of 4 and their remainders), odd 64-column chunk counts and 32-column tails."""
    ext = load_cpu_ext()
    if not ext.has_avx2():
        pytest.skip("this CPU has no AVX2")
    result = make_result(bits, gs, False, gs != -1, 48, k)
    p = prepare_ext(result, "rows")
    args = (p["w"], p["scales"], p["zeros"], p["src"], None, 4 if bits == 4 else 8,
            int(p["meta"][2]))
    for m in (1, 3, 4, 7, 8, 13, 19):
        x = torch.randn(m, k)
        assert rel_err(ext.qgemm(x, *args, True), ext.qgemm(x, *args, False)) < EXACT_TOL, m


@needs_ext
def test_threads_split_n_without_changing_results():
    result = make_result(4, 64, False, True, 1000, 256)
    prepared = prepare_ext(result)
    x = torch.randn(3, 256)
    one = CpuBackend().linear(x, prepared, result.scheme, 1000, 256, None)
    torch.set_num_threads(2)
    two = CpuBackend().linear(x, prepared, result.scheme, 1000, 256, None)
    assert torch.equal(one, two)  # each output is computed by one thread, in one order


@needs_ext
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_path_for_large_m(monkeypatch, layout):
    monkeypatch.setattr(cpu_mod, "DENSE_FROM_M", 4)
    monkeypatch.setattr(cpu_mod, "DENSE_TILE_N", 32)  # several tiles
    backend = CpuBackend()
    for bits, act in ((4, True), (8, False)):
        result = make_result(bits, 64, False, act, 200, 200)
        prepared = prepare_ext(result, layout)
        x = torch.randn(9, 200)
        y = backend.linear(x, prepared, result.scheme, 200, 200, None)
        assert rel_err(y, reference(result, x)) < 1e-5  # fp32 activations, no int8 step


def test_cannot_run_reasons():
    backend = CpuBackend()
    scheme = QuantScheme(bits=4, group_size=128)
    cpu = torch.device("cpu")
    assert backend.cannot_run(scheme, 4096, 4096, cpu, torch.bfloat16) is None
    assert backend.cannot_run(scheme, 48, 200, cpu, torch.float32) is None
    assert "CPU" in backend.cannot_run(scheme, 4096, 4096, torch.device("cuda"), torch.float16)
    assert "fp32" in backend.cannot_run(scheme, 4096, 4096, cpu, torch.float64)
    assert backend.cannot_run(scheme, 0, 4096, cpu, torch.float32) == "empty layer"


def test_linear_rejects_wrong_width():
    result = make_result(4, 32, True, False, 48, 64)
    backend = CpuBackend()
    prepared = backend.prepare(result, torch.float32)
    with pytest.raises(ValueError, match="features"):
        backend.linear(torch.randn(2, 65), prepared, result.scheme, 48, 64, None)


def test_extension_builds_where_a_compiler_exists():
    """Where a compiler exists the extension must build: a failed build would otherwise only
    skip every kernel test above (``needs_ext``), as it did on AVX2-only hosts."""
    from quantspec.kernels import cpu_ext

    if not cpu_ext.compiler_available():
        pytest.skip("no C++ compiler on this machine: the torch-ops fallback is what runs")
    assert load_cpu_ext() is not None, "the C++ extension failed to build: see the RuntimeWarning"


@needs_ext
def test_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build guard is a plain ``lock`` file that a killed build leaves behind; the next
    load must not wait on it forever (it did: the whole suite hung on one). The built extension
    is copied into a fresh cache with such a file, and a new process must load it in time."""
    import shutil
    import subprocess
    import sys

    from quantspec.kernels import cpu_ext
    from quantspec.models.paths import cache_root

    name = cpu_ext.build_name()
    shutil.copytree(cache_root() / "ext" / name, tmp_path / "ext" / name)
    (tmp_path / "ext" / name / "lock").write_text("")  # what a killed build leaves
    code = "from quantspec.kernels.cpu_ext import load_cpu_ext; assert load_cpu_ext() is not None"
    env = {**os.environ, "QUANTSPEC_CACHE": str(tmp_path)}
    try:
        done = subprocess.run([sys.executable, "-c", code], check=False, env=env, timeout=120, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("loading the extension waited on a dead build's lock file")
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "ext" / name / "lock").exists()


def test_build_lock_is_released_when_its_holder_dies(tmp_path):
    """The OS lock that replaces trust in the file: a holder killed mid-build frees it."""
    import fcntl
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys, time; from pathlib import Path; from quantspec.kernels.cpu_ext import build_lock\n"
          "with build_lock(Path(sys.argv[1])):\n print('held', flush=True); time.sleep(600)"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(tmp_path / ".quantspec-build.flock", "a+") as handle:
            with pytest.raises(BlockingIOError):  # held while the holder lives
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            holder.kill()
            holder.wait(timeout=30)
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free once it died
    finally:
        holder.kill()


def test_falls_back_to_torch_ops_without_compiler(monkeypatch):
    from quantspec.kernels import cpu_ext

    monkeypatch.setattr(cpu_ext, "compiler_available", lambda: False)
    cpu_ext.load_cpu_ext.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            assert cpu_ext.load_cpu_ext() is None
        result = make_result(4, 128, True, False, 48, 256)
        prepared = CpuBackend().prepare(result, torch.float32)
        assert int(prepared["meta"][0]) == cpu_mod.INT4PACK
    finally:
        cpu_ext.load_cpu_ext.cache_clear()


@needs_ext
@pytest.mark.parametrize("bits,gs,act", [(4, 64, True), (8, -1, False)])
def test_bound_op_equals_linear(bits, gs, act):
    """``bind``'s dispatcher op gives exactly what ``linear`` gives (same kernel, same inputs),
    for 3-D inputs, bias, bf16 and the large-M dense path; bad input is refused alike."""
    result = make_result(bits, gs, False, act, 200, 256)
    backend = CpuBackend()
    for dtype in (torch.float32, torch.bfloat16):
        prepared = backend.prepare(result, dtype)
        run = backend.bind(prepared, result.scheme, 200, 256)
        bias = torch.randn(200, dtype=dtype)
        for m in (1, 3, 40):
            x = torch.randn(2, m, 256, dtype=dtype)
            y = run(x, prepared, bias)
            assert y.shape == (2, m, 200) and y.dtype == dtype
            assert torch.equal(y, backend.linear(x, prepared, result.scheme, 200, 256, bias))
    with pytest.raises(ValueError, match="features"):
        run(torch.randn(2, 255), prepared, None)
    assert backend.bind(prepare_torch(result), result.scheme, 200, 256) is None


@needs_ext
def test_quant_linear_uses_the_bound_op_eager_and_compiled():
    """QuantLinear on the cpu backend: the bound op runs eager, and torch.compile captures it as
    one ``quantspec_cpu.qgemm`` node (no graph break, no Python custom op) with eager's output."""
    from quantspec.kernels.quant_linear import QuantLinear

    result = make_result(4, 64, True, False, 96, 128)
    q = QuantLinear.from_result(result, "gptq", torch.randn(96), dtype=torch.float32)
    assert q.prepare("cpu") == "cpu" and q._runner is not None
    x = torch.randn(3, 128)
    eager = q(x)
    assert torch.equal(eager, CpuBackend().linear(x, q.prepared(), result.scheme, 96, 128, q.bias))
    seen = []

    def capture(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    assert torch.equal(torch.compile(q, backend=capture, fullgraph=True)(x), eager)
    assert sum("quantspec_cpu.qgemm" in t for t in seen) == 1, seen
    torch._dynamo.reset()
    assert torch.equal(torch.compile(q, backend="aot_eager", fullgraph=True)(x), eager)


@needs_ext
def test_prepared_cache_follows_moved_buffers():
    """QuantLinear caches the dict of its prepared buffers; ``.to()``-style moves replace them."""
    from quantspec.kernels.quant_linear import QuantLinear

    q = QuantLinear.from_result(make_result(4, 64, True, False, 32, 64), "gptq", None, torch.float32)
    q.prepare("cpu")
    x = torch.randn(2, 64)
    before = q(x)
    q._apply(lambda t: t.clone())  # what .to()/.cpu() do when they copy
    assert all(q.prepared()[name] is getattr(q, f"_p_{name}") for name in q.prepared())
    assert torch.equal(q(x), before)


@needs_ext
def test_bound_layer_survives_pickle_and_deepcopy():
    import copy
    import io

    from quantspec.kernels.quant_linear import QuantLinear

    q = QuantLinear.from_result(make_result(4, 64, True, False, 32, 64), "gptq", None, torch.float32)
    q.prepare("cpu")
    x = torch.randn(2, 64)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(q)):
        assert torch.equal(other(x), q(x))


def test_cpu_benchmark_rotation_and_read_floor():
    """benchmarks/kernels_cpu.py: --cold rotates distinct weight copies; the read floor reads
    every byte (its checksum is the sum of the buffer's 64-bit words)."""
    import runpy
    from pathlib import Path

    mod = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels_cpu.py"))
    seen = []
    fn, wbytes = mod["rotating"](lambda x, w: seen.append(w[0].data_ptr()),
                                 (torch.zeros(256, dtype=torch.uint8),), 256, cold_bytes=1000)
    for _ in range(8):
        fn(None)
    assert wbytes == 256 and len(set(seen)) == 4 and seen[:4] == seen[4:]  # ceil(1000/256) copies
    assert mod["llc_bytes"]() > 0
    if load_cpu_ext() is None:
        pytest.skip("no C++ compiler: the read floor is not built")
    words = torch.randint(0, 1 << 40, (4096,), dtype=torch.int64)
    expected = int(words.sum()) & ((1 << 64) - 1)
    got = mod["stream_read"]()(words.view(torch.uint8)) & ((1 << 64) - 1)
    assert got == expected


def test_two_checkouts_build_in_their_own_folders(tmp_path, monkeypatch):
    """The same sources elsewhere (a second checkout, a worktree) get another build folder: ninja
    records the absolute source paths, so a shared folder was rebuilt (minutes) at every switch."""
    import shutil

    from quantspec.kernels import cpu_ext

    here = cpu_ext.build_name()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ext.SOURCES[0].parent, copy)
    monkeypatch.setattr(cpu_ext, "SOURCES", tuple(copy / s.name for s in cpu_ext.SOURCES))
    monkeypatch.setattr(cpu_ext, "HEADERS", tuple(copy / h.name for h in cpu_ext.HEADERS))
    assert cpu_ext.build_name() != here
