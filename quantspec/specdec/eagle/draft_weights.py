"""An EAGLE head's weights quantized for drafting: a draft step reads every one of them.

A head of SmolLM2-135M is 8.9M fp32 weights (its layer and 8192 LM-head rows, 36 MB), read once
per draft token; on a CPU that read is the step. ``quantize_head`` rounds each Linear of the
layer and the LM-head rows to ``scheme`` (RTN; by default ``selfdraft.DRAFT_HEAD``, 8 bits per
output channel, the scheme of a ``self:`` draft's head) and runs them through the fastest kernel
here. It changes drafts, never outputs: the target verifies every draft. The choice of the
default is in docs/decisions/eagle-draft-weights.md.

A layer whose kernel here would be the reference one (a dequantized copy per call, slower than
the dense product) or that the format cannot hold stays dense, with the reason in the returned
report. Training never sees a quantized head: ``eagle_proposer`` quantizes its own loaded copy.
"""

from __future__ import annotations

import torch

from ...core.scheme import QuantScheme
from ...errors import QuantspecError
from .head import EagleHead

LINEARS = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LM_HEAD = "lm_head"


def _quantized(weight: torch.Tensor, scheme: QuantScheme, backend: str):
    """(QuantLinear of ``weight`` [N, K] under ``scheme`` on its fastest backend, None) or
    (None, why it stays dense)."""
    from ...kernels.quant_linear import QuantLinear
    from ...quant.rtn import rtn

    try:
        layer = QuantLinear.from_result(rtn(weight.detach().float(), scheme), "gptq", None, weight.dtype)
        layer = layer.to(weight.device)
        chosen = layer.prepare(backend)
    except QuantspecError as e:
        return None, e.problem
    if chosen == "reference":
        return None, f"no fast {scheme.short_name} kernel here ({layer.backend_reason})"
    return layer, ""


def quantize_head(head: EagleHead, scheme: QuantScheme, backend: str = "auto") -> dict[str, str]:
    """Swap ``head``'s Linears and LM-head rows for ``scheme``'s quantized layers, in place;
    returns ``{name: scheme short name, or "dense: why"}`` for each of them."""
    report: dict[str, str] = {}
    for name in LINEARS:
        layer, why = _quantized(getattr(head, name).weight, scheme, backend)
        if layer is None:
            report[name] = f"dense: {why}"
            continue
        setattr(head, name, layer)
        report[name] = scheme.short_name
    layer, why = _quantized(head.lm_head, scheme, backend)
    if layer is None:
        report[LM_HEAD] = f"dense: {why}"
    else:
        head.logits_layer = layer
        report[LM_HEAD] = scheme.short_name
    return report
