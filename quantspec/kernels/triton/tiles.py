"""Tile bookkeeping the tiled Triton kernels share: the L2 swizzle, the even-tile heuristic and the
split-K epilogue."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in a grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) tiles,
    GROUP_M tile rows at a time (the programs running together share x and W tiles in L2)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows


# K and N multiples of the config's tiles need no masks (set per config, after autotuning)
EVEN = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
                          "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0})


@triton.jit
def store_result(acc, offs_m, offs_n, M, N, pid_k, b_ptr, out_ptr, part_ptr,
                  HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Epilogue: bias + cast into ``out`` (SPLIT_K == 1), else fp32 partials of split pid_k.
    Offsets in int64: M * N may pass 2**31 (a long prefill through a wide layer)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=mask)
