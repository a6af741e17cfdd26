"""Dense Linears of the CPU decode path: bf16 products of a few rows through the extension.

torch's bf16 matmul on CPU reads a [N, K] weight at a fraction of the memory bandwidth when x has
a few rows (the output head of a 4-bit model is most of its bytes: 1x576 @ 576x49152 took 4.0 ms
there and 1.2 ms here). ``fast_linear(module)`` returns a callable computing ``module(x)``: the
extension's ``bf16_gemv`` for bf16 ``nn.Linear``s on CPUs with AVX-512 BF16 when x has at most
``GEMV_MAX_M`` rows (fp32 accumulation of exact bf16 products, one bf16 rounding: within 1e-2
relative of the fp32 product), the module itself otherwise.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .cpu_ext import load_cpu_ext

GEMV_MAX_M = 8  # at 8 rows torch's matmul is as fast (measured 4096x4096, 49152x576)


@functools.cache
def gemv_available() -> bool:
    return load_cpu_ext() is not None and bool(torch.ops.quantspec_cpu.has_bf16_gemv())


class DenseGemv:
    """``linear(x)`` through ``quantspec_cpu::bf16_gemv`` for x with few rows."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        rows = x.numel() // x.shape[-1]
        if rows > GEMV_MAX_M or x.dtype != torch.bfloat16:
            return self.linear(x)
        y = torch.ops.quantspec_cpu.bf16_gemv.default(x.reshape(rows, x.shape[-1]), w)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], w.shape[0])


def fast_linear(module: nn.Module):
    """A callable equal to ``module`` (see the module docstring for when it is faster)."""
    if (
        type(module) is nn.Linear
        and module.weight.dtype == torch.bfloat16
        and module.weight.is_cpu
        and module.weight.is_contiguous()
        and gemv_available()
    ):
        return DenseGemv(module)
    return module
