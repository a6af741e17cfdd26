"""The grouped expert path: a quantized ``LinearExperts`` (``models/experts.py``) whose experts
all run on the Triton backend computes its routed output with two grouped launches instead of
three products per active expert: the tokens are gathered in expert order, every active
expert's gate and up in one grouped GEMM (``triton/moe_gemm.py``; gate and up stacked along N),
the gated activation, every active expert's down in a second one, and the results scattered back
weighted by the router.

``attach_grouped(model)`` binds it to each LinearExperts that qualifies (every expert Linear a
QuantLinear prepared for "triton" with one scheme, no act-order layout, no bias); the others keep the
per-expert path, which runs on any backend. The stacked copy is made once, at attach time.
Experts on the cpu backend have a one-token path of their own (``kernels.cpu_moe``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.experts import LinearExperts, experts_modules, routing_order
from .quant_linear import QuantLinear


class GroupedExperts:
    """Stacked Triton layouts of one LinearExperts and its forward (same signature)."""

    def __init__(self, experts: LinearExperts):
        mlps = list(experts)
        gate, up, down = ([m.linears()[i] for m in mlps] for i in range(3))
        self.scheme = gate[0].scheme
        self.glu = mlps[0].glu
        self.n_experts = len(mlps)
        self.gate_up = _stack([(_gptq(g), _gptq(u)) for g, u in zip(gate, up)])
        self.down = _stack([(_gptq(d),) for d in down])

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        from .triton.moe_gemm import moe_wq_linear

        tok, slot, counts = routing_order(top_k_index, self.n_experts)
        bits, group = self.scheme.bits, self.scheme.group_size
        gu = moe_wq_linear(hidden[tok].contiguous(), counts, *self.gate_up, bits, group)
        inter = gu.shape[1] // 2
        h = self.glu(gu[:, :inter], gu[:, inter:]).contiguous()
        y = moe_wq_linear(h, counts, *self.down, bits, group)
        y = y.float() * top_k_weights[tok, slot, None].float()
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        out.index_add_(0, tok, y)
        return out.to(hidden.dtype)


def _gptq(lin: QuantLinear) -> dict[str, torch.Tensor]:
    """A linear's prepared tensors with qweight in the GPTQ layout, which the grouped kernel reads:
    a pre-shuffled one (``triton/layout.py``, opt-in) is unshuffled for the stacked copy."""
    from .triton.layout import LAYOUT_MFMA, LAYOUT_MMA, unshuffle

    p = dict(lin.prepared())
    for layout, key in ((LAYOUT_MMA, "qweight_mma"), (LAYOUT_MFMA, "qweight_mfma")):
        if key in p:
            p["qweight"] = unshuffle(p.pop(key), lin.in_features, lin.out_features, layout)
    return p


def _stack(layers: list[tuple[dict, ...]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(qweight [E, KW, N], scales [E, G, N], zeros or None) from each expert's prepared
    layouts, the layouts of one expert side by side along N."""
    def cat(key):
        if any(key not in p for parts in layers for p in parts):
            return None
        return torch.stack([torch.cat([p[key] for p in parts], dim=1) for parts in layers]).contiguous()

    return cat("qweight"), cat("scales"), cat("zeros")


def _qualifies(experts: LinearExperts) -> bool:
    lins = [lin for mlp in experts for lin in mlp.linears()]
    if not all(isinstance(m, QuantLinear) and m.backend_name == "triton" and m.bias is None for m in lins):
        return False
    schemes = {m.scheme for m in lins}
    scheme = next(iter(schemes))
    # the grouped kernel reads integer layouts (qweight); float weights (fcodes) go per expert
    if len(schemes) != 1 or scheme.act_order or scheme.activations or scheme.is_float:
        return False
    return not any({"perm", "g_idx"} & set(m.prepared()) for m in lins)


def attach_grouped(model: nn.Module) -> list[str]:
    """Bind the grouped path to every qualifying LinearExperts of ``model``; returns their names."""
    bound = []
    for name, experts in experts_modules(model).items():
        if _qualifies(experts):
            experts.runner = GroupedExperts(experts)
            bound.append(name)
    return bound
