"""Float weight-only linear (FP8 E4M3FN, FP4 E2M1 under NVFP4 / MXFP4 scales):
``y = x @ dequant(W).T + bias`` with fp32 accumulation.

Layout (the Triton backend's ``prepare`` writes it):

* ``codes`` uint8: FP8 [K, N], one E4M3FN byte per weight; FP4 [K/2, N], the codes of rows
  2j (low nibble) and 2j+1 (high nibble) in byte j. N is contiguous (coalesced tile loads).
* ``scales`` fp32 [G, N], already decoded (NVFP4: E4M3 scale / global scale; MXFP4:
  2**(e - 127)), so the kernel does one multiply per element and equals the reference
  (``core/floatcodes.py``) bit for bit before the dot.

The codes are decoded with integer arithmetic into fp32 bit patterns (no fp8 type, so one
source serves NVIDIA, MI300's FNUZ and the interpreter alike; E4M3FN bytes are read as FN on
every target). FP4 tiles multiply the even and the odd rows of x against the low and the high
nibbles in two dots, so no interleave is needed. One tiled tl.dot kernel serves every M (the
bandwidth work is issue 33's).

Launch configs: configs.py's "fp_dot" family, one list per vendor (NVIDIA: deeper pipelines on
sm90; AMD: num_stages 2, waves_per_eu, 16x16 MFMA, kpack 2 for the fp16 / bf16 operands),
autotuned per (M bucket, N, K, KIND, GROUP, DOT_F32, the tensors' dtypes) and pruned per launch
(``prune.float_fits``): BLOCK_M 16 for M <= 16; BLOCK_K 64 / 128 for 16-bit operands (an FP4
half tile holds whole NVFP4 / MXFP4 groups); for fp32 x the FMA tiles, whose tl.dot K is 16
(BLOCK_K 16 for FP8, 32 for FP4): Triton's FMA dot spilled at the former 64 x 64 x 64 (sm90,
4400-5024 bytes). ``autotune=False`` runs the first fitting config; the interpreter one fixed
config (``configs.interpreter_config``). Every candidate config is compiled for sm90 and gfx942
with no spills (tests/test_triton_compile.py, benchmarks/kernel_spills.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core.floatcodes import pack_fp4_pairs
from . import configs, prune
from .tiles import swizzled_tile

FP8, FP4 = 0, 1
PER_CHANNEL_GROUP = 1 << 30  # FP8 per output channel: every row is in scale row 0
# the autotuner's key: the M bucket, the shape and the scheme's constexprs (the autotuner adds the
# tensors' dtypes, x's among them)
AUTOTUNE_KEY = ("M_KEY", "N", "K", "KIND", "GROUP", "DOT_F32")


@triton.jit
def _decode_fp8(b):
    """fp32 value of E4M3FN bytes ``b`` (int32 0..255; NaN bytes are never written)."""
    s = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 7
    normal = ((s << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # e == 0: m * 2**-9
    sub = tl.where(s == 1, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def _decode_fp4(c):
    """fp32 value of E2M1 nibbles ``c`` (int32 0..15)."""
    s = (c >> 3) & 1
    e = (c >> 1) & 3
    m = c & 1
    normal = ((s << 31) | ((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.5
    sub = tl.where(s == 1, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def _tile(c_ptr, s_ptr, rows, offs_n, CR, N, GROUP_ROWS: tl.constexpr, SHIFT: tl.constexpr, KIND: tl.constexpr):
    """[R, BLOCK_N] weights of code rows ``rows`` (rows of the codes tensor; FP4: nibble SHIFT
    0 = even weight rows, 4 = odd), dequantized in fp32. Scale row = weight row // GROUP, where
    weight row = code row (FP8) or 2 * code row + SHIFT / 4 (FP4); GROUP_ROWS is GROUP in code
    rows (FP4: GROUP / 2)."""
    mask = (rows[:, None] < CR) & (offs_n[None, :] < N)
    b = tl.load(c_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.int32)
    if KIND == 0:
        v = _decode_fp8(b)
    else:
        v = _decode_fp4((b >> SHIFT) & 0xF)
    g = rows // GROUP_ROWS
    s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0)
    return v * s


@triton.jit
def _fp_dot_kernel(x_ptr, c_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, M_KEY,
                   KIND: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), GROUP_M swizzle. DOT_F32: fp32 operands,
    IEEE dot; else the dequantized tile is rounded to x's dtype before tl.dot."""
    pid = tl.program_id(0)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if KIND == 0:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            w = _tile(c_ptr, s_ptr, offs_k, offs_n, K, N, GROUP, 0, KIND)
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    else:
        HALF: tl.constexpr = BLOCK_K // 2
        for k0 in range(0, K, BLOCK_K):
            crow = k0 // 2 + tl.arange(0, HALF)  # code rows: weight rows 2*crow (lo) and 2*crow + 1 (hi)
            xmask = (offs_m[:, None] < M) & (2 * crow[None, :] < K)
            x_even = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * crow[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + offs_m[:, None] * stride_xm + 2 * crow[None, :] + 1, mask=xmask, other=0.0)
            lo = _tile(c_ptr, s_ptr, crow, offs_n, K // 2, N, GROUP // 2, 0, KIND)
            hi = _tile(c_ptr, s_ptr, crow, offs_n, K // 2, N, GROUP // 2, 4, KIND)
            if DOT_F32:
                acc += tl.dot(x_even.to(tl.float32), lo, input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), hi, input_precision="ieee")
            else:
                acc += tl.dot(x_even, lo.to(x_even.dtype))
                acc += tl.dot(x_odd, hi.to(x_odd.dtype))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def prepare_float(codes: torch.Tensor, scales: torch.Tensor, kind: int) -> dict[str, torch.Tensor]:
    """The kernel's layout from canonical codes uint8 [N, K] and decoded fp32 scales [N, G]."""
    if kind == FP4:
        codes = pack_fp4_pairs(codes)
    return {"fcodes": codes.t().contiguous(), "fscales": scales.to(torch.float32).t().contiguous()}


def fp_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              kind: int, group: int, autotune: bool = True) -> torch.Tensor:
    """``x`` [M, K] (fp16, bf16, fp32) -> [M, N] in x's dtype. ``autotune``: False runs the first
    config of the target's "fp_dot" list that fits the launch (no tuning runs)."""
    m, k = x.shape
    n = codes.shape[1]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    m_key = configs.m_key(m)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    args = (x, codes, scales, bias if bias is not None else out, out, m, n, k, x.stride(0), m_key)
    meta = {"KIND": kind, "GROUP": group, "HAS_BIAS": bias is not None, "DOT_F32": x.dtype == torch.float32}
    prune.launch("fp_dot", _fp_dot_kernel, grid, args, meta, m_key, autotune, AUTOTUNE_KEY)
    return out
