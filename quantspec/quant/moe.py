"""Mixture-of-experts in the quantize path: what the plan keeps dense, and how many tokens the
router sent each expert (for the report). The experts themselves are ``nn.Linear`` modules
once ``models.experts.linearize_experts`` has run, so every method handles them unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..models.experts import experts_modules, fused_experts_left, router_names
from .block_ops import block_forward
from .plan import LayerPlan


def plan_moe(model: nn.Module, plan: LayerPlan) -> None:
    """Routers (and shared-expert gates) stay dense, and experts that stay fused are listed as
    dense, each with its reason (nothing left out silently)."""
    for name, reason in {**router_names(model), **fused_experts_left(model)}.items():
        plan.quantize.pop(name, None)
        plan.regrouped.pop(name, None)
        plan.dense[name] = reason


def routed_tokens(block: nn.Module, block_name: str, inputs: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, int]:
    """{full Linear name: tokens the router sent to its expert} for every expert of ``block``,
    from one routed forward of the block on ``inputs`` ({} when it has no experts)."""
    found = experts_modules(block)
    if not found:
        return {}
    modes = {n: m.calibration for n, m in found.items()}
    for m in found.values():
        m.calibration, m.routed_counts = None, torch.zeros(len(m), dtype=torch.long)
    try:
        block_forward(block, inputs, kwargs)
        out = {}
        for rel, m in found.items():
            for e, expert in enumerate(m):
                for lin in expert.names:
                    out[f"{block_name}.{rel}.{e}.{lin}"] = int(m.routed_counts[e])
        return out
    finally:
        for n, m in found.items():
            m.calibration, m.routed_counts = modes[n], None
