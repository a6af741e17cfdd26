"""A decode step's dense blocks as one C++ loop: the extension's ``DecodePlan`` (cpu_decode.cpp).

``StaticDecoder`` runs a block as about a dozen calls of the extension's ops from Python. On a
small model the ops are short, and the Python around them costs about as much: a 4-bit draft of
SmolLM2-135M spent ~45% of its decode step outside the ops (py-spy, one Xeon core). A plan
gathers every block's tensors and constants once and makes the same calls, with the same
arguments and in the same order, from C++. The arithmetic is the same, so the results are the
same bits (tests/test_decode_plan.py).

``build_plan(decoder)`` returns ``(plan, None)``, or ``(None, reason)`` when the decoder's blocks
are not all the plan's kind. Then the Python loop runs as before. The plan's kind of block:
- a dense MLP (no MoE);
- the CPU extension's products (``BoundQGemm``: packed 4/8-bit layouts), or dense
  ``nn.Linear``s (``DenseGemv`` where ``fast_linear`` uses it, else ``F.linear``);
- norms through the extension's ``rms_norm`` in the decoder's dtype;
- head dims that the extension's ``attend`` takes (AVX-512F).
``StaticDecoder._blocks`` uses the plan only on its no-holes path (no row masks, no tree, no
KV-cache quantization) with fewer rows than ``DENSE_FROM_M``, where ``BoundQGemm`` runs its
kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.cpu import BoundQGemm
from ..kernels.cpu_ext import ext_supports, load_cpu_ext
from ..kernels.dense import GEMV_MAX_M, DenseGemv, fast_linear
from ..kernels.quant_linear import QuantLinear
from ..kernels.siblings import Siblings
from ..kernels.small_ops import rms_norm

DENSE, QGEMM, QGEMM_PANEL = 0, 1, 2  # DecodeLinear kinds (cpu_decode.cpp)


class NoPlan(Exception):
    """Why a decoder gets no plan (one line)."""


def _bound(ext, op, prepared: dict[str, torch.Tensor], bias: torch.Tensor | None):
    if not isinstance(op, BoundQGemm):
        raise NoPlan(f"a product through {type(op).__name__}, not the CPU extension's kernel")
    return ext.DecodeLinear(QGEMM_PANEL if op.panels else QGEMM, prepared["w"], prepared["scales"],
                            prepared["zeros"], prepared["src"], bias, op.bits, op.block, op.out_features, 0, 0)


def _linear(ext, module: nn.Module):
    """The DecodeLinear computing ``fast_linear(module)(x)``."""
    if isinstance(module, QuantLinear):
        op, prepared = module.bound()
        return _bound(ext, op, prepared, module.bias)
    if type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        call = fast_linear(module)
        low, high = (call.min_rows, GEMV_MAX_M) if isinstance(call, DenseGemv) else (1, 0)  # (1, 0): never
        empty = module.weight.new_empty(0)
        return ext.DecodeLinear(DENSE, module.weight, empty, empty, empty, module.bias, 0, 0, 0, low, high)
    raise NoPlan(f"a {type(module).__name__} layer")


def _siblings(ext, sib: Siblings, outputs: int) -> tuple[list, list[int]]:
    if len(sib.sizes) != outputs:
        raise NoPlan(f"{len(sib.sizes)} sibling products where the block splits {outputs}")
    fused = sib.fused_op()
    if fused is not None:
        return [_bound(ext, *fused)], list(sib.sizes)
    return [_linear(ext, m) for m in sib.mods], list(sib.sizes)


def _plan(decoder):
    ext = load_cpu_ext()
    if ext is None:
        raise NoPlan("the CPU extension is not built here")
    if decoder.device.type != "cpu" or not ext_supports("has_avx512f"):
        raise NoPlan("the extension's attention needs AVX-512F on a CPU")
    d, dtype = decoder.head_dim, decoder.dtype
    if d % 16 or d > 256:
        raise NoPlan(f"head_dim {d} (the extension's attention takes multiples of 16 up to 256)")
    if decoder.norm is not rms_norm and dtype != torch.float32:
        raise NoPlan("norms rounded once in fp32 (the extension's rms_norm rounds in the model's dtype)")
    plan = ext.DecodePlan(decoder.n_heads, decoder.n_kv, d, decoder.eps)
    for blk in decoder.blocks:
        if blk.moe is not None or blk.gate_up is None or blk.down_module is None:
            raise NoPlan("a mixture-of-experts block")
        norms = [blk.attn_norm, blk.mlp_norm] + ([blk.q_norm, blk.k_norm] if blk.q_norm is not None else [])
        if any(n.dtype != dtype for n in norms):
            raise NoPlan(f"norm weights in another dtype than the model's {dtype}")
        qkv, qkv_sizes = _siblings(ext, blk.qkv, 3)
        gate_up, gate_up_sizes = _siblings(ext, blk.gate_up, 2)
        sinks = None if blk.sinks is None else blk.sinks.to(torch.float32).contiguous()
        plan.add_block(blk.attn_norm, blk.mlp_norm, blk.q_norm, blk.k_norm, sinks, blk.window or 0,
                       qkv, qkv_sizes, _linear(ext, blk.out_module), gate_up, gate_up_sizes,
                       _linear(ext, blk.down_module))
    return plan


def build_plan(decoder) -> tuple[object | None, str | None]:
    """(the extension's DecodePlan of ``decoder``'s blocks, None), or (None, why there is none)."""
    try:
        return _plan(decoder), None
    except NoPlan as why:
        return None, str(why)
