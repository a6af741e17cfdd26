"""Triton dequant-GEMM kernels against the reference backend.

CPU tests run the kernels in Triton's interpreter. ``triton.jit`` reads TRITON_INTERPRET when a
function is decorated, Triton's own library functions (tl.cdiv, tl.sum) included, so the
variable must be set before ``triton`` is first imported: ``test_kernels_in_interpreter``
runs this file again in a subprocess with TRITON_INTERPRET=1, where the ``interp`` tests run
(in the parent they are skipped); nothing leaks into other test files. To run them directly:
``TRITON_INTERPRET=1 pytest tests/test_triton_kernels.py``. The interpreter computes bf16
wrongly, so bf16 runs load and store bf16 but multiply in fp32 there; the bf16 tl.dot itself
is covered by the GPU tests.

Tolerance: max |y - y_ref| <= TOL[dtype] * max(1, max |y_ref|). The kernels round the
dequantized weight to the activation dtype before tl.dot and round the output once; the
reference dequantizes and multiplies in fp32.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from quantspec.kernels.reference import ReferenceBackend, quantize_per_token_int8
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import QuantResult, QuantScheme

from helpers import act_order_result

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}
GPU_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 1.6e-2}  # fp32 uses IEEE tl.dot
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
interp = pytest.mark.skipif(not INTERPRETING, reason="runs in test_kernels_in_interpreter's subprocess")


def _import_kernels() -> SimpleNamespace:
    return SimpleNamespace(
        backend=importlib.import_module("quantspec.kernels.triton_backend"),
        wq=importlib.import_module("quantspec.kernels.triton.wq_gemm"),
        prune=importlib.import_module("quantspec.kernels.triton.prune"),
        w8a8=importlib.import_module("quantspec.kernels.triton.w8a8"),
    )


@pytest.fixture
def tk():
    """The kernel modules (the process runs under TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    return _import_kernels()


def test_kernels_in_interpreter():
    """Run this file's interpreter tests in subprocesses with TRITON_INTERPRET=1: the collected
    tests dealt round-robin to one process per core (the interpreter is single-threaded Python),
    each of which must pass them all."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already inside the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
           "-k", "not test_kernels_in_interpreter"]
    listed = subprocess.run(cmd + ["--collect-only", __file__], env=env, cwd=root, capture_output=True, text=True,
                            timeout=300)
    ids = [line for line in listed.stdout.splitlines() if "::" in line]
    assert listed.returncode == 0 and ids, listed.stdout[-2000:] + listed.stderr[-2000:]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    shards = max(1, min(cores, 4))
    procs = [subprocess.Popen(cmd + ids[i::shards], env=env, cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(shards)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
        assert " passed" in out and "skipped" not in out, out[-2000:]


def make_case(scheme, n, k, m, dtype, bias=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    r = act_order_result(w, scheme, seed) if scheme.act_order else rtn(w, scheme)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return r, x, b


def check_close(y, y_ref, dtype, tol=TOL):
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    err = (y.float() - y_ref.float()).abs().max().item()
    bound = tol[dtype] * max(1.0, y_ref.float().abs().max().item())
    assert err <= bound, f"max error {err:.3g} > {bound:.3g} ({dtype})"


def run_both(backend, r, x, b):
    n, k = r.shape
    ref = ReferenceBackend()
    y_ref = ref.linear(x.cpu(), ref.prepare(r, x.dtype), r.scheme, n, k, None if b is None else b.cpu())
    rd = r.to(x.device)
    y = backend.linear(x, backend.prepare(rd, x.dtype), r.scheme, n, k, b)
    return y.cpu(), y_ref


S = QuantScheme
WEIGHT_ONLY = [
    S(4, -1, True),
    S(4, 32, False),
    S(4, 128, True),
    S(4, 128, False, act_order=True),
    S(4, 32, True, act_order=True),
    S(8, -1, True),  # w8a16 per channel
    S(8, 128, False),  # w8a16 grouped
    S(3, 64, False),
    S(2, 32, True),
]
M_VALUES = (1, 3, 17, 40)  # GEMV, small-M tl.dot with padded rows (3 and 17), tiled tl.dot
DTYPES = (torch.float16, torch.float32, torch.bfloat16)
SHAPES = ((48, 256), (72, 320), (256, 256))  # N, K off the 128-wide interpreter tiles; none off


def _weight_only_cases():
    for i, scheme in enumerate(WEIGHT_ONLY):
        strategies = ("permute", "gidx") if scheme.act_order else ("permute",)
        for j, m in enumerate(M_VALUES):
            for strategy in strategies:
                dtype = DTYPES[(i + j) % 3]
                n, k = SHAPES[(i + j) % 3]
                yield pytest.param(scheme, m, dtype, n, k, strategy,
                                   id=f"{scheme.short_name}-M{m}-{str(dtype)[6:]}-{n}x{k}-{strategy}")


@interp
@pytest.mark.parametrize("scheme,m,dtype,n,k,strategy", list(_weight_only_cases()))
def test_weight_only_matches_reference(tk, scheme, m, dtype, n, k, strategy):
    r, x, b = make_case(scheme, n, k, m, dtype, bias=(m % 2 == 1))
    backend = tk.backend.TritonBackend(act_order=strategy)
    y, y_ref = run_both(backend, r, x, b)
    check_close(y, y_ref, dtype)


@interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4g128_every_dtype_and_3d_input(tk, dtype):
    scheme = S(4, 128, False)
    r, _, b = make_case(scheme, 72, 384, 1, dtype)
    x = torch.randn(2, 3, 384).to(dtype)
    backend = tk.backend.TritonBackend()
    y, y_ref = run_both(backend, r, x, b)
    assert y.shape == (2, 3, 72)
    check_close(y, y_ref, dtype)


@interp
@pytest.mark.parametrize("m,split_k", [(2, 3), (20, 2), (20, 4), (40, 2)])
def test_split_k_partials_are_reduced(tk, m, split_k):
    """Explicit split-K (one split is empty when split_k > K tiles) on the GEMV and dot paths."""
    scheme = S(4, 32, False)
    r, x, b = make_case(scheme, 48, 384, m, torch.float16)
    p = tk.backend.TritonBackend().prepare(r, torch.float16)
    y = tk.wq.wq_linear(x, p["qweight"], p["scales"], p["zeros"], None, b, bits=4, group_size=32,
                        split_k=split_k)
    ref = ReferenceBackend()
    check_close(y, ref.linear(x, ref.prepare(r, x.dtype), scheme, 48, 384, b), torch.float16)


SWAP_AB_CASES = [  # (scheme, m, dtype, n, k, split_k): the interpreter's tiles are 32 x 128 x 128
    (S(4, 128, True), 3, torch.float16, 72, 320, 1), (S(4, 128, False), 16, torch.float16, 200, 384, 2),
    (S(4, 128, False), 17, torch.float32, 72, 320, 3), (S(4, 128, True), 32, torch.float32, 256, 256, 1),
    (S(4, -1, False), 32, torch.float16, 130, 256, 2), (S(8, 128, False), 17, torch.float16, 48, 320, 2),
    (S(8, -1, True), 3, torch.float32, 72, 256, 1), (S(3, 64, False), 16, torch.float16, 72, 320, 1),
    (S(2, 32, True), 17, torch.float32, 48, 256, 2),
]


@interp
@pytest.mark.parametrize("scheme,m,dtype,n,k,split_k", SWAP_AB_CASES,
                         ids=[f"{c[0].short_name}-M{c[1]}-{str(c[2])[6:]}-{c[3]}x{c[4]}-split{c[5]}"
                              for c in SWAP_AB_CASES])
def test_small_m_swap_ab_matches_reference(tk, monkeypatch, scheme, m, dtype, n, k, split_k):
    """The small-M tl.dot path with SWAP_AB (acc.T += W.T @ x.T, forced on here): 8- and 4-bit
    fields (the tl.join unpack), 2-bit (broadcast shift), 3-bit, groups inside and across the K
    tile, with and without zeros, split-K, N and K off the tiles (masked)."""
    monkeypatch.setattr(tk.wq, "SWAP_AB_BACKENDS", frozenset({"interpreter"}))
    metas, real = [], tk.wq._launch
    monkeypatch.setattr(tk.wq, "_launch", lambda family, kernel, grid, args, meta, *a: (
        metas.append((family, meta.get("SWAP_AB"))), real(family, kernel, grid, args, meta, *a)))
    r, x, b = make_case(scheme, n, k, m, dtype, bias=(m % 2 == 1))
    p = tk.backend.TritonBackend().prepare(r, dtype)
    y = tk.wq.wq_linear(x, p["qweight"], p["scales"], p.get("zeros"), None, b, bits=scheme.bits,
                        group_size=scheme.group_size, split_k=split_k)
    assert metas == [("small_m", True)]
    ref = ReferenceBackend()
    check_close(y, ref.linear(x, ref.prepare(r, x.dtype), scheme, n, k, b), dtype)


LARGE_M_SWAP_CASES = [(S(4, 128, True), torch.float16, 72, 320, "gptq"), (S(4, 32, False), torch.float32, 130, 256, "gptq"),
                      (S(8, -1, True), torch.float16, 48, 256, "gptq"), (S(3, 64, False), torch.float16, 72, 320, "gptq"),
                      (S(4, 128, True), torch.float16, 48, 256, "mma16x64")]


@interp
@pytest.mark.parametrize("scheme,dtype,n,k,layout", LARGE_M_SWAP_CASES,
                         ids=[f"{c[0].short_name}-{str(c[1])[6:]}-{c[2]}x{c[3]}-{c[4]}" for c in LARGE_M_SWAP_CASES])
def test_large_m_swap_ab_matches_reference(tk, monkeypatch, scheme, dtype, n, k, layout):
    """The tiled path (M = 40 > 32) with SWAP_AB forced (``SWAP_AB_LARGE_M_BACKENDS``, off by default):
    the scale multiplied into the weight operand, the accumulator transposed back at the store."""
    monkeypatch.setattr(tk.wq, "SWAP_AB_LARGE_M_BACKENDS", frozenset({"interpreter"}))
    metas, real = [], tk.wq._launch
    monkeypatch.setattr(tk.wq, "_launch", lambda family, kernel, grid, args, meta, *a: (
        metas.append((family, meta.get("SWAP_AB"))), real(family, kernel, grid, args, meta, *a)))
    r, x, b = make_case(scheme, n, k, 40, dtype)
    backend = tk.backend.TritonBackend(weight_layout=layout)
    y, y_ref = run_both(backend, r, x, b)
    assert metas == [("large_m", True)]
    check_close(y, y_ref, dtype)


@pytest.mark.parametrize("n,k", [(16, 64), (48, 256), (72, 320), (130, 200), (1, 9), (256, 128)])
@pytest.mark.parametrize("bits", [4, 3])
@pytest.mark.parametrize("lay", ["mma16x64", "mfma16x128"])
def test_preshuffle_round_trip(n, k, bits, lay):
    """layout.preshuffle then unshuffle gives the GPTQ words back (N, K off the 16 x 64 / 16 x 128
    atoms: padded with code 0), and each word holds the fragment the module doc names."""
    pytest.importorskip("triton")
    from quantspec.kernels.triton import layout
    from quantspec.kernels.triton_backend import pack_codes

    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    q = pack_codes(codes, bits)
    ps = layout.preshuffle(q, k, lay)
    ka = 64 if lay == "mma16x64" else 128
    assert ps.shape == (-(-n // 16), -(-k // ka), 2 * ka) and ps.dtype == torch.int32
    assert torch.equal(layout.unshuffle(ps, k, n, lay), q)
    w = ps.to(torch.int64) & 0xFFFFFFFF
    full = torch.zeros((-(-n // 16) * 16, -(-k // ka) * ka), dtype=torch.int64)
    full[:n, :k] = codes
    for nb, kb, a, b, s_, p in [(0, 0, 0, 0, 0, 0), (0, 0, 7, 3, 3, 7), (-1, -1, 5, 2, 1, 6), (-1, 0, 3, 15, 2, 5)]:
        nb, kb = nb % ps.shape[0], kb % ps.shape[1]
        j, k0 = p % 4, p // 4
        if lay == "mma16x64":  # a = g, b = c (mod 4), s_ = s: rows g, g + 8; k 2c + {0, 1, 8, 9}
            b %= 4
            got = (w[nb, kb, 16 * a + 4 * b + s_] >> (4 * p)) & 0xF
            want = full[16 * nb + a + 8 * (j & 1), 64 * kb + 16 * s_ + 8 * (j >> 1) + 2 * b + k0]
        else:  # a = q (mod 4), b = r, s_ = i: row r; k 32 i + 8 q + 2 j + k0
            a %= 4
            got = (w[nb, kb, 4 * (16 * a + b) + s_] >> (4 * p)) & 0xF
            want = full[16 * nb + b, 128 * kb + 32 * s_ + 8 * a + 2 * j + k0]
        assert got == want


def test_preshuffle_reasons():
    """What the pre-shuffled layout cannot hold keeps the GPTQ layout, with the reason."""
    pytest.importorskip("triton")
    from quantspec.kernels.triton import layout, wq_gemm

    assert layout.preshuffle_reason(4, 128, False) is None and layout.preshuffle_reason(3, 256, False) is None
    assert layout.preshuffle_reason(4, wq_gemm.PER_CHANNEL_GROUP, False) is None
    assert "4-bit" in layout.preshuffle_reason(8, 128, False) and "4-bit" in layout.preshuffle_reason(2, 128, False)
    assert "g_idx" in layout.preshuffle_reason(4, 128, True)
    assert "group 64" in layout.preshuffle_reason(4, 64, False)


PRESHUFFLED_CASES = [  # (scheme, m, dtype, n, k, split_k, swap[, layout]): interpreter tiles 32 x 128 x 128
    (S(4, 128, True), 1, torch.float16, 72, 320, 1, False), (S(4, 128, True), 3, torch.float16, 72, 320, 1, True),
    (S(4, 128, False), 16, torch.float16, 200, 384, 2, True), (S(4, 128, False), 17, torch.float32, 72, 320, 3, True),
    (S(4, 128, True), 32, torch.float32, 256, 256, 1, True), (S(4, -1, False), 32, torch.float16, 130, 256, 2, True),
    (S(3, 128, False), 17, torch.float16, 48, 384, 1, True), (S(4, 128, False), 17, torch.float16, 200, 384, 2, False),
    (S(4, 128, False), 2, torch.float16, 48, 256, 1, True), (S(4, 128, True, act_order=True), 16, torch.float16, 72, 256, 1, True),
    (S(4, 128, False), 40, torch.float16, 136, 320, 1, False), (S(4, -1, True), 17, torch.bfloat16, 64, 256, 2, True),
    (S(4, 128, True), 3, torch.float16, 72, 320, 1, True, "mfma16x128"),
    (S(4, 128, False), 17, torch.float16, 200, 384, 2, True, "mfma16x128"),
    (S(4, -1, False), 1, torch.float32, 48, 256, 1, False, "mfma16x128"),
    (S(3, 128, False), 40, torch.float16, 136, 320, 1, False, "mfma16x128"),
]


@interp
@pytest.mark.parametrize("scheme,m,dtype,n,k,split_k,swap,lay", [c if len(c) == 8 else (*c, "mma16x64")
                                                                 for c in PRESHUFFLED_CASES],
                         ids=[f"{c[0].short_name}-M{c[1]}-{str(c[2])[6:]}-{c[3]}x{c[4]}-split{c[5]}-{'swap' if c[6] else 'plain'}"
                              f"-{c[7] if len(c) == 8 else 'mma16x64'}" for c in PRESHUFFLED_CASES])
def test_preshuffled_matches_reference(tk, monkeypatch, scheme, m, dtype, n, k, split_k, swap, lay):
    """weight_layout "mma16x64" / "mfma16x128" (layout.py): M > 2 and fp32 x on the tl.dot kernel with
    PRESHUFFLED, the swapped product (forced on here) and the plain one, zeros on and off, 3- and 4-bit
    codes, per channel, act-order (permuted), split-K, N and K off the 16 x 64 atoms and the tiles
    (masked); fp16 / bf16 x at M <= 2 on the pre-shuffled GEMV (test_preshuffled_gemv_matches_reference)."""
    if swap:
        monkeypatch.setattr(tk.wq, "SWAP_AB_BACKENDS", frozenset({"interpreter"}))
    metas, real = [], tk.wq._launch
    monkeypatch.setattr(tk.wq, "_launch", lambda family, kernel, grid, args, meta, *a: (
        metas.append((family, meta.get("SWAP_AB"), meta.get("PRESHUFFLED"))), real(family, kernel, grid, args, meta, *a)))
    r, x, b = make_case(scheme, n, k, m, dtype, bias=(m % 2 == 1))
    backend = tk.backend.TritonBackend(weight_layout=lay)
    p = backend.prepare(r, dtype)
    key = {"mma16x64": "qweight_mma", "mfma16x128": "qweight_mfma"}[lay]
    assert key in p and "qweight" not in p
    y = tk.wq.wq_linear(x if "perm" not in p else x.index_select(1, p["perm"]), p[key], p["scales"],
                        p.get("zeros"), None, b, bits=scheme.bits, group_size=scheme.group_size, split_k=split_k,
                        layout=lay)
    code = 1 if lay == "mma16x64" else 2
    if m <= 2 and dtype != torch.float32:
        assert metas == [("gemv_preshuffled", None, code)]
    else:
        assert metas == [("small_m" if m <= 32 else "large_m", swap and m <= 32, code)]
    ref = ReferenceBackend()
    check_close(y, ref.linear(x, ref.prepare(r, x.dtype), scheme, n, k, b), dtype)
    y2, _ = run_both(backend, r, x, b)
    check_close(y2, y, dtype)


# ---- the packed GEMV on a pre-shuffled qweight (``_wq_gemv_ps_kernel``): M <= 2, fp16 / bf16 x ----
# (scheme, n, k): N off the 16-row atoms and the 128-wide tile, K off the 64 / 128 K atoms (padded
# with code 0: x must be 0 there), one K tile and several (K 1024: split-K by default), per channel
PS_GEMV_SHAPES = [(S(4, 128, True), 72, 264), (S(4, 128, False), 200, 384), (S(4, -1, False), 48, 328),
                  (S(4, -1, True), 130, 1024), (S(3, 128, False), 64, 256), (S(4, 128, False), 40, 520)]


def _ps_gemv_cases():
    """Both layouts x the shapes x M 1, 2; fp16 and bf16 x on the first two shapes, one of them on the rest."""
    for lay in ("mma16x64", "mfma16x128"):
        for i, (scheme, n, k) in enumerate(PS_GEMV_SHAPES):
            for m in (1, 2):
                both = (torch.float16, torch.bfloat16)
                for dtype in both if i < 2 else both[(i + m) % 2:][:1]:
                    yield scheme, n, k, m, dtype, lay


PS_GEMV_CASES = list(_ps_gemv_cases())


@interp
@pytest.mark.parametrize("scheme,n,k,m,dtype,lay", PS_GEMV_CASES,
                         ids=[f"{c[0].short_name}-{c[1]}x{c[2]}-M{c[3]}-{str(c[4])[6:]}-{c[5]}" for c in PS_GEMV_CASES])
def test_preshuffled_gemv_matches_reference(tk, monkeypatch, scheme, n, k, m, dtype, lay):
    """A pre-shuffled qweight keeps a GEMV at M <= 2 (``_wq_gemv_ps_kernel``, both layouts): 4- and
    3-bit codes, zeros on and off, groups 128 (a partial last one) and per channel, N and K off the atoms and tiles,
    split-K; TOL as every path (fp16 4e-3, bf16 1.6e-2 of max |y|: the bf16 path is fp32 arithmetic
    on bit-converted bf16, right in the interpreter too)."""
    used = _gemv_kernels_used(tk, monkeypatch)
    r, x, b = make_case(scheme, n, k, m, dtype, bias=(m == 1))
    y, y_ref = run_both(tk.backend.TritonBackend(weight_layout=lay), r, x, b)
    assert used == ["_wq_gemv_ps_kernel"]
    check_close(y, y_ref, dtype)


@interp
@pytest.mark.parametrize("lay,tile", [("mma16x64", (64, 64)), ("mma16x64", (32, 128)), ("mfma16x128", (16, 128)),
                                      ("mfma16x128", (64, 256))])
def test_preshuffled_gemv_other_tiles_and_split_k(tk, monkeypatch, lay, tile):
    """The GPU configs' tiles (one K atom a tile, two: a thread's K blocks chain in one partial),
    explicit split-K with an empty split, M 1 and 2."""
    bn, bk = tile
    monkeypatch.setattr(tk.wq.configs, "interpreter_config", lambda family: {"BLOCK_N": bn, "BLOCK_K": bk})
    scheme = S(4, -1 if bk > 128 else 128, False)
    used = _gemv_kernels_used(tk, monkeypatch)
    for m, split_k in ((1, 3), (2, 2)):
        r, x, b = make_case(scheme, 88, 520, m, torch.float16)
        p = tk.backend.TritonBackend(weight_layout=lay).prepare(r, torch.float16)
        key = {"mma16x64": "qweight_mma", "mfma16x128": "qweight_mfma"}[lay]
        y = tk.wq.wq_linear(x, p[key], p["scales"], p["zeros"], None, b, bits=4, group_size=scheme.group_size,
                            split_k=split_k, layout=lay)
        ref = ReferenceBackend()
        check_close(y, ref.linear(x, ref.prepare(r, x.dtype), scheme, 88, 520, b), torch.float16)
    assert used == ["_wq_gemv_ps_kernel"] * 2


@interp
def test_preshuffled_gemv_falls_back_to_the_dot_kernel(tk, monkeypatch):
    """A pre-shuffled qweight at M <= 2 that the packed GEMV cannot take (fp32 x, x rows not
    16-byte aligned) runs the tl.dot kernel, with the same results."""
    used = _gemv_kernels_used(tk, monkeypatch)
    backend = tk.backend.TritonBackend(weight_layout="mma16x64")
    r, x, b = make_case(S(4, 128, True), 64, 256, 1, torch.float16)
    p = backend.prepare(r, x.dtype)
    wide = torch.zeros(1, 264, dtype=torch.float16)
    wide[:, 1:257] = x
    ref = ReferenceBackend()
    check_close(backend.linear(wide[:, 1:257], p, r.scheme, 64, 256, b),
                ref.linear(x, ref.prepare(r, x.dtype), r.scheme, 64, 256, b), torch.float16)
    y, y_ref = run_both(backend, r, x.float(), b.float())
    check_close(y, y_ref, torch.float32)
    assert used == ["_wq_dot_kernel", "_wq_dot_kernel"]


@interp
@pytest.mark.parametrize("tile,lay", [((16, 16, 64), "mma16x64"), ((16, 32, 64), "mma16x64"), ((32, 64, 128), "mma16x64"),
                                      ((64, 256, 64), "mma16x64"), ((16, 256, 128), "mma16x64"),
                                      ((16, 16, 128), "mfma16x128"),
                                      ((64, 32, 256), "mfma16x128")])
def test_preshuffled_other_tiles(tk, monkeypatch, tile, lay):
    """The GPU configs' tiles (one 16 x 64 atom a tile and up; the interpreter's own is 32 x 128 x
    128), swapped or plain product, N and K off the tiles."""
    bm, bn, bk = tile
    monkeypatch.setattr(tk.wq, "SWAP_AB_BACKENDS", frozenset({"interpreter"}))
    monkeypatch.setattr(tk.wq.configs, "interpreter_config",
                        lambda family: {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1})
    scheme = S(4, -1 if bk > 128 else 128, False)  # the K tile in one group
    r, x, b = make_case(scheme, 88, 320, 17, torch.float16)
    p = tk.backend.TritonBackend(weight_layout=lay).prepare(r, torch.float16)
    key = {"mma16x64": "qweight_mma", "mfma16x128": "qweight_mfma"}[lay]
    y = tk.wq.wq_linear(x, p[key], p["scales"], p["zeros"], None, b, bits=4, group_size=scheme.group_size,
                        split_k=2, layout=lay)
    ref = ReferenceBackend()
    check_close(y, ref.linear(x, ref.prepare(r, x.dtype), scheme, 88, 320, b), torch.float16)


@interp
def test_preshuffled_layout_is_refused_where_it_does_not_match(tk):
    """The launcher refuses a qweight in the other layout, and a weight the layout cannot hold;
    the backend keeps the GPTQ layout (with a warning) where mma16x64 cannot hold the weight,
    and "auto" keeps it off the pre-shuffling backends (here: the interpreter)."""
    scheme = S(4, 128, True)
    r, x, b = make_case(scheme, 48, 256, 3, torch.float16)
    gptq = tk.backend.TritonBackend(weight_layout="gptq").prepare(r, torch.float16)
    mma = tk.backend.TritonBackend(weight_layout="mma16x64").prepare(r, torch.float16)
    assert "qweight" in tk.backend.TritonBackend().prepare(r, torch.float16)
    kw = dict(bits=4, group_size=128)
    with pytest.raises(ValueError, match="mma16x64"):
        tk.wq.wq_linear(x, mma["qweight_mma"], mma["scales"], None, None, b, **kw)
    with pytest.raises(ValueError, match="pre-shuffled"):
        tk.wq.wq_linear(x, gptq["qweight"], gptq["scales"], None, None, b, layout="mma16x64", **kw)
    with pytest.raises(ValueError, match="layout"):
        tk.wq.wq_linear(x, gptq["qweight"], gptq["scales"], None, None, b, layout="marlin", **kw)
    with pytest.raises(ValueError, match="mfma16x128"):  # the other pre-shuffled layout's shape
        tk.wq.wq_linear(x, mma["qweight_mma"], mma["scales"], None, None, b, layout="mfma16x128", **kw)
    with pytest.raises(ValueError, match="group 32"):
        tk.wq.wq_linear(x, mma["qweight_mma"], mma["scales"], None, None, b, layout="mma16x64", bits=4, group_size=32)
    r8, x8, _ = make_case(S(8, 128, True), 48, 256, 3, torch.float16)
    with pytest.warns(UserWarning, match="4-bit"):
        p8 = tk.backend.TritonBackend(weight_layout="mma16x64").prepare(r8, torch.float16)
    assert "qweight" in p8 and "qweight_mma" not in p8
    with pytest.raises(ValueError):
        tk.backend.TritonBackend(weight_layout="nope")


@interp
def test_act_order_layouts(tk):
    """'permute' sorts rows into contiguous groups; 'gidx' keeps g_idx; an irregular g_idx
    (unequal groups) falls back to 'gidx' under either strategy; static groups drop g_idx."""
    scheme = S(4, 32, True, act_order=True)
    r, x, _ = make_case(scheme, 48, 256, 3, torch.float32)
    permute, gidx = tk.backend.TritonBackend("permute"), tk.backend.TritonBackend("gidx")
    assert "perm" in permute.prepare(r, x.dtype) and "g_idx" not in permute.prepare(r, x.dtype)
    assert "g_idx" in gidx.prepare(r, x.dtype) and "perm" not in gidx.prepare(r, x.dtype)
    irregular = torch.randint(0, 8, (256,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    irregular[:8] = torch.arange(8, dtype=torch.int32)
    r2 = QuantResult(r.qweight, r.scales, r.zeros, irregular, scheme)
    p2 = permute.prepare(r2, x.dtype)
    assert "g_idx" in p2 and "perm" not in p2
    y, y_ref = run_both(permute, r2, x, None)
    check_close(y, y_ref, torch.float32)
    static = QuantResult(r.qweight, r.scales, r.zeros, (torch.arange(256) // 32).to(torch.int32), scheme)
    assert not {"perm", "g_idx"} & set(permute.prepare(static, x.dtype))


@interp
def test_pack_codes_bit_order(tk):
    """Field i of word j is row 8j+i (4-bit); 3-bit codes use 4-bit fields; 8-bit, 4 a word."""
    codes = torch.arange(9, dtype=torch.uint8).view(1, 9) % 16  # N=1, K=9
    words = tk.backend.pack_codes(codes, 4)
    assert words.shape == (2, 1) and words.dtype == torch.int32
    assert words[0, 0].item() == 0x76543210 and words[1, 0].item() == 8
    assert torch.equal(tk.backend.pack_codes(codes % 8, 3), tk.backend.pack_codes(codes % 8, 4))
    w8 = tk.backend.pack_codes(torch.tensor([[255, 1, 2, 128]], dtype=torch.uint8), 8)
    assert w8[0, 0].item() == (128 << 24 | 2 << 16 | 1 << 8 | 255) - 2**32


@interp
def test_quantize_per_token_matches_reference_exactly(tk):
    x = torch.randn(5, 300)
    x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: exact ties round half to even
    x[0, 4:] = 0.25
    x[1] = 0.0  # all-zero row: the 1e-10 scale floor
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, s = tk.w8a8.quantize_per_token(x.to(dtype))
        q_ref, s_ref = quantize_per_token_int8(x.to(dtype))
        assert torch.equal(q, q_ref), dtype
        assert torch.equal(s, s_ref.view(-1)), dtype


@interp
@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (17, torch.float32), (40, torch.bfloat16)])
def test_w8a8_matches_reference(tk, m, dtype):
    scheme = S(8, -1, True, activations="int8-token-dynamic")
    r, x, b = make_case(scheme, 72, 384, m, dtype)
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x, b)
    check_close(y, y_ref, dtype)


@interp
def test_cannot_run_and_bad_shapes(tk, monkeypatch):
    backend = tk.backend.TritonBackend()
    scheme = S(4, 128, True)
    assert backend.cannot_run(scheme, 64, 256, torch.device("cpu"), torch.float16) is None
    assert backend.cannot_run(scheme, 64, 256, torch.device("cpu"), torch.int8) is not None
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "GPU" in backend.cannot_run(scheme, 64, 256, torch.device("cpu"), torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError):
        tk.backend.TritonBackend("nope")
    r, x, b = make_case(scheme, 48, 256, 2, torch.float16)
    p = backend.prepare(r, torch.float16)
    with pytest.raises(ValueError, match="qweight"):
        tk.wq.wq_linear(x[:, :128], p["qweight"], p["scales"], None, None, b, bits=4, group_size=128)
    with pytest.raises(ValueError, match="split_k"):
        tk.wq.wq_linear(torch.randn(40, 256).half(), p["qweight"], p["scales"], None, None, b,
                        bits=4, group_size=128, split_k=0)


@interp
def test_custom_op_dispatches_to_triton(tk):
    """quantspec::quant_linear with backend "triton" (eager) equals the backend's own linear."""
    from quantspec.kernels.custom_ops import quant_linear

    scheme = S(4, 32, False, act_order=True)
    r, x, b = make_case(scheme, 48, 256, 3, torch.float16)
    backend = tk.backend.TritonBackend()
    p = backend.prepare(r, x.dtype)
    y = quant_linear(x, p, "triton", scheme, 48, 256, b)
    assert torch.equal(y, backend.linear(x, p, scheme, 48, 256, b))


@interp
@pytest.mark.parametrize("scheme,strategy,layout", [
    (S(4, 32, False, act_order=True), "permute", "auto"), (S(4, 128, True, act_order=True), "gidx", "auto"),
    (S(4, 128, True), "permute", "mma16x64"), (S(8, -1, True), "permute", "auto")])
def test_bound_layer_equals_linear(tk, scheme, strategy, layout):
    """TritonBackend.bind: the bound call (decisions read once) gives linear's output exactly,
    through a QuantLinear too (which then runs it), for a 3-d input and with act-order."""
    from quantspec.kernels.quant_linear import QuantLinear

    r, x, b = make_case(scheme, 48, 256, 3, torch.float16)
    backend = tk.backend.TritonBackend(act_order=strategy, weight_layout=layout)
    p = backend.prepare(r, x.dtype)
    bound = backend.bind(p, scheme, 48, 256)
    assert isinstance(bound, tk.backend.BoundWQ)
    x3 = x.reshape(1, 3, 256)
    assert torch.equal(bound(x3, p, b), backend.linear(x3, p, scheme, 48, 256, b))
    layer = QuantLinear.from_result(r, "gptq", b, torch.float16)
    assert layer.prepare("triton") == "triton" and isinstance(layer._runner, tk.backend.BoundWQ)
    default = tk.backend.TritonBackend()  # the registry's instance, which the layer runs
    assert torch.equal(layer(x3), default.linear(x3, default.prepare(r, x.dtype), scheme, 48, 256, b))


@interp
def test_siblings_fuse_on_the_triton_backend(tk):
    """q/k/v-like QuantLinears (one input, some with a bias) prepared on Triton: Siblings stacks them
    into one bound product (now that TritonBackend binds), outputs equal to the separate layers'."""
    from quantspec.kernels.quant_linear import QuantLinear
    from quantspec.kernels.siblings import Siblings

    scheme = S(4, 128, True)
    mods = []
    for i, n in enumerate((64, 32, 32)):
        r, x, b = make_case(scheme, n, 256, 3, torch.float16, bias=(i != 1), seed=i)
        layer = QuantLinear.from_result(r, "gptq", b, torch.float16)
        layer.prepare("triton")
        mods.append(layer)
    alone = [m(x) for m in mods]
    fused = Siblings(mods)
    assert fused.fused
    for y, want in zip(fused(x), alone):
        assert torch.equal(y, want)


@interp
def test_bind_leaves_w8a8_and_float_layers_to_linear(tk):
    backend = tk.backend.TritonBackend()
    for scheme in (S(8, -1, True, activations="int8-token-dynamic"), S(8, -1, True, weights="fp8")):
        r, x, _ = make_case(scheme, 48, 256, 3, torch.float16)
        assert backend.bind(backend.prepare(r, x.dtype), scheme, 48, 256) is None


def test_registry_skips_triton_on_cpu_without_interpreter(monkeypatch):
    from quantspec.kernels.backend import choose_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    chosen, _ = choose_backend(S(4, 128, True), 64, 256, torch.device("cpu"), torch.float32)
    assert chosen.name != "triton"


def test_benchmark_dry_run_writes_tables(tmp_path):
    """benchmarks/kernel_speed.py --dry-run: shape list, timing, table and JSON/Markdown writing."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_speed.py"
    mod = runpy.run_path(str(script))
    rows = mod["run_dry"](mod["parse_args"](["--dry-run", "--no-reference", "--out", str(tmp_path)])[0])
    assert {r["scheme"] for r in rows} == set(mod["SMOKE_SCHEMES"]) and all(r["quant_us"] > 0 for r in rows)
    data = json.loads((tmp_path / "kernels-dry-run-cpu.json").read_text())
    assert data["rows"] == rows and data["meta"]["dry_run"]
    assert "| w8a8 |" in (tmp_path / "kernels-dry-run-cpu.md").read_text()
    assert mod["peak_bandwidth"]("NVIDIA H100 80GB HBM3") == 3.35e12
    assert mod["peak_bandwidth"]("AMD Instinct MI300X") == 5.3e12


# ---- GPU (CUDA or ROCm): real compilation, autotuning, the bf16 tl.dot ----

def _gpu():
    if INTERPRETING or not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU and TRITON_INTERPRET unset")
    return _import_kernels()


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", WEIGHT_ONLY + [S(8, -1, True, activations="int8-token-dynamic")],
                         ids=lambda s: s.short_name)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("m", (1, 4, 17, 300))
def test_gpu_matches_reference(scheme, dtype, m):
    """Every path (M 1 GEMV, 4/17 small-M, 300 tiled) with the first config per family; fp32
    runs the same kernels (IEEE tl.dot) and is covered by the interpreter tests."""
    mods = _gpu()
    for strategy in ("permute", "gidx") if scheme.act_order else ("permute",):
        backend = mods.backend.TritonBackend(strategy, autotune=False)
        for n, k in ((72, 384), (1024, 1000), (512, 1024)):  # masked tiles; no masks (EVEN)
            r, x, b = make_case(scheme, n, k, m, dtype, device="cuda")
            y, y_ref = run_both(backend, r, x, b)
            check_close(y, y_ref, dtype, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["fp8-dynamic", "fp8-static", "fp8-block"])
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("m", (1, 17, 300))
def test_gpu_fp8_w8a8_matches_reference(preset, dtype, m):
    """FP8 W8A8 on the GPU's fp8 MMA (wgmma e4m3 on sm90, FNUZ MFMA on MI300) against the
    reference (E4M3FN; on MI300 the activation grid differs, which GPU_TOL covers at bf16)."""
    mods = _gpu()
    for n, k in ((72, 384), (1024, 1024)):
        g = torch.Generator().manual_seed(m + n)
        x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)[None, :]).to(dtype)
        r = _fp8_w8a8_result(preset, n, k, x, g)
        b = torch.randn(n, generator=g).to(dtype)
        y, y_ref = run_both(mods.backend.TritonBackend(), r, x.cuda(), b.cuda())
        check_close(y, y_ref, dtype, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [S(4, 128, True), S(4, 128, False), S(4, 32, False), S(4, -1, True)],
                         ids=lambda s: s.short_name)
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("m", (1, 2))
def test_gpu_packed_gemv_inline_asm_matches_reference(scheme, dtype, m, monkeypatch):
    """The packed GEMV with its pair operations as inline asm (PTX / AMDGCN, v_fma_mix_f32 for bf16
    x on ROCm: what ``wq_gemm.ASM_PAIR_OPS`` turns on once this passes on hardware) against the
    reference."""
    mods = _gpu()
    monkeypatch.setattr(mods.wq, "ASM_PAIR_OPS", True)
    backend = mods.backend.TritonBackend(autotune=False)
    for n, k in ((72, 384), (1024, 1024), (4096, 4096)):
        r, x, b = make_case(scheme, n, k, m, dtype, device="cuda")
        y, y_ref = run_both(backend, r, x, b)
        check_close(y, y_ref, dtype, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("lay", ("gptq", "mma16x64", "mfma16x128"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
@pytest.mark.parametrize("m", (3, 16, 32, 300))
def test_gpu_dot_inline_asm_matches_reference(lay, dtype, m, monkeypatch):
    """The tl.dot kernel with its pairs of code - zero as inline asm (what
    ``wq_gemm.ASM_DOT_PAIR_OPS`` turns on once this passes on hardware: PTX on CUDA, AMDGCN on ROCm,
    fp16 and bf16, the zero pairs built from the integer) against the reference, on each layout:
    small-M and tiled, sym and asym, per channel."""
    mods = _gpu()
    monkeypatch.setattr(mods.wq, "ASM_DOT_PAIR_OPS", True)
    backend = mods.backend.TritonBackend(autotune=False, weight_layout=lay)
    for scheme in (S(4, 128, True), S(4, 128, False), S(4, -1, True)):
        for n, k in ((1000, 1024), (512, 1024), (4096, 4096)):
            r, x, b = make_case(scheme, n, k, m, dtype, device="cuda")
            y, y_ref = run_both(backend, r, x, b)
            check_close(y, y_ref, dtype, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("lay", ("mma16x64", "mfma16x128"))
@pytest.mark.parametrize("asm", (False, True))
@pytest.mark.parametrize("m", (1, 2))
def test_gpu_preshuffled_gemv_every_config(lay, asm, m, monkeypatch):
    """The pre-shuffled GEMV with every config of the target's gemv_preshuffled list that reads the
    layout, its pair operations in plain Triton and as inline asm, fp16 and bf16 x, sym and asym."""
    mods = _gpu()
    from quantspec.kernels.triton import configs

    monkeypatch.setattr(mods.wq, "ASM_PAIR_OPS", asm)
    real = configs.configs_for
    code = 1 if lay == "mma16x64" else 2
    for cfg in [c for c in real("gemv_preshuffled", configs.current_target()) if mods.prune.preshuffled_fits(c, code)]:
        monkeypatch.setattr(configs, "configs_for",
                            lambda fam, tgt, c=cfg: [c] if fam == "gemv_preshuffled" else real(fam, tgt))
        backend = mods.backend.TritonBackend(autotune=False, weight_layout=lay)
        for scheme, dtype in ((S(4, 128, True), torch.float16), (S(4, 128, False), torch.bfloat16)):
            for n, k in ((1000, 1000), (512, 1024)):
                r, x, b = make_case(scheme, n, k, m, dtype, device="cuda")
                y, y_ref = run_both(backend, r, x, b)
                check_close(y, y_ref, dtype, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 16, 128))
def test_gpu_autotuned_w4g128(m):
    mods = _gpu()
    r, x, b = make_case(S(4, 128, True), 4096, 4096, m, torch.float16, device="cuda")
    y, y_ref = run_both(mods.backend.TritonBackend(), r, x, b)
    check_close(y, y_ref, torch.float16, GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("gemv", "gemv_packed", "small_m", "large_m", "w8a8"))
@pytest.mark.parametrize("index", range(12))
def test_gpu_every_config_of_the_target(family, index, monkeypatch):
    """Config ``index`` of the family's list for this GPU compiles and computes the right result
    (1000 x 1000: a partial last group, N and K off every tile; 512 x 1024: no masks); the GEMVs
    at M 1 and 2 (gemv: the fp32 GEMV, on 8-bit fields; gemv_packed: fp16 and bf16 x)."""
    mods = _gpu()
    from quantspec.kernels.triton import configs

    real = configs.configs_for
    cfgs = real(family, configs.current_target())
    if index >= len(cfgs):
        pytest.skip(f"the {family} list has {len(cfgs)} configs")
    monkeypatch.setattr(configs, "configs_for", lambda fam, tgt: [cfgs[index]] if fam == family else real(fam, tgt))
    scheme = {"w8a8": S(8, -1, True, activations="int8-token-dynamic"), "gemv": S(8, 128, False)}.get(
        family, S(4, 128, False))
    ms = {"gemv": (1, 2), "gemv_packed": (1, 2), "small_m": (9,), "large_m": (300,), "w8a8": (1, 40)}[family]
    dtypes = (torch.float16, torch.bfloat16) if family == "gemv_packed" else (torch.float16,)
    # gemv / gemv_packed are the GPTQ layout's GEMVs (test_gpu_preshuffled_gemv_every_config: the
    # pre-shuffled one); a tl.dot config that cannot read a pre-shuffled qweight
    # runs on the GPTQ layout (the launcher prunes it for pre-shuffled weights)
    fits = family in ("small_m", "large_m") and mods.prune.preshuffled_fits(cfgs[index])
    backend = mods.backend.TritonBackend(autotune=False, weight_layout="auto" if fits else "gptq")
    for dtype in dtypes:
        for m in ms:
            for n, k in ((1000, 1000), (512, 1024)):
                r, x, b = make_case(scheme, n, k, m, dtype, device="cuda")
                y, y_ref = run_both(backend, r, x, b)
                check_close(y, y_ref, dtype, GPU_TOL)


FLOAT_GPU_PATHS = {  # family -> (preset, the launch's constexprs, activation dtypes)
    "fp_dot": [(p, {"KIND": kind, "DOT_F32": dt == torch.float32}, dt)
               for p, kind in (("fp8-weight", 0), ("fp8-block-weight", 0), ("nvfp4", 1), ("mxfp4", 1))
               for dt in (torch.float32, torch.float16, torch.bfloat16)],
    "fp8_w8a8": [(p, {"GROUPED": p == "fp8-block"}, torch.bfloat16)
                 for p in ("fp8-dynamic", "fp8-static", "fp8-block")],
}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("fp_dot", "fp8_w8a8"))
@pytest.mark.parametrize("index", range(16))
def test_gpu_every_float_config_of_the_target(family, index, monkeypatch):
    """Config ``index`` of a float family's list for this GPU, alone (autotune=False), on every
    scheme path and dtype a launch may run it on (``prune.fits``: M 9 for its 16-row tiles, 300
    above; fp32 x on the FMA tiles; the FP8 block path where it fits), against the reference: N
    off every tile, K off the tile where the scheme allows (not the 128-column blocks)."""
    mods = _gpu()
    from quantspec.core.scheme import SCHEME_PRESETS
    from quantspec.kernels.triton import configs

    real = configs.configs_for
    cfgs = real(family, configs.current_target())
    if index >= len(cfgs):
        pytest.skip(f"the {family} list has {len(cfgs)} configs")
    cfg = cfgs[index]
    monkeypatch.setattr(configs, "configs_for", lambda fam, tgt: [cfg] if fam == family else real(fam, tgt))
    m = 9 if cfg.kwargs["BLOCK_M"] == 16 else 300
    backend = mods.backend.TritonBackend(autotune=False)
    ran = 0
    for preset, meta, dtype in FLOAT_GPU_PATHS[family]:
        if not mods.prune.fits(family, cfg, configs.m_key(m), meta):
            continue
        for n, k in ((1000, 1024), (520, 1024 if "block" in preset else 1056)):
            g = torch.Generator().manual_seed(n + k)
            x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)[None, :]).to(dtype)
            if family == "fp8_w8a8":
                r = _fp8_w8a8_result(preset, n, k, x, g)
            else:
                r = rtn(torch.randn(n, k, generator=g), SCHEME_PRESETS[preset])
            b = torch.randn(n, generator=g).to(dtype)
            y, y_ref = run_both(backend, r, x.cuda(), b.cuda())
            check_close(y, y_ref, dtype, GPU_TOL)
            ran += 1
    assert ran, f"no scheme path runs {cfg}"


@interp
@pytest.mark.parametrize("preshuffled", [False, True])
def test_moe_experts_run_on_the_triton_backend(tk, monkeypatch, preshuffled):
    """A quantized Qwen3-MoE (experts one QuantLinear each, ``models.experts.LinearExperts``) on
    the Triton backend, through the grouped path (``kernels.moe``: two grouped launches per MoE
    block): logits within 1e-5 (fp32, relative to the largest) of the reference backend's; also
    with the experts' qweights pre-shuffled (unshuffled for the stacked copy)."""
    import quantspec
    from helpers import tiny_model
    from quantspec.quant.recipe import Recipe

    if preshuffled:
        monkeypatch.setattr(tk.backend, "PRESHUFFLED_BACKENDS", frozenset({"interpreter"}))
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=S(4, -1 if preshuffled else 32, True))
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = {}
    for backend in ("reference", "triton"):
        model, report = quantspec.quantize_model(tiny_model("qwen3_moe"), recipe, backend=backend)
        assert set(report["backends"].values()) == {backend}
        assert sum(".experts." in n for n in report["backends"]) == 48
        assert len(report["grouped_experts"]) == (2 if backend == "triton" else 0)
        if backend == "triton":
            keys = {k for m in model.modules() if hasattr(m, "prepared") and callable(m.prepared)
                    for k in m.prepared()}
            assert ("qweight_mma" in keys) == preshuffled
        with torch.no_grad():
            logits[backend] = model(ids).logits
    ref = logits["reference"]
    assert (logits["triton"] - ref).abs().max() <= 1e-5 * ref.abs().max()


@interp
@pytest.mark.parametrize("scheme,dtype", [(S(4, 32, True), torch.float32), (S(4, 32, False), torch.float16),
                                          (S(4, -1, True), torch.float32), (S(8, 64, False), torch.float32)])
def test_grouped_moe_gemm_matches_each_experts_product(tk, scheme, dtype):
    """Rows grouped by expert (one expert with none, one with more than a row tile), each
    expert's weight its own: the grouped kernel equals each expert's reference product."""
    from quantspec.kernels.moe import _stack
    from quantspec.kernels.triton.moe_gemm import moe_wq_linear

    n, k, counts = 48, 64, [3, 0, 21, 1]
    backend, ref = tk.backend.TritonBackend(), ReferenceBackend()
    results = [make_case(scheme, n, k, 1, dtype, seed=e)[0] for e in range(len(counts))]
    x = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(9)).to(dtype)
    stacked = _stack([(backend.prepare(r, dtype),) for r in results])
    y = moe_wq_linear(x, counts, *stacked, scheme.bits, scheme.group_size)
    start = 0
    for e, c in enumerate(counts):
        if c:
            rows = x[start : start + c]
            want = ref.linear(rows, ref.prepare(results[e], dtype), scheme, n, k, None)
            check_close(y[start : start + c], want, dtype)
        start += c
    assert y.shape == (sum(counts), n)


FLOAT_CASES = [(p, m, dt, n, k) for p in ("fp8-weight", "nvfp4", "mxfp4")
               for (m, n, k) in ((1, 72, 96), (5, 130, 160), (40, 64, 128))
               for dt in (torch.float32, torch.float16)]


@interp
@pytest.mark.parametrize("preset,m,dtype,n,k", FLOAT_CASES)
def test_float_weight_only_matches_reference(tk, preset, m, dtype, n, k):
    """FP8 / NVFP4 / MXFP4 weight-only (triton/fp_gemm.py): codes decoded by integer arithmetic,
    scales decoded at prepare, against the reference's code tables (same TOL as the integer
    kernels: the dequantized tile is rounded to x's dtype before tl.dot)."""
    from quantspec.core.scheme import SCHEME_PRESETS

    scheme = SCHEME_PRESETS[preset]
    g = torch.Generator().manual_seed(m * 7 + n)
    r = rtn(torch.randn(n, k, generator=g), scheme)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if m % 2 else None
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x, b)
    check_close(y, y_ref, dtype)


@interp
@pytest.mark.parametrize("m,n,k", [(1, 72, 128), (5, 130, 256), (40, 256, 384)])
def test_fp8_block_weight_only_matches_reference(tk, m, n, k):
    """FP8 block scales (one per 128x128 block, held per row: fscales [K/128, N], GROUP 128);
    rows of very different magnitudes so a scale read from the wrong block shows."""
    from quantspec.core.scheme import SCHEME_PRESETS

    scheme = SCHEME_PRESETS["fp8-block-weight"]
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None] * torch.logspace(1, -1, k)[None, :]
    r = rtn(w, scheme)
    x = torch.randn(m, k, generator=g)
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x, torch.randn(n, generator=g))
    check_close(y, y_ref, torch.float32)


@interp
def test_float_decoders_cover_every_code(tk):
    """Every E4M3FN byte (but NaN) and every E2M1 nibble decodes to torch's / the table's value."""
    import triton
    import triton.language as tl

    from quantspec.kernels.triton import fp_gemm
    from quantspec.core.floatcodes import code_values

    globals()["fp_gemm"] = fp_gemm  # the jit function below resolves names in this module

    @triton.jit
    def decode(c_ptr, o_ptr, KIND: tl.constexpr):
        offs = tl.arange(0, 256)
        c = tl.load(c_ptr + offs)
        if KIND == 0:
            v = fp_gemm._decode_fp8(c)
        else:
            v = fp_gemm._decode_fp4(c & 0xF)
        tl.store(o_ptr + offs, v)

    codes = torch.arange(256, dtype=torch.int32)
    for kind, name in ((0, "fp8"), (1, "nvfp4")):
        out = torch.empty(256)
        decode[(1,)](codes, out, KIND=kind)
        ref = code_values(name)[codes if kind == 0 else codes & 0xF]
        finite = (codes & 0x7F) != 0x7F if kind == 0 else torch.ones(256, dtype=torch.bool)
        assert torch.equal(out[finite], ref[finite])


FP8_FLAVOURS = {"e4m3fn": (torch.float8_e4m3fn, 448.0), "e4m3fnuz": (torch.float8_e4m3fnuz, 240.0)}


@interp
@pytest.mark.parametrize("fmt", list(FP8_FLAVOURS))
def test_fp8_activation_bytes_equal_torchs_cast(fmt):
    """triton/fp8_w8a8.py rounds onto the fp8 grid in fp32 (ties to even, subnormals,
    saturation) and then casts: its bytes are torch's cast of the clamped values, exactly, on
    both flavours (the interpreter's own fp32 -> fp8 cast is off by steps, so a kernel that
    relied on it fails here). Zero is always +0 (0x80 is NaN in FNUZ)."""
    from quantspec.kernels.triton.fp8_w8a8 import quantize_fp8

    dt, fmax = FP8_FLAVOURS[fmt]
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # every tie, and values just beside it
    x = torch.cat([grid, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.tensor([-1e9, 1e9, -0.0, 1e-30, fmax * 1.01, fmax * 1.1])])
    x = torch.cat([x, torch.zeros((-x.numel()) % 64)]).view(-1, 64).contiguous()
    q, s = quantize_fp8(x, fmt, static_scale=torch.tensor([1.0]))
    want = x.clamp(-fmax, fmax).to(dt).view(torch.uint8)
    want = torch.where(want == 0x80, torch.zeros_like(want), want)
    assert torch.equal(q, want), (x[q != want][:6], q[q != want][:6], want[q != want][:6])
    # dynamic per token: the scale is absmax / max, the bytes those of x / scale
    xr = torch.randn(7, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 7)[:, None]
    q, s = quantize_fp8(xr, fmt)
    scale = (xr.abs().amax(1, keepdim=True) / fmax).clamp(min=1e-12)
    assert torch.equal(s, scale)
    want = (xr / scale).clamp(-fmax, fmax).to(dt).view(torch.uint8)
    assert torch.equal(q, torch.where(want == 0x80, torch.zeros_like(want), want))


FP8_W8A8_CASES = [(p, m, dt, n, k) for p in ("fp8-dynamic", "fp8-static", "fp8-block")
                  for (m, n, k) in ((1, 72, 128), (5, 130, 256), (40, 64, 384))
                  for dt in (torch.float32, torch.float16)]


def _fp8_w8a8_result(preset: str, n: int, k: int, x: torch.Tensor, g: torch.Generator) -> QuantResult:
    from dataclasses import replace

    from quantspec.core.scheme import SCHEME_PRESETS

    scheme = SCHEME_PRESETS[preset]
    # rows and 128-column blocks of different sizes: a scale read from the wrong block shows
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None] * torch.logspace(1, -1, k)[None, :]
    r = rtn(w, scheme)
    if scheme.static_activations:  # a calibrated scale, smaller than this x's absmax: saturation too
        r = replace(r, input_scale=(x.float().abs().amax() / 448 * 0.8).reshape(1))
    return r


@interp
@pytest.mark.parametrize("preset,m,dtype,n,k", FP8_W8A8_CASES)
def test_fp8_w8a8_matches_reference(tk, preset, m, dtype, n, k):
    """FP8 W8A8 through fp8 tl.dot (triton/fp8_w8a8.py) against the reference backend: the same
    activation bytes and scales (per token, per token-group of 128 for fp8-block, the static
    scale), so only the accumulation order and the output rounding differ (TOL per dtype)."""
    g = torch.Generator().manual_seed(m * 7 + n)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)[None, :]).to(dtype)
    r = _fp8_w8a8_result(preset, n, k, x, g)
    b = torch.randn(n, generator=g).to(dtype) if m % 2 else None
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x, b)
    check_close(y, y_ref, dtype)


@interp
@pytest.mark.parametrize("preset", ["fp8-dynamic", "fp8-static", "fp8-block"])
def test_fp8_w8a8_fnuz_matches_its_emulation(tk, preset):
    """MI300's flavour (TritonBackend(fp8="e4m3fnuz")): the E4M3FN weight is converted at prepare
    (bytes kept, scales doubled: the same values) and the activations are quantized onto the
    E4M3FNUZ grid (absmax / 240). Checked against that computation in torch
    (torch.float8_e4m3fnuz), fp32, TOL."""
    m, n, k = 6, 96, 256
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g)
    r = _fp8_w8a8_result(preset, n, k, x, g)
    w = r.dequantize()
    if preset == "fp8-static":
        sx = r.input_scale.float().reshape(1, 1)
        qx = (x / sx).clamp(-240, 240).to(torch.float8_e4m3fnuz).float() * sx
    else:
        cols = 128 if preset == "fp8-block" else k
        xg = x.view(m, k // cols, cols)
        sx = (xg.abs().amax(-1, keepdim=True) / 240).clamp(min=1e-12)
        qx = ((xg / sx).to(torch.float8_e4m3fnuz).float() * sx).view(m, k)
    backend = tk.backend.TritonBackend(fp8="e4m3fnuz")
    prepared = backend.prepare(r, x.dtype)
    assert torch.equal(prepared["f8weight"].view(torch.float8_e4m3fnuz).float() * 2,
                       r.qweight.view(torch.float8_e4m3fn).float())  # same values, before the scales
    y = backend.linear(x, prepared, r.scheme, n, k, None)
    check_close(y, qx @ w.T, torch.float32)


def test_fp8_w8a8_is_refused_where_it_cannot_run(tk):
    """FP8 block with K not a multiple of 128 is refused (the reference runs it), with the reason."""
    from quantspec.core.scheme import SCHEME_PRESETS

    reason = tk.backend.TritonBackend().cannot_run(SCHEME_PRESETS["fp8-block"], 64, 200, torch.device("cpu"),
                                                   torch.float32)
    assert reason is not None and "multiple of 128" in reason


# ---- the packed GEMV (``_wq_gemv_f16x2_kernel``): fp16 / bf16 x, 4-bit fields, M <= 2 ----

def _u32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64) & 0xFFFFFFFF


def _lanes16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 lanes 0 and 1 of uint32 values held in int64."""
    def h(b):
        return torch.where(b >= 32768, b - 65536, b).to(torch.int16).view(torch.float16)
    return h(v & 0xFFFF), h((v >> 16) & 0xFFFF)


def _pack16(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    def u(x):
        return x.view(torch.int16).to(torch.int64) & 0xFFFF
    return u(lo) | (u(hi) << 16)


def _fma16(a, b, c):
    """IEEE fp16 fma (one rounding), through float64 (exact here) and numpy's direct rounding."""
    import numpy as np

    r = a.double().numpy() * b.double().numpy() + c.double().numpy()
    return torch.from_numpy(r.astype(np.float16))


def _fma_f16x2(a, b, c):
    (a0, a1), (b0, b1), (c0, c1) = _lanes16(a), _lanes16(b), _lanes16(c)
    return _pack16(_fma16(a0, b0, c0), _fma16(a1, b1, c1))


def _byte_perm(lo: torch.Tensor, hi: torch.Tensor, selector: int) -> torch.Tensor:
    """PTX ``prmt.b32 d, lo, hi, selector`` (default mode) and AMD ``v_perm_b32 d, hi, lo,
    selector`` for selectors of bytes 0-7: byte n of d is byte selector[n] of the 8 bytes
    {hi, lo} (lo = bytes 0-3)."""
    src = lo | (hi << 32)
    out = torch.zeros_like(lo)
    for n in range(4):
        idx = (selector >> (8 * n if selector > 0xFFFF else 4 * n)) & 0x7
        out |= ((src >> (8 * idx)) & 0xFF) << (8 * n)
    return out


def _emulate_dequant(w, z):
    """The packed pairs (code - zero) / 16 of fields (i, i+4), i = 0..3, as the kernel builds them."""
    w = _u32(w)
    zc0 = _pack16(*(2 * [(-(64.0 + z * 0.0625)).half()]))
    zc1 = _pack16(*(2 * [(-(4.0 + z * 0.0625)).half()]))
    w8 = w >> 8
    c16, c256 = torch.full_like(w, 0x2C002C00), torch.full_like(w, 0x1C001C00)
    return [_fma_f16x2((w & 0x000F000F) | 0x64006400, c16, zc0), _fma_f16x2((w & 0x00F000F0) | 0x64006400, c256, zc1),
            _fma_f16x2((w8 & 0x000F000F) | 0x64006400, c16, zc0), _fma_f16x2((w8 & 0x00F000F0) | 0x64006400, c256, zc1)]


@interp
def test_packed_gemv_bit_tricks_match_their_emulation(tk):
    """The packed GEMV's building blocks (PACKED = 1: plain Triton, what the interpreter runs)
    give the bits of a torch emulation: nibbles to exact fp16 pairs (code - zero) / 16 with the
    0x6400 magic (every code, every zero point 0..15; the zero pairs built from the integer as the
    kernels do, the emulation converting -(64 + z / 16)), x paired (x[i], x[i+4]) by byte permutes,
    the packed fp16 fma chain and its fp32 sum, and the bf16 path's fp32 products. The GPU
    paths run the same code with each pair operation one instruction (PTX fma.rn.f16x2 /
    prmt.b32, AMD v_pk_fma_f16 / v_perm_b32 / v_and_or_b32 / v_fma_mix_f32): IEEE per-lane fmas and
    byte permutes, which ``_byte_perm`` checks against the plain formulas for the selectors used;
    the AMDGCN chains (``pair_ops.AMD_*``, one asm statement each) emulated give the same bits."""
    import triton
    import triton.language as tl

    wq = importlib.import_module("quantspec.kernels.triton.wq_gemv_packed")  # the building blocks
    po = importlib.import_module("quantspec.kernels.triton.pair_ops")
    globals().update(wq=wq, po=po)  # the jit function below resolves names in this module
    n = 256
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    words[:16] = torch.tensor([0x76543210, -0x01234568, 0, -1] * 4, dtype=torch.int64).to(torch.int32)  # every code
    zeros = torch.arange(n, dtype=torch.int32) % 16
    x = (torch.randn(n, 8, generator=g) * torch.logspace(-3, 3, n)[:, None]).half()
    xb = (torch.randn(n, 8, generator=g) * torch.logspace(-3, 3, n)[:, None]).bfloat16()

    @triton.jit
    def blocks(w_ptr, z_ptr, x_ptr, xb_ptr, d_ptr, q_ptr, h_ptr, f_ptr, fb_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        w = tl.load(w_ptr + offs).to(tl.uint32, bitcast=True)[:, None]
        zi = tl.load(z_ptr + offs).to(tl.uint32)[:, None]
        z = zi.to(tl.float32)
        m_lo = (tl.zeros_like(w) + 15) * 0x10001
        zc0, zc1 = po._gemv_zero_pairs(zi)  # what the kernels build (the emulation: -(64 + z/16) converted)
        d0, d1, d2, d3 = wq._dequant_f16x2(w, m_lo, zc0, zc1, 1)
        xp = (x_ptr + offs * 8).to(tl.pointer_type(tl.uint64), bitcast=True)[:, None] + tl.arange(0, 2)[None, :]
        x0, x1, x2, x3 = wq._x_pairs(xp, offs >= 0, True, 1)
        h = wq._dot8_f16x2(tl.zeros_like(w), x0, x1, x2, x3, d0, d1, d2, d3, 1)
        tl.store(d_ptr + offs[:, None] * 4 + 0, d0)
        tl.store(d_ptr + offs[:, None] * 4 + 1, d1)
        tl.store(d_ptr + offs[:, None] * 4 + 2, d2)
        tl.store(d_ptr + offs[:, None] * 4 + 3, d3)
        tl.store(q_ptr + offs[:, None] * 4 + 0, x0)
        tl.store(q_ptr + offs[:, None] * 4 + 1, x1)
        tl.store(q_ptr + offs[:, None] * 4 + 2, x2)
        tl.store(q_ptr + offs[:, None] * 4 + 3, x3)
        tl.store(h_ptr + offs[:, None], h)
        tl.store(f_ptr + offs[:, None], wq._pair_sum_f32(h, 1))
        xbp = (xb_ptr + offs * 8).to(tl.pointer_type(tl.uint64), bitcast=True)[:, None] + tl.arange(0, 2)[None, :]
        y0, y1, y2, y3, y4, y5, y6, y7 = wq._x_bf16_f32(xbp, offs >= 0, True)
        fb = wq._dot8_f32(tl.zeros_like(z), y0, y1, y2, y3, y4, y5, y6, y7, d0, d1, d2, d3, 1)
        tl.store(fb_ptr + offs[:, None], fb)

    d = torch.zeros(n, 4, dtype=torch.int32)
    q = torch.zeros(n, 4, dtype=torch.int32)
    h = torch.zeros(n, dtype=torch.int32)
    f = torch.zeros(n)
    fb = torch.zeros(n)
    blocks[(1,)](words, zeros, x, xb, d, q, h, f, fb, N=n)

    # nibbles -> exact (code - zero) / 16 pairs, and their bits
    d_ref = _emulate_dequant(words.to(torch.int64), zeros.float())
    codes = (_u32(words.to(torch.int64))[:, None] >> (4 * torch.arange(8))) & 0xF  # [n, 8] field i = row i
    for i in range(4):
        lo, hi = _lanes16(_u32(d[:, i]))
        assert torch.equal(_u32(d[:, i]), d_ref[i])
        assert torch.equal(lo.float(), (codes[:, i] - zeros).float() / 16)
        assert torch.equal(hi.float(), (codes[:, i + 4] - zeros).float() / 16)
    # x pairs: the plain formulas are the byte permutes prmt 0x5410 / 0x7632 (v_perm 0x05040100 / 0x07060302)
    xu = _u32(x.view(torch.int32).to(torch.int64))  # [n, 4]: (x0, x1), (x2, x3), (x4, x5), (x6, x7)
    for i, (a, b, hi_half) in enumerate([(0, 2, 0), (0, 2, 1), (1, 3, 0), (1, 3, 1)]):
        want = _byte_perm(xu[:, a], xu[:, b], 0x7632 if hi_half else 0x5410)
        assert torch.equal(want, _byte_perm(xu[:, a], xu[:, b], 0x07060302 if hi_half else 0x05040100))
        assert torch.equal(_u32(q[:, i]), want)
        lo, hi = _lanes16(want)
        assert torch.equal(lo, x[:, i]) and torch.equal(hi, x[:, i + 4])
    # the fp16 chain: 4 fmas per lane, in this order; its fp32 lane sum
    h_ref = torch.zeros(n, dtype=torch.int64)
    for i in range(4):
        h_ref = _fma_f16x2(_u32(q[:, i]), d_ref[i], h_ref)
    assert torch.equal(_u32(h), h_ref)
    lo, hi = _lanes16(h_ref)
    assert torch.equal(f, lo.float() + hi.float())
    # bf16 x: fp32 fmas of exact products (x bf16 x (code - zero) / 16), rows in the kernel's order
    fb_ref = torch.zeros(n)
    w16 = (codes - zeros[:, None]).float() / 16
    for i in (0, 4, 1, 5, 2, 6, 3, 7):
        fb_ref = (xb[:, i].double() * w16[:, i].double() + fb_ref.double()).float()
    assert torch.equal(fb, fb_ref)
    # the same chains as the AMDGCN blocks of PACKED 3 (pair_ops), emulated instruction by instruction:
    # the same bits (v_and_or_b32 + v_pk_fma_f16 a pair, 4 v_pk_fma_f16, 8 and 2 v_fma_mix_f32)
    wu, yb = _u32(words.to(torch.int64)), _u32(xb.view(torch.int16).to(torch.int64)) << 16  # bf16 x as fp32 bits
    zc = [_pack16(*(2 * [(-(64.0 + zeros * 0.0625)).half()])), _pack16(*(2 * [(-(4.0 + zeros * 0.0625)).half()]))]
    fbits = _u32(fb.view(torch.int32).to(torch.int64))
    for r in range(0, n, 5):
        for i in range(4):
            regs = {"$1": int(wu[r]) >> (8 * (i // 2)), "$2": 0x000F000F << (4 * (i % 2)), "$3": po.MAGIC_F16.value,
                    "$4": 0x1C001C00 if i % 2 else 0x2C002C00, "$5": int(zc[i % 2][r])}
            assert _run_amdgcn(po.AMD_DEQUANT_PAIR.value, regs) == int(d_ref[i][r])
        regs = {"$1": 0, **{f"${2 + i}": int(_u32(q[r, i])) for i in range(4)}, **{f"${6 + i}": int(d_ref[i][r]) for i in range(4)}}
        assert _run_amdgcn(po.AMD_FMA4_F16X2.value, regs) == int(h_ref[r])
        regs = {"$1": 0, **{f"${2 + i}": int(yb[r, i]) for i in range(8)}, **{f"${10 + i}": int(d_ref[i][r]) for i in range(4)}}
        assert _run_amdgcn(po.AMD_MIX8.value, regs) == int(fbits[r])
        two = _run_amdgcn(po.AMD_MIX2.value, {"$1": int(yb[r, 0]), "$2": int(yb[r, 4]), "$3": int(d_ref[0][r]), "$4": 0})
        want2 = (xb[r, 4].double() * w16[r, 4].double() + (xb[r, 0].double() * w16[r, 0].double()).float().double()).float()
        assert two == int(_u32(want2.view(torch.int32).to(torch.int64)))


def _bf16_lanes(v: int):
    """bf16 lanes 0 and 1 of a uint32, exactly (a bf16 is an fp32's high half)."""
    from fractions import Fraction

    import numpy as np

    return [Fraction(float(np.array([((v >> s) & 0xFFFF) << 16], np.uint32).view(np.float32)[0])) for s in (0, 16)]


def _round_bf16(q) -> int:
    """bf16 bits of the fraction ``q`` rounded to nearest even (q exact in float64, normal range)."""
    import math
    from fractions import Fraction

    if q == 0:
        return 0
    assert Fraction(float(q)) == q
    m, e = math.frexp(float(q))  # |m| in [0.5, 1): 8 significant bits are m * 256 rounded
    r = math.ldexp(round(m * 256) / 256, e)  # round() is half-even
    return int(torch.tensor([r], dtype=torch.float32).view(torch.int32).item() >> 16) & 0xFFFF


def _run_amdgcn(block: str, args: dict) -> int:
    """The result ($0) of an AMDGCN block (pair_ops' templates) on uint32 ``args``: v_and_or_b32,
    v_perm_b32 d, s0, s1, sel (``_byte_perm`` of lo = s1, hi = s0), v_pk_add_f16 / v_pk_fma_f16 per
    fp16 lane, v_cvt_f32_f16 (sdwa src0_sel:WORD_1: the high half), v_fma_mix_f32 (source i is the
    fp16 half op_sel[i] of its register where op_sel_hi[i] is 1, else fp32: the modifiers LLVM itself
    emits, test_triton_compile.py::test_amdgcn_templates_read_halves_as_llvm_does); each result rounded
    once from its exact value (fractions)."""
    import re
    from fractions import Fraction

    import numpy as np

    regs = dict(args)

    def f16(v, hi):
        return Fraction(float(np.array([(v >> (16 * hi)) & 0xFFFF], np.uint16).view(np.float16)[0]))

    def f32(v):
        return Fraction(float(np.array([v & 0xFFFFFFFF], np.uint32).view(np.float32)[0]))

    def r16(q):
        assert Fraction(float(q)) == q
        return int(np.array([float(q)], np.float16).view(np.uint16)[0])

    def r32(q):
        assert Fraction(float(q)) == q
        return int(np.array([float(q)], np.float32).view(np.uint32)[0])

    def mods(name, rest):
        m = re.search(name + r":\[([01,]+)\]", rest)
        return [int(b) for b in m.group(1).split(",")] if m else [0, 0, 0]

    for line in block.strip().splitlines():
        op, rest = line.split(None, 1)
        d, *names = re.findall(r"\$\d+", rest)
        src = [regs[t] for t in names]
        if op == "v_and_or_b32":
            r = (src[0] & src[1]) | src[2]
        elif op == "v_perm_b32":
            r = int(_byte_perm(torch.tensor([src[1]]), torch.tensor([src[0]]), src[2])[0])
        elif op == "v_pk_add_f16":
            r = r16(f16(src[0], 0) + f16(src[1], 0)) | r16(f16(src[0], 1) + f16(src[1], 1)) << 16
        elif op == "v_pk_fma_f16":
            r = sum(r16(f16(src[0], h) * f16(src[1], h) + f16(src[2], h)) << (16 * h) for h in (0, 1))
        elif op in ("v_cvt_f32_f16_e32", "v_cvt_f32_f16_sdwa"):
            r = r32(f16(src[0], 1 if "src0_sel:WORD_1" in rest else 0))
        elif op == "v_fma_mix_f32":
            sel, hi16 = mods("op_sel", rest), mods("op_sel_hi", rest)
            a, b, c = (f16(v, sel[i]) if hi16[i] else f32(v) for i, v in enumerate(src))
            r = r32(a * b + c)
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs["$0"]


def _run_ptx(block: str, args: dict) -> int:
    """The result ($0) of a PTX block of mov.b32 / lop3.b32 / add.rn.f16x2 / fma.rn.f16x2 /
    fma.rn.bf16x2 on uint32 ``args`` ({"$1": .., "$2": ..}): lop3 bit by bit from its LUT (input bits
    a b c index bit 4a + 2b + c), the x2 ops per 16-bit lane exactly (fractions), then rounded once."""
    from fractions import Fraction

    import numpy as np

    regs = dict(args)

    def val(t):
        return int(t, 16) if t.startswith("0x") else regs[t]

    def lanes(v):
        return [Fraction(float(np.array([(v >> s) & 0xFFFF], np.uint16).view(np.float16)[0])) for s in (0, 16)]

    def f16(q):  # round to nearest fp16, from an exact value that float64 holds
        assert Fraction(float(q)) == q
        return int(np.array([float(q)], np.float16).view(np.uint16)[0])

    for stmt in block.strip().strip("{}").split(";"):
        stmt = stmt.strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            r = val(a[1])
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 16)
            r = sum(((lut >> ((x >> b & 1) << 2 | (y >> b & 1) << 1 | (z >> b & 1))) & 1) << b for b in range(32))
        elif op == "add.rn.f16x2":
            r = sum(f16(p + q) << s for p, q, s in zip(lanes(val(a[1])), lanes(val(a[2])), (0, 16)))
        elif op == "fma.rn.f16x2":
            r = sum(f16(p * q + c) << s for p, q, c, s in zip(lanes(val(a[1])), lanes(val(a[2])), lanes(val(a[3])), (0, 16)))
        elif op == "fma.rn.bf16x2":
            r = sum(_round_bf16(p * q + c) << s
                    for p, q, c, s in zip(_bf16_lanes(val(a[1])), _bf16_lanes(val(a[2])), _bf16_lanes(val(a[3])), (0, 16)))
        else:
            raise AssertionError(f"no emulation of {op}")
        regs[a[0]] = r & 0xFFFFFFFF
    return regs["$0"]


@interp
def test_dot_pair_blocks_match_the_plain_pair_ops(tk):
    """The tl.dot kernel's pairs of code - zero (ASM: one asm block each, what
    ``wq_gemm.ASM_DOT_PAIR_OPS`` runs; the zero pairs built from the integer zero point,
    ``pair_ops``): fp16 (``wq_dequant._f16_pair``: PTX lop3 + add/fma.rn.f16x2, AMDGCN v_and_or_b32 +
    v_pk_add/fma_f16) and bf16 (``pair_ops._bf16_pair``: PTX lop3 0x43004300 + fma.rn.bf16x2;
    ``_bf16_pair_f16`` on AMD: the fp16 pair, v_cvt_f32_f16 and v_perm_b32), each block emulated
    instruction by instruction (``_run_ptx``, ``_run_amdgcn``), give the bits of the plain-Triton
    pair operations (what the interpreter runs), which are exact code - zero, for every code at
    each nibble position of a lane pair, lanes 0 and 1, every zero point 0..15. The integer-built
    zero pairs are the converted values, the GPTQ-layout W.T the pairs build (``_load_wt_pairs``)
    is ``_load_codes_t`` + ``_code_minus_zero`` bit for bit (fp16) and code - zero (bf16), and the
    pre-shuffled fragment's asm branch (``layout._fragment_register``: the shifted word, the pair)
    matches its plain path (fp16; bf16: code - zero)."""
    import triton
    import triton.language as tl

    wd = importlib.import_module("quantspec.kernels.triton.wq_dequant")
    lay = importlib.import_module("quantspec.kernels.triton.layout")
    po = importlib.import_module("quantspec.kernels.triton.pair_ops")
    globals().update(wd=wd, lay=lay, po=po)  # the jit function below resolves names in this module
    nz_, nw = 16, 16
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(16, dtype=torch.int64)
    words = torch.randint(0, 2**32, (nz_, nw), generator=g, dtype=torch.int64)
    words[:, :16] = (codes * 0x11111111)[None, :]  # every code in every nibble
    words[:, 0] = 0x76543210
    words[:, 1] = 0xFEDCBA98
    words = words.to(torch.int32)  # [row (zero point), word]
    zeros = torch.arange(nz_, dtype=torch.int32)

    @triton.jit
    def pairs(w_ptr, qw_ptr, z_ptr, p_ptr, pb_ptr, pa_ptr, zp_ptr, t_ptr, r_ptr, tb_ptr, f_ptr,
              NZ: tl.constexpr, NW: tl.constexpr):
        rows = tl.arange(0, NZ)
        w = tl.load(w_ptr + rows[:, None] * NW + tl.arange(0, NW)[None, :]).to(tl.uint32, bitcast=True)
        zi = tl.load(z_ptr + rows).to(tl.uint32)
        z = zi.to(tl.float32)
        o8 = (rows[:, None] * NW + tl.arange(0, NW)[None, :]) * 8
        for i in tl.static_range(4):  # fp16 / AMD bf16: (ODD, shift) = (i % 2, 8 (i // 2)); bf16: shift 4i
            ws = w >> (8 * (i // 2))
            nz = po._dot_zero_pair(zi, i % 2 == 1)[:, None]
            lo, hi = wd._f16_pair(ws, nz, i % 2 == 1, 0)
            tl.store(p_ptr + o8 + 2 * i, lo)
            tl.store(p_ptr + o8 + 2 * i + 1, hi)
            lo, hi = po._bf16_pair(w >> (4 * i), po._bf16_zero_pair(zi)[:, None], 0)
            tl.store(pb_ptr + o8 + 2 * i, lo)
            tl.store(pb_ptr + o8 + 2 * i + 1, hi)
            lo, hi = po._bf16_pair_f16(ws, nz, i % 2 == 1, 0)
            tl.store(pa_ptr + o8 + 2 * i, lo)
            tl.store(pa_ptr + o8 + 2 * i + 1, hi)
        tl.store(zp_ptr + rows * 3, po._dot_zero_pair(zi, False))
        tl.store(zp_ptr + rows * 3 + 1, po._dot_zero_pair(zi, True))
        tl.store(zp_ptr + rows * 3 + 2, po._bf16_zero_pair(zi))
        # the GPTQ W.T (qweight [NW, NZ]: column n = row n's words) from the pairs against the codes' path
        offs_n = tl.arange(0, NZ)
        wt = wd._load_wt_pairs(qw_ptr, 0, offs_n, 8 * NW, NZ, zi, True, 8 * NW, 0, False)
        ref = wd._code_minus_zero(wd._load_codes_t(qw_ptr, 15, 0, offs_n, 8 * NW, NZ, 4, True, 8 * NW),
                                  z[:, None], wt, False, 0x6400)
        cols = tl.arange(0, 8 * NW)[None, :]
        tl.store(t_ptr + rows[:, None] * 8 * NW + cols, wt)
        tl.store(r_ptr + rows[:, None] * 8 * NW + cols, ref)
        tl.store(tb_ptr + rows[:, None] * 8 * NW + cols, wd._load_wt_pairs(qw_ptr, 0, offs_n, 8 * NW, NZ, zi, True,
                                                                          8 * NW, 0, True))
        # the fragment register: the asm branch's call, with the plain pair operations, against the plain path
        x = tl.zeros([NZ, NW], tl.float16)
        for j in tl.static_range(4):
            a, b = lay._fragment_register(w, j, z[:, None], x, False, 0x6400, False)
            c, d = wd._f16_pair(w >> (4 * (j - 1)) if j % 2 else w >> (4 * j), po._dot_zero_pair(zi[:, None], j % 2 == 1),
                                j % 2 == 1, 0)
            o = (rows[:, None] * NW + tl.arange(0, NW)[None, :]) * 16 + 4 * j
            tl.store(f_ptr + o, a)
            tl.store(f_ptr + o + 1, b)
            tl.store(f_ptr + o + 2, c)
            tl.store(f_ptr + o + 3, d)

    p = torch.zeros(nz_, nw, 8, dtype=torch.float16)
    pb = torch.zeros(nz_, nw, 8, dtype=torch.bfloat16)
    pa = torch.zeros(nz_, nw, 8, dtype=torch.bfloat16)
    zp = torch.zeros(nz_, 3, dtype=torch.int32)
    t = torch.zeros(nz_, 8 * nw, dtype=torch.float16)
    r = torch.ones(nz_, 8 * nw, dtype=torch.float16)
    tb = torch.zeros(nz_, 8 * nw, dtype=torch.bfloat16)
    f = torch.zeros(nz_, nw, 4, 4, dtype=torch.float16)
    pairs[(1,)](words, words.T.contiguous(), zeros, p, pb, pa, zp, t, r, tb, f, NZ=nz_, NW=nw)

    zf = zeros.float()
    w64 = _u32(words.to(torch.int64))
    fields = (w64[..., None] >> (4 * torch.arange(8))) & 0xF  # [row, word, field]
    want = fields - zeros[:, None, None]
    # the integer-built zero pairs are the converted values
    for col, v, dt in ((0, -(zf + 1024), torch.float16), (1, -(zf + 64), torch.float16), (2, -(zf + 128), torch.bfloat16)):
        h = v.to(dt)
        assert torch.equal(_u32(zp[:, col].to(torch.int64)), _pack16(h.view(torch.float16), h.view(torch.float16)))
    for i in range(4):  # pair i: fields (i, i + 4)
        for out in (p, pb, pa):
            assert torch.equal(out[..., 2 * i].float(), want[..., i].float())
            assert torch.equal(out[..., 2 * i + 1].float(), want[..., i + 4].float())
        ptx = wd.PTX_PAIR_ODD.value if i % 2 else wd.PTX_PAIR_EVEN.value
        amd = po.AMD_PAIR_ODD.value if i % 2 else po.AMD_PAIR_EVEN.value
        amd_b = po.AMD_BF16_PAIR_ODD.value if i % 2 else po.AMD_BF16_PAIR_EVEN.value
        for row in range(nz_):
            nz, nb = int(_u32(zp[row, i % 2].to(torch.int64))), int(_u32(zp[row, 2].to(torch.int64)))
            for col in range(nw):
                ws = int(w64[row, col]) >> (8 * (i // 2))
                f16 = int(_pack16(p[row, col, 2 * i], p[row, col, 2 * i + 1]))
                bf = int(_pack16(*(v.view(torch.float16) for v in (pb[row, col, 2 * i], pb[row, col, 2 * i + 1]))))
                assert _run_ptx(ptx, {"$1": ws, "$2": nz}) == f16, (i, row, col)
                mask = (po.MASK_HI if i % 2 else po.MASK_LO).value  # the blocks' register operands
                magic, sixteenth = po.MAGIC_F16.value, po.SIXTEENTH_F16.value
                assert _run_amdgcn(amd, {"$1": ws, "$2": nz, "$3": mask, "$4": magic, "$5": sixteenth}) == f16
                assert _run_amdgcn(amd_b, {"$2": ws, "$3": nz, "$4": mask, "$5": magic, "$6": po.PERM_HIGH_HALVES.value,
                                           "$7": sixteenth}) == bf
                assert _run_ptx(po.PTX_BF16_PAIR.value, {"$1": int(w64[row, col]) >> (4 * i), "$2": nb}) == bf
    assert torch.equal(t.view(torch.int16), r.view(torch.int16))
    assert torch.equal(t.view(nz_, nw, 8), want.to(torch.float16))
    assert torch.equal(tb.view(nz_, nw, 8), want.to(torch.bfloat16))
    assert torch.equal(f[..., 0].view(torch.int16), f[..., 2].view(torch.int16))
    assert torch.equal(f[..., 1].view(torch.int16), f[..., 3].view(torch.int16))


def _gemv_kernels_used(tk, monkeypatch) -> list[str]:
    """Names of the kernels ``wq_linear`` launches through ``_launch``, appended as they run."""
    used, real = [], tk.wq._launch

    def spy(family, kernel, *args, **kwargs):
        used.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
        return real(family, kernel, *args, **kwargs)

    monkeypatch.setattr(tk.wq, "_launch", spy)
    return used


PACKED_CASES = [(scheme, m, dtype, n, k)
                for scheme, (n, k) in [(S(4, 128, True), (72, 264)), (S(4, 32, False), (130, 512)),
                                       (S(4, -1, False), (64, 384)), (S(3, 64, False), (48, 256)),
                                       (S(4, 64, True), (256, 1024))]
                for m in (1, 2) for dtype in (torch.float16, torch.bfloat16)]


@interp
@pytest.mark.parametrize("scheme,m,dtype,n,k", PACKED_CASES,
                         ids=[f"{s.short_name}-M{m}-{str(d)[6:]}-{n}x{k}" for s, m, d, n, k in PACKED_CASES])
def test_packed_gemv_matches_reference(tk, monkeypatch, scheme, m, dtype, n, k):
    """fp16 / bf16 x with 4-bit fields (4- and 3-bit codes), M <= 2, no g_idx: the packed GEMV,
    whatever the group (32 .. per channel), with N and K off the tiles (K a multiple of 8)."""
    used = _gemv_kernels_used(tk, monkeypatch)
    r, x, b = make_case(scheme, n, k, m, dtype, bias=(m == 1))
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x, b)
    assert used == ["_wq_gemv_f16x2_kernel"]
    check_close(y, y_ref, dtype)


@interp
def test_packed_gemv_falls_back_to_the_fp32_gemv(tk, monkeypatch):
    """x rows not 16-byte aligned, K not a multiple of 8, g_idx, fp32 x or 2/8-bit fields take
    the fp32 GEMV (``_wq_gemv_kernel``), with the same results."""
    used = _gemv_kernels_used(tk, monkeypatch)
    backend = tk.backend.TritonBackend()
    r, x, b = make_case(S(4, 128, True), 64, 256, 1, torch.float16)
    p = backend.prepare(r, x.dtype)
    ref = ReferenceBackend()
    y_ref = ref.linear(x, ref.prepare(r, x.dtype), r.scheme, 64, 256, b)
    wide = torch.zeros(1, 264, dtype=torch.float16)
    wide[:, 1:257] = x
    check_close(backend.linear(wide[:, 1:257], p, r.scheme, 64, 256, b), y_ref, torch.float16)  # misaligned
    check_close(backend.linear(x, p, r.scheme, 64, 256, b), y_ref, torch.float16)
    assert used == ["_wq_gemv_kernel", "_wq_gemv_f16x2_kernel"]
    used.clear()
    for scheme, n, k, dtype, strategy in [(S(4, 32, True), 48, 260, torch.float16, "permute"),
                                          (S(4, 32, True, act_order=True), 48, 256, torch.float16, "gidx"),
                                          (S(4, 128, True), 48, 256, torch.float32, "permute"),
                                          (S(2, 32, True), 48, 256, torch.float16, "permute"),
                                          (S(8, 128, False), 48, 256, torch.bfloat16, "permute")]:
        r, x, b = make_case(scheme, n, k, 2, dtype)
        y, y_ref = run_both(tk.backend.TritonBackend(strategy), r, x, b)
        check_close(y, y_ref, dtype)
    assert used == ["_wq_gemv_kernel"] * 5


@interp
def test_packed_gemv_fp16_partial_sums_at_long_k(tk):
    """The fp16 path sums 4 * GEMV_CHAIN products per lane in fp16 before fp32: at K = 8192 with
    activation outliers (1 channel in 256 scaled by 30-100) the error stays within TOL (0.17 to
    0.20 of it over seeds 0-2; the fp32 GEMV's is the fp16 output rounding alone)."""
    g = torch.Generator().manual_seed(1)
    n, k = 128, 8192
    r = rtn(torch.randn(n, k, generator=g), S(4, 128, True))
    x = torch.randn(1, k, generator=g)
    idx = torch.randperm(k, generator=g)[: k // 256]
    x[0, idx] *= 30 + 70 * torch.rand(len(idx), generator=g)
    y, y_ref = run_both(tk.backend.TritonBackend(), r, x.half(), None)
    check_close(y, y_ref, torch.float16)


@interp
@pytest.mark.parametrize("group,kernel", [(40, "_wq_gemv_f16x2_kernel"), (96, "_wq_gemv_f16x2_kernel"),
                                          (16, "_wq_gemv_f16x2_kernel"), (20, "_wq_gemv_kernel")])
def test_gemv_group_sizes_off_the_schemes(tk, monkeypatch, group, kernel):
    """``wq_linear`` takes any group length: the packed GEMV's fp16 partials stay inside one group
    (a power-of-2 number of words dividing it: 40 rows -> 1 word, 96 -> 4); a group that splits
    a word (20 rows) takes the fp32 GEMV."""
    from quantspec.kernels.triton_backend import pack_codes

    used = _gemv_kernels_used(tk, monkeypatch)
    g = torch.Generator().manual_seed(group)
    n, k = 64, 480
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(-(-k // group), n, generator=g) + 0.5).half()
    zeros = torch.randint(0, 16, scales.shape, generator=g, dtype=torch.uint8)
    x = torch.randn(2, k, generator=g).half()
    rows = torch.arange(k) // group
    w = (codes.float() - zeros.float()[rows].T) * scales.float()[rows].T
    y = tk.wq.wq_linear(x, pack_codes(codes, 4), scales, zeros, None, None, 4, group)
    assert used == [kernel]
    check_close(y, (x.float() @ w.T).half(), torch.float16)


@interp
def test_amd_layout_is_not_run_on_nvidia(tk, monkeypatch):
    """weight_layout mfma16x128 on an NVIDIA GPU: its GEMV tiles spilled there (kernel-spills.md),
    so the backend takes mma16x64 with a warning; ROCm and the interpreter keep what was asked."""
    backend = tk.backend.TritonBackend(weight_layout="mfma16x128")
    assert backend._layout_for(4, 128, False, torch.device("cuda")) == "mfma16x128"  # interpreter
    monkeypatch.setattr(tk.backend.configs, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    with pytest.warns(UserWarning, match="AMD's MFMA layout"):
        assert backend._layout_for(4, 128, False, torch.device("cuda")) == "mma16x64"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert backend._layout_for(4, 128, False, torch.device("cuda")) == "mfma16x128"
