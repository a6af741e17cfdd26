"""The precision of a calibration method's block forwards over an fp32 model: bf16 autocast where
asked (or, for "auto", where the device multiplies bf16 natively), else the model's own fp32.
AWQ's searches (``awq.search_dtype``) and GPTQ's forwards (``gptq.forward_dtype``) use it."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from ..kernels.cpu_ext import cpu_has_native_bf16

FORWARD_DTYPES = ("float32", "bfloat16", "auto")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware (CPU: AVX-512 BF16, AMX or Arm BF16,
    where torch's bf16 matmul is 2-3x its fp32 one; CUDA/ROCm: bf16 support)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


# the options a recipe section may set to bfloat16 (all of FORWARD_DTYPES, or HESSIAN_DTYPES):
# where the device has no native bf16 products, bfloat16 is emulated there and slower than fp32
BF16_OPTIONS = {"gptq": ("forward_dtype", "hessian_dtype"), "awq": ("search_dtype",)}


def emulated_bf16(sections: dict[str, object], native: bool) -> list[str]:
    """The ``section.option`` names set to "bfloat16" in ``sections`` (recipe section name ->
    its options) when the device does not multiply bf16 natively ([] where it does). "auto"
    is never listed: it takes float32 there."""
    if native:
        return []
    return [f"{sec}.{opt}" for sec, options in sections.items() for opt in BF16_OPTIONS.get(sec, ())
            if getattr(options, opt) == "bfloat16"]


def forward_precision(block: nn.Module, choice: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of contexts for forward passes over ``block``: bf16 autocast for an fp32 block
    when ``choice`` (``FORWARD_DTYPES``) is bfloat16, or auto on a device with native bf16
    products; else no change. Enter a fresh one per forward: autocast caches each weight's bf16
    copy until its outermost context exits, and the methods write new values into the weights."""
    param = next(block.parameters())
    if param.dtype == torch.float32 and (choice == "bfloat16" or (choice == "auto" and native_bf16(param.device))):
        return functools.partial(torch.autocast, param.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def precision_name(block: nn.Module, factory: Callable[[], contextlib.AbstractContextManager]) -> str:
    """The dtype a ``forward_precision`` factory runs ``block``'s matrix products in (bfloat16
    under autocast, else the block's own: float32, float16, ...)."""
    if factory is not contextlib.nullcontext:
        return "bfloat16"
    return str(next(block.parameters()).dtype).removeprefix("torch.")
