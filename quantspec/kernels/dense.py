"""Dense Linears of the CPU decode path: bf16 and fp32 products of a few rows through the extension.

torch's bf16 matmul on CPU reads a [N, K] weight at a fraction of the memory bandwidth when x has
a few rows (the output head of a 4-bit model is most of its bytes: 1x576 @ 576x49152 took 4.0 ms
there and 1.2 ms here). ``fast_linear(module)`` returns a callable computing ``module(x)``: the
extension's ``bf16_gemv`` for bf16 ``nn.Linear``s on CPUs with AVX-512 BF16 when x has at most
``GEMV_MAX_M`` rows (fp32 accumulation of exact bf16 products, one bf16 rounding: within 1e-2
relative of the fp32 product), ``f32_gemv`` for fp32 ones on CPUs with AVX-512F (fp32 FMA, a
different summation order than torch's: within 1e-5 relative), the module itself otherwise.
torch's fp32 matmul costs 2-3x more for 5 rows than for one, the verification of k = 4
speculative tokens; ``f32_gemv`` reads the weight once for all rows.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .cpu_ext import ext_supports

GEMV_MAX_M = 8  # bf16: at 8 rows torch's matmul is as fast (measured 4096x4096, 49152x576)
# fp32: torch's matmul (MKL) is as fast at one row; f32_gemv wins from two rows on
GEMV_MIN_M = {torch.bfloat16: 1, torch.float32: 2}


@functools.cache
def gemv_op(dtype: torch.dtype):
    """The extension's few-row product for weights of ``dtype`` on this CPU, or None."""
    if dtype == torch.bfloat16:
        return torch.ops.quantspec_cpu.bf16_gemv.default if ext_supports("has_bf16_gemv") else None
    if dtype == torch.float32:
        return torch.ops.quantspec_cpu.f32_gemv.default if ext_supports("has_avx512f") else None
    return None


class DenseGemv:
    """``linear(x)`` through the extension's few-row product (``gemv_op``) for x with few rows."""

    def __init__(self, linear: nn.Linear, min_rows: int | None = None):
        """min_rows: the fewest rows that take the extension (default ``GEMV_MIN_M`` of the
        weight's dtype)."""
        self.linear = linear
        self.op = gemv_op(linear.weight.dtype)
        self.min_rows = GEMV_MIN_M[linear.weight.dtype] if min_rows is None else min_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        rows = x.numel() // x.shape[-1]
        if not self.min_rows <= rows <= GEMV_MAX_M or x.dtype != w.dtype:
            return nn.functional.linear(x, w, self.linear.bias)
        y = self.op(x.reshape(rows, x.shape[-1]), w)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], w.shape[0])


def fast_linear(module: nn.Module):
    """A callable equal to ``module`` (see the module docstring for when it is faster; a
    QuantLinear's own ``forward``, without nn.Module's per-call hook machinery)."""
    from .quant_linear import QuantLinear

    if isinstance(module, QuantLinear):
        return module.forward
    if (
        type(module) is nn.Linear
        and module.weight.is_cpu
        and module.weight.is_contiguous()
        and gemv_op(module.weight.dtype) is not None
    ):
        return DenseGemv(module)
    return module


@contextlib.contextmanager
def few_row_linears(model: nn.Module):
    """Within the block, each ``nn.Linear`` of ``model`` that ``fast_linear`` speeds up computes
    through it (same results within the tolerances above); the modules are restored after.

    For a target verifying k + 1 speculative tokens per call through its own forward.
    """
    patched = []
    for mod in model.modules():
        call = fast_linear(mod)
        if isinstance(call, DenseGemv) and "forward" not in mod.__dict__:
            mod.forward = call
            patched.append(mod)
    try:
        yield model
    finally:
        for mod in patched:
            del mod.forward
