"""Tile bookkeeping the tiled Triton kernels share."""

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
