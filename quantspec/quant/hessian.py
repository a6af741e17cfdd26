"""The layer-wise Hessian of GPTQ: ``H = 2/n * sum_t x_t x_t^T`` over the n input rows.

Pure tensor functions, kept apart from any model code (the reference GPTQ's ``add_batch``;
llm-compressor's make_empty_hessian / accumulate_hessian).
"""

from __future__ import annotations

import math

import torch


def make_empty_hessian(in_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [K, K] zeros."""
    return torch.zeros(in_features, in_features, dtype=torch.float32, device=device)


def accumulate_hessian(
    H: torch.Tensor, x: torch.Tensor, nsamples: int
) -> tuple[torch.Tensor, int]:
    """Fold the rows of ``x`` ([..., K], any float dtype) into the running mean ``H``.

    ``H`` (fp32 [K, K], updated in place and returned) is ``2/n * X^T X`` over the ``nsamples``
    rows seen so far; each row of ``x`` (every token) counts as one sample. Returns
    ``(H, nsamples + rows)``.
    """
    x = x.reshape(-1, x.shape[-1]).to(device=H.device, dtype=torch.float32)
    rows = x.shape[0]
    if rows == 0:
        return H, nsamples
    total = nsamples + rows
    H.mul_(nsamples / total)
    x = x * math.sqrt(2.0 / total)
    H.addmm_(x.t(), x)
    return H, total
