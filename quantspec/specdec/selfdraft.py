"""QuantizedSelf: the target, quantized by this library, as its own draft.

``quantize_in_memory`` deep-copies the target and swaps each planned nn.Linear for a
``QuantLinear`` built from ``rtn(W, scheme)`` in the GPTQ format, run by the fastest kernel
backend available here. The plan (which layers, regrouping when K is not divisible by the
group size) is the library's own ``quant.plan.make_plan``, so the draft quantizes exactly the
layers a checkpoint would. A checkpoint folder goes through ``quantspec.load_quantized``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..quant.scheme import QuantScheme
from .proposers import DraftModel


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def quantize_in_memory(
    model: nn.Module,
    scheme: QuantScheme,
    include_lm_head: bool = True,
    fmt: str = "gptq",
    backend: str = "auto",
    dtype: torch.dtype | None = None,
) -> tuple[nn.Module, dict]:
    """A quantized copy of ``model`` (RTN) and a report {layer: scheme or reason, backends}.

    include_lm_head: the draft may quantize the output projection too (a large share of a
    small model's weights); the target itself is never changed.
    dtype: the copy's compute dtype (default: the model's); a bf16 draft of an fp32 target
    reads half the bytes in the layers it leaves dense.
    """
    from ..formats import get_format
    from ..kernels.quant_linear import QuantLinear
    from ..quant.plan import make_plan
    from ..quant.rtn import rtn

    from ..models.conv1d import linearize_conv1d

    draft = copy.deepcopy(model).eval()  # a tied lm_head is swapped, the embedding stays
    if dtype is not None:
        draft = draft.to(dtype)
    linearize_conv1d(draft)
    ignore = () if include_lm_head else ("lm_head",)
    plan = make_plan(draft, scheme, get_format(fmt), ignore=ignore)
    backends: dict[str, str] = {}
    for name, layer_scheme in plan.quantize.items():
        lin = draft.get_submodule(name)
        result = rtn(lin.weight.detach().to(torch.float32), layer_scheme)
        qlin = QuantLinear.from_result(result, fmt, lin.bias, dtype=lin.weight.dtype)
        qlin = qlin.to(lin.weight.device)
        backends[name] = qlin.prepare(backend)
        _set_module(draft, name, qlin)
    report = {
        "quantized": {n: s.short_name for n, s in plan.quantize.items()},
        "dense": dict(plan.dense),
        "regrouped": dict(plan.regrouped),
        "backends": backends,
    }
    return draft, report


class QuantizedSelf(DraftModel):
    """A DraftModel over a quantized copy of the target (or a quantized checkpoint)."""

    def __init__(self, model: nn.Module, name: str = "self", report: dict | None = None):
        super().__init__(model, name=name)
        self.report = report or {}

    @classmethod
    def from_target(
        cls, target: nn.Module, scheme: QuantScheme | None = None, include_lm_head: bool = True,
        dtype: torch.dtype | None = None,
    ) -> "QuantizedSelf":
        scheme = scheme or QuantScheme(bits=4, group_size=128)
        draft, report = quantize_in_memory(target, scheme, include_lm_head=include_lm_head, dtype=dtype)
        return cls(draft, name=f"self:{scheme.short_name}", report=report)

    @classmethod
    def from_checkpoint(cls, path: str, target: nn.Module) -> "QuantizedSelf":
        from ..checkpoint.load import load_quantized

        device = next(target.parameters()).device
        dtype = next(target.parameters()).dtype
        model = load_quantized(path, dtype=dtype, device=device)
        return cls(model, name=f"self:{path}", report={"backends": getattr(model, "quantspec_backends", {})})
