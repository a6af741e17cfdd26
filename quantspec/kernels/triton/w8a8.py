"""W8A8: int8 per-token dynamic activations x int8 per-channel weights, int32 accumulation.

``quantize_per_token``: [M, K] float -> int8 [M, K] and fp32 scales [M] (absmax / 127,
round half to even, clamp to [-128, 127]), the same arithmetic as the reference's
``quantize_per_token_int8``. ``w8a8_linear``: ``(qx @ qw.T) * sx[:, None] * sw[None, :] +
bias`` with tl.dot on int8 operands (int32 accumulator), both scales applied in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import configs
from .tiles import swizzled_tile


@triton.jit
def _round_half_even(v):
    """torch.round semantics without libdevice (portable to CUDA, ROCm and the interpreter)."""
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
    """One program per row: pass 1 finds absmax, pass 2 writes the codes."""
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1e-10)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = _round_half_even(tl.math.div_rn(v, scale))
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        tl.store(q_ptr + row * K + offs, q.to(tl.int8), mask=offs < K)


@triton.jit
def _w8a8_kernel(qx_ptr, sx_ptr, qw_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, M_KEY,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) with GROUP_M swizzle. qw is [N, K] (K-major)."""
    pid = tl.program_id(0)
    pid_m, pid_n = swizzled_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past M / N read real rows again (their results are not stored): only K is masked
    a_ptrs = qx_ptr + (offs_m % M)[:, None] * K + offs_k[None, :]
    b_ptrs = qw_ptr + (offs_n % N)[None, :] * K + offs_k[:, None]
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)
    sw = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric dynamic int8 quantization of each row.

    x: [M, K] fp16, bf16 or fp32 (rows contiguous).
    Returns int8 codes [M, K] and fp32 scales [M] (``max(absmax / 127, 1e-10)``).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got shape {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.int8)
    s = torch.empty((m,), device=x.device, dtype=torch.float32)
    if m == 0:
        return q, s
    block = 1024 if configs.interpreting() else min(4096, triton.next_power_of_2(k))
    _quant_per_token_kernel[(m,)](x, q, s, k, x.stride(0), BLOCK_K=block)
    return q, s


def w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor, bias: torch.Tensor | None,
    autotune: bool = True,
) -> torch.Tensor:
    """``quantize_per_token(x)`` then the int8 GEMM with both scales in the epilogue.

    x:       [M, K] fp16, bf16 or fp32.
    qweight: int8 [N, K] signed codes (the canonical code minus 128).
    wscale:  fp32 [N] per-channel weight scales.
    bias:    [N] or None.
    autotune: False runs the first config of the target's list (no tuning runs).
    Returns [M, N] in x's dtype. Raises ValueError on shapes or dtypes it cannot take.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.dtype != torch.int8 or qweight.shape != (n, k) or not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous int8 [N, {k}], got {qweight.dtype} {tuple(qweight.shape)}")
    if wscale.dtype != torch.float32 or wscale.shape != (n,):
        raise ValueError(f"wscale must be fp32 [{n}], got {wscale.dtype} {tuple(wscale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    qx, sx = quantize_per_token(x)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    args = (qx, sx, qweight, wscale, wscale if bias is None else bias, out, m, n, k,
            min(triton.next_power_of_2(m), 256))
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if configs.interpreting():
        _w8a8_kernel[grid](*args, HAS_BIAS=bias is not None, **configs.interpreter_config("w8a8"))
    elif autotune:
        tuned = configs.autotuned(_w8a8_kernel, "w8a8", configs.current_target(), ("M_KEY", "N", "K"))
        tuned[grid](*args, HAS_BIAS=bias is not None)
    else:
        cfg = configs.configs_for("w8a8", configs.current_target())[0]
        _w8a8_kernel[grid](*args, HAS_BIAS=bias is not None, **cfg.kwargs,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
