"""RMSNorm as transformers' Llama computes it: normalize in fp32, round to x's dtype, times weight.

``rms_norm(x, weight, eps) = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last
dimension. One op of the CPU extension where it is built (eight small ops otherwise, which at
decode cost more than the arithmetic); the torch expression is the reference.
"""

from __future__ import annotations

import torch

from .cpu_ext import load_cpu_ext


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] (both on one device) -> [..., D] in torch's promotion of the two."""
    if x.is_cpu and weight.dtype == x.dtype and load_cpu_ext() is not None:
        return torch.ops.quantspec_cpu.rms_norm.default(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
