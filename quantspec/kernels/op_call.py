"""The call of the registered ``quantspec::quant_linear`` op (``custom_ops.py`` registers it).

Kept apart from ``custom_ops``, whose op implementation dispatches to the backend registry, so
that a backend can route a torch.compile trace through the op without an import cycle.
"""

from __future__ import annotations

import torch

from ..core.scheme import QuantScheme


def flatten_prepared(prepared: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], str]:
    """A backend's prepared dict -> (tensors sorted by name, "name1,name2,...")."""
    names = sorted(prepared)
    return [prepared[n] for n in names], ",".join(names)


def call_quant_linear(x: torch.Tensor, prepared: dict[str, torch.Tensor], backend: str, scheme: QuantScheme,
                      out_features: int, in_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.quantspec.quant_linear`` on ``prepared`` (the op must be registered)."""
    tensors, names = flatten_prepared(prepared)
    return torch.ops.quantspec.quant_linear.default(
        x, tensors, names, backend, scheme.bits, scheme.group_size, scheme.symmetric,
        scheme.act_order, scheme.activations or "", out_features, in_features, bias,
    )
