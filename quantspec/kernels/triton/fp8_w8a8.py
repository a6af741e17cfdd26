"""FP8 W8A8: FP8 activations x FP8 weights through tl.dot on fp8 operands, fp32 accumulation.

Schemes (``core/scheme.py``): ``fp8-dynamic`` (activations per token, dynamic), ``fp8-static``
(one calibrated activation scale), both with weights per output channel; ``fp8-block``
(DeepSeek-V3's FP8_BLOCK: weights in 128x128 blocks, activations per token per 128 input
columns, dynamic).

Two steps, as ``w8a8.py`` does for int8:

* ``quantize_fp8``: x [M, K] -> fp8 bytes [M, K] and fp32 scales (dynamic: absmax / FP8 max of
  each token, or of each token's 128-column group; static: the given scale). The rounding to the
  fp8 grid is done in fp32 arithmetic (round half to even at the element's binade step,
  saturating at the max), then cast: the bytes equal torch's ``float8`` cast of the same values
  (``core.floatcodes.round_fp8``), on every target and in the interpreter (whose own fp32 ->
  fp8 cast does not round to nearest).
* ``fp8_linear``: ``(qx @ qw.T)`` with both operands fp8; per-channel: ``* sx[m] * sw[n]`` in
  the epilogue; FP8_BLOCK: each 128-column K tile's partial product is scaled by
  ``sx[m, g] * sw[g, n]`` before it is added (the per-block promotion to fp32 DeepSeek-V3
  describes, BLOCK_K = 128).

FP8 flavours per target (``fp8_format``): OCP E4M3FN (max 448) on NVIDIA (sm89+), MI355
(gfx950) and the interpreter; E4M3FNUZ (max 240, exponent bias 8) on MI300 (gfx942), whose
weights are converted at prepare time (``core.floatcodes.e4m3fn_to_fnuz``: bytes kept, scales
doubled) and whose activations are quantized onto the FNUZ grid directly (absmax / 240).

Layout: ``qweight`` uint8 [N, K] (K contiguous: the K-major B operand fp8 MMAs take), ``wscale``
fp32 [N] (per channel) or [K / 128, N] (FP8_BLOCK).

Launch configs: configs.py's "fp8_w8a8" family, one list per vendor (NVIDIA: deeper pipelines on
sm90; AMD: num_stages 2, waves_per_eu, 16x16 MFMA, no kpack: its 2 is for fp16 / bf16 operands),
autotuned per (M bucket, N, K, GROUPED, the tensors' dtypes: the FP8 flavour and x's) and pruned
per launch (``prune.float_fits``): BLOCK_M 16 for M <= 16, BLOCK_K 128 (one FP8 block) on the
grouped path, 128 or 256 per channel. On sm90 the 16-row tiles take mma.sync, for which Triton
converts the fp8 operands to fp16 (exact), the taller ones wgmma on e4m3. ``autotune=False`` runs the first fitting config; the
interpreter one fixed config (``configs.interpreter_config``). Every candidate config is compiled
for sm90 and gfx942 with no spills (tests/test_triton_compile.py, benchmarks/kernel_spills.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs, prune
from .tiles import swizzled_tile

FP8_FORMATS = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}  # format -> its largest finite value
BLOCK = prune.FP8_BLOCK  # FP8_BLOCK's group of input columns (and K tile of the grouped path): 128
# the autotuner's key: the M bucket, the shape and the path (the autotuner adds the tensors' dtypes)
AUTOTUNE_KEY = ("M_KEY", "N", "K", "GROUPED")


def fp8_format(target: tuple[str, str]) -> str:
    """The FP8 flavour a target's MMA takes: E4M3FNUZ on MI300 (gfx94x), else E4M3FN."""
    backend, arch = target
    return "e4m3fnuz" if backend == "hip" and arch.startswith("gfx94") else "e4m3fn"


@triton.jit
def _round_fp8(v, FNUZ: tl.constexpr):
    """fp32 ``v`` rounded to the nearest E4M3FN (FNUZ: E4M3FNUZ) value, ties to even,
    saturating at the max; never -0. Exact: scaling by powers of two, and (v + 1.5 * 2**23) -
    1.5 * 2**23 rounds to an integer half to even in fp32."""
    if FNUZ:
        v = tl.minimum(tl.maximum(v, -240.0), 240.0)
        min_exp = -7
    else:
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        min_exp = -6
    e = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, min_exp)  # subnormals share the smallest normal binade's step
    up = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2**(3 - e): 3 mantissa bits
    down = ((124 + e) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3)
    r = ((v * up + 12582912.0) - 12582912.0) * down
    return tl.where(r == 0.0, 0.0, r)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_xm, n_groups,
                      STATIC: tl.constexpr, FNUZ: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row, g): columns [g * group, (g + 1) * group) of one row. Dynamic: pass 1 finds
    the absmax, the scale is absmax / max (at least 1e-12) and is stored at s[row, g]; static:
    the scale is s[0]. Pass 2 writes the fp8 bytes of x / scale."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(start, end, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        fmax = 240.0 if FNUZ else 448.0
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), fmax), 1e-12)
        tl.store(s_ptr + row * n_groups + g, scale)
    for k0 in range(start, end, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        r = _round_fp8(tl.math.div_rn(v, scale), FNUZ)
        if FNUZ:
            b = r.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
        else:
            b = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(q_ptr + row * K + offs, b, mask=offs < end)


@triton.jit
def _fp8_dot_kernel(qx_ptr, sx_ptr, qw_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, stride_sxm, M_KEY,
                    GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), GROUP_M swizzle. qx [M, K] and qw [N, K] fp8
    (pointers typed with the flavour: E4M3FN or E4M3FNUZ; K contiguous). Per channel: sx [M]
    (static: stride_sxm 0, one scale), sw [N]; GROUPED (BLOCK_K == 128): sx [M, K / 128] (row
    stride stride_sxm), sw [K / 128, N]."""
    pid = tl.program_id(0)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    rows_a = offs_m % M  # rows past M / N read real rows again (their results are not stored)
    rows_b = offs_n % N
    a_ptrs = qx_ptr + rows_a[:, None] * K + offs_k[None, :]
    b_ptrs = qw_ptr + rows_b[None, :] * K + offs_k[:, None]
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
        if GROUPED:
            g = k0 // BLOCK_K
            sa = tl.load(sx_ptr + offs_m * stride_sxm + g, mask=offs_m < M, other=0.0)
            sb = tl.load(sw_ptr + g * N + offs_n, mask=offs_n < N, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not GROUPED:
        sa = tl.load(sx_ptr + offs_m * stride_sxm, mask=offs_m < M, other=0.0)
        sb = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3fn", group: int | None = None,
                 static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> fp8 bytes uint8 [M, K] and fp32 scales: [M, 1] per token,
    [M, K / group] per token-group (``group``), or ``static_scale`` [1] as given."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {list(FP8_FORMATS)}, got {fmt!r}")
    m, k = x.shape
    group = k if group is None or static_scale is not None else group
    n_groups = triton.cdiv(k, group) if k else 0
    q = torch.empty((m, k), device=x.device, dtype=torch.uint8)
    if static_scale is not None:
        s = static_scale.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
    else:
        s = torch.empty((m, n_groups), device=x.device, dtype=torch.float32)
    if m == 0 or k == 0:
        return q, s
    block = min(BLOCK if group == BLOCK else 1024, triton.next_power_of_2(group))
    _quant_fp8_kernel[(m, n_groups)](x, q, s, k, group, x.stride(0), n_groups, STATIC=static_scale is not None,
                                     FNUZ=fmt == "e4m3fnuz", BLOCK_K=block)
    return q, s


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None,
               fmt: str = "e4m3fn", grouped: bool = False,
               static_scale: torch.Tensor | None = None, autotune: bool = True) -> torch.Tensor:
    """``quantize_fp8(x)`` then the fp8 GEMM. x [M, K] (fp16, bf16, fp32); qweight uint8 [N, K]
    fp8 bytes of ``fmt``; wscale fp32 [N] (per channel) or [K / 128, N] (``grouped``: FP8_BLOCK,
    K a multiple of 128); static_scale: fp8-static's activation scale [1]; autotune: False runs
    the first config of the target's "fp8_w8a8" list that fits (no tuning runs). Returns [M, N]
    in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.uint8 or qweight.shape != (n, k) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous uint8 [N, {k}], got {qweight.dtype} {tuple(qweight.shape)}")
    want = (k // BLOCK, n) if grouped else (n,)
    if wscale.dtype != torch.float32 or tuple(wscale.shape) != want or (grouped and k % BLOCK):
        raise ValueError(f"wscale must be fp32 {list(want)} (grouped: K a multiple of {BLOCK}), "
                         f"got {wscale.dtype} {tuple(wscale.shape)} for K = {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    qx, sx = quantize_fp8(x, fmt, BLOCK if grouped else None, static_scale)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    m_key = configs.m_key(m)
    stride_sxm = 0 if static_scale is not None else sx.stride(0)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
    f8 = torch.float8_e4m3fnuz if fmt == "e4m3fnuz" else torch.float8_e4m3fn
    args = (qx.view(f8), sx, qweight.view(f8), wscale, out if bias is None else bias, out, m, n, k, stride_sxm, m_key)
    prune.launch("fp8_w8a8", _fp8_dot_kernel, grid, args, {"GROUPED": grouped, "HAS_BIAS": bias is not None},
                 m_key, autotune, AUTOTUNE_KEY)
    return out
