"""Byte counts of tensors and of files (a leaf module: no imports of quantspec or torch)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch


def tensors_bytes(tensors: Iterable[torch.Tensor], *, distinct: bool = False, float_bytes: int | None = None) -> int:
    """Sum of ``numel * element_size`` over ``tensors``.

    ``distinct``: tensors that share their data (tied weights: the same ``data_ptr``) count
    once, and tensors on the meta device (no data) count 0. ``float_bytes``: count each
    floating-point element as that many bytes (e.g. 2: the size of a 16-bit checkpoint)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if distinct:
            if t.device.type == "meta" or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
        size = float_bytes if float_bytes is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


def files_bytes(paths: Iterable[str | os.PathLike]) -> int:
    """Sum of the sizes of the files ``paths``."""
    return sum(os.stat(p).st_size for p in paths)
