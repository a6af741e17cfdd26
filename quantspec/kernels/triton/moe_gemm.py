"""Grouped weight-only GEMM for mixture-of-experts: every active expert's product in one launch.

``y[r] = x[r] @ dequant(W[e(r)]).T`` for rows ``r`` sorted by expert: rows
``offsets[e] .. offsets[e + 1]`` belong to expert ``e``. The experts' weights are stacked in the
Triton backend's layout (``wq_gemm.py``): ``qweight`` int32 [E, ceil(K / PF), N], ``scales``
[E, G, N], ``zeros`` uint8 [E, G, N] or None (symmetric). No act-order (g_idx): MoE exports of
per-expert act-order keep the per-expert path.

Grid: (row tiles, N tiles). The host lists, for each expert with rows, its BLOCK_M row tiles
(``tile_expert``, ``tile_row``), so experts with no rows cost nothing and decode (a few rows per
active expert) launches one small grid instead of one kernel per expert and projection. Each
program dequantizes its expert's weight tile (a scale, and zero, gathered per element) and
accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .wq_gemm import PER_CHANNEL_GROUP, _dequant_gathered, field_bits


@triton.jit
def _moe_wq_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                   N, K, stride_xm, code_mask,
                   FB: tl.constexpr, GROUP: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PF: tl.constexpr = 32 // FB
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    row0 = tl.load(tile_row_ptr + pid_m)
    end = tl.load(offsets_ptr + e + 1)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = tl.cdiv(K, tl.minimum(GROUP, K))
    qw = qw_ptr + e * tl.cdiv(K, PF) * N
    s = s_ptr + e * groups * N
    z = z_ptr + e * groups * N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _dequant_gathered(qw, code_mask, s, z, s, k0, offs_n, K, N, FB, GROUP, SYM_ZERO, HAS_ZEROS,
                              False, False, BLOCK_K, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xmask = (offs_m[:, None] < end) & (offs_k[None, :] < K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=xmask, other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    mask = (offs_m[:, None] < end) & (offs_n[None, :] < N)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def row_tiles(counts: list[int], block_m: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_row, offsets) int32 for rows grouped by expert, ``counts[e]`` each."""
    offsets, experts, rows = [0], [], []
    for e, c in enumerate(counts):
        for r in range(0, c, block_m):
            experts.append(e)
            rows.append(offsets[-1] + r)
        offsets.append(offsets[-1] + c)
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return as_t(experts), as_t(rows), as_t(offsets)


def moe_wq_linear(x: torch.Tensor, counts: list[int], qweight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, bits: int, group_size: int,
                  block_m: int = 16, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """[R, N] = rows of ``x`` [R, K] (grouped by expert, ``counts[e]`` rows for expert e) times
    their expert's dequantized weight (stacked layout: module docstring), in x's dtype."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with contiguous rows, got {tuple(x.shape)}")
    e, kw, n = qweight.shape
    k = x.shape[1]
    fb = field_bits(bits)
    if qweight.dtype != torch.int32 or kw != triton.cdiv(k, 32 // fb) or len(counts) != e or sum(counts) != x.shape[0]:
        raise ValueError(f"qweight {qweight.dtype} {tuple(qweight.shape)} does not fit x {tuple(x.shape)} "
                         f"and {len(counts)} expert counts summing to {sum(counts)}")
    if scales.dim() != 3 or scales.shape[0] != e or scales.shape[2] != n:
        raise ValueError(f"scales must be [{e}, G, {n}], got {tuple(scales.shape)}")
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.uint8):
        raise ValueError("zeros must be uint8 with the scales' shape")
    out = torch.empty((x.shape[0], n), device=x.device, dtype=x.dtype)
    if x.shape[0] == 0:
        return out
    tile_expert, tile_row, offsets = row_tiles(counts, block_m, x.device)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _moe_wq_kernel[grid](
        x, qweight, scales, zeros if zeros is not None else scales, out, tile_expert, tile_row, offsets,
        n, k, x.stride(0), (1 << fb) - 1,
        FB=fb, GROUP=PER_CHANNEL_GROUP if group_size == -1 else group_size, SYM_ZERO=float(1 << (bits - 1)),
        HAS_ZEROS=zeros is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out
