"""One NVFP4 global scale for the Linears an engine fuses into one product.

vLLM runs q/k/v as one QKV Linear and gate/up as one merged Linear (a MoE expert's gate/up as
its w13), and an NVFP4 layer of those keeps one per-tensor global scale: it takes the largest of
the checkpoint's shards' (``weight_global_scale.max()``, with a warning when they differ), which
dequantizes every other shard by the wrong factor. So the shards must be quantized under one
global scale, the one of their joint amax (``448 * 6 / max amax``), as llm-compressor does.

Fused siblings: planned Linears of one true-sequential group (they read the same input) under
the same parent module (``self_attn.q/k/v_proj``; ``mlp.gate/up_proj``; ``mlp.experts.3.gate/
up_proj``, expert by expert). Pure functions of the block's current weights.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.scheme import QuantScheme
from .arch import ArchSpec
from .block_ops import block_groups
from .floatgrid import global_scale


def fused_siblings(group: list[str]) -> list[list[str]]:
    """The Linears of one true-sequential group (full names) split by parent module, in order."""
    parents: dict[str, list[str]] = {}
    for name in group:
        parents.setdefault(name.rpartition(".")[0], []).append(name)
    return list(parents.values())


def shared_global_scales(weights: dict[str, torch.Tensor], siblings: list[list[str]],
                         plan: dict[str, QuantScheme]) -> dict[str, torch.Tensor]:
    """{name: NVFP4 global scale} for the NVFP4 names of ``siblings``: each set of siblings under
    the scale of their joint amax (a Linear without NVFP4 siblings gets its own)."""
    out = {}
    for names in siblings:
        nv = [n for n in names if plan[n].weights == "nvfp4"]
        if not nv:
            continue
        amax = torch.stack([weights[n].detach().abs().amax().to(torch.float32).cpu() for n in nv]).amax()
        gs = global_scale(amax.reshape(1))
        out.update({n: gs.to(weights[n].device).clone() for n in nv})  # one tensor each: written apart
    return out


def block_global_scales(block: nn.Module, block_name: str, plan: dict[str, QuantScheme],
                        arch: ArchSpec) -> dict[str, torch.Tensor]:
    """``shared_global_scales`` of a block's planned Linears, from their current weights."""
    if not any(s.weights == "nvfp4" for s in plan.values()):
        return {}
    siblings = [s for g in block_groups(block, block_name, plan, arch) for s in fused_siblings(g)]
    weights = {n: block.get_submodule(n[len(block_name) + 1:]).weight for names in siblings for n in names}
    return shared_global_scales(weights, siblings, plan)
