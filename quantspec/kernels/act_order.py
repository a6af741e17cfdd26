"""Act-order weights for kernels that need contiguous groups: sort the columns once at load,
gather x's columns per call."""

from __future__ import annotations

import torch

from ..core.scheme import QuantResult
from ..errors import QuantspecError


def contiguous_groups_perm(g_idx: torch.Tensor, group_len: int) -> torch.Tensor | None:
    """The stable sort of rows by group when it makes every group contiguous with group_len
    rows (GPTQ's act-order g_idx), else None."""
    perm = torch.argsort(g_idx.to(torch.int64), stable=True)
    want = torch.arange(g_idx.numel(), device=g_idx.device) // group_len
    return perm if torch.equal(g_idx.to(torch.int64)[perm], want) else None


def group_sorted_codes(result: QuantResult, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] with the columns sorted by group, and perm int32 [K] (the column of x
    each sorted column reads; empty when the order is already the natural one)."""
    k = result.shape[1]
    none = torch.empty(0, dtype=torch.int32, device=result.qweight.device)
    if result.g_idx is None:
        return result.qweight, none
    order = contiguous_groups_perm(result.g_idx, result.scheme.group_len(k))
    if order is None:
        raise QuantspecError(
            f"this act-order g_idx does not sort into contiguous groups, which {backend} needs.",
            "use --backend triton or reference for this checkpoint.")
    if torch.equal(order, torch.arange(k, device=order.device)):
        return result.qweight, none
    return result.qweight[:, order], order.to(torch.int32)
