"""GPT-2-style ``Conv1D`` projections as ``nn.Linear``, so that every quantizer and loader sees
one kind of layer.

transformers' ``Conv1D(nf, nx)`` keeps ``weight`` as [in, out] and computes ``x @ W + b``:
exactly ``nn.Linear`` with ``weight.T``. ``linearize_conv1d`` swaps each one for a
``Conv1DLinear`` (an ``nn.Linear`` that remembers where it came from), and
``conv1d_layout(model, state)`` turns the dense weights of such layers back to [in, out] when a
checkpoint is written, so that transformers and the engines read them as the original model's.
Quantized layers need nothing: the GPTQ/AWQ/compressed-tensors tensors are defined on
(in_features, out_features), and AutoGPTQ/GPTQModel store GPT-2's Conv1D layers the same way.
"""

from __future__ import annotations

import torch
from torch import nn


class Conv1DLinear(nn.Linear):
    """An ``nn.Linear`` made from a transformers ``Conv1D`` (weight transposed once)."""


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``pytorch_utils.Conv1D`` (matched by name: no import of transformers here)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def conv1d_shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Conv1D: its weight is [in, out]."""
    nx, nf = module.weight.shape
    return int(nx), int(nf)


@torch.no_grad()
def linearize_conv1d(model: nn.Module) -> list[str]:
    """Replace every Conv1D of ``model`` with an equivalent ``Conv1DLinear``; the names swapped."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if not is_conv1d(mod):
            continue
        k, n = conv1d_shape(mod)
        lin = Conv1DLinear(k, n, bias=mod.bias is not None, device=mod.weight.device,
                           dtype=mod.weight.dtype)
        lin.weight.copy_(mod.weight.t())
        if mod.bias is not None:
            lin.bias.copy_(mod.bias)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lin)
        swapped.append(name)
    return swapped


def conv1d_layout(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with the dense weight of every ``Conv1DLinear`` back in Conv1D's [in, out]."""
    names = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1DLinear)}
    return {k: (v.t().contiguous() if k in names else v) for k, v in state.items()}
