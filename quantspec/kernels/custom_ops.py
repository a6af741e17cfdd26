"""Quantized linear as one torch.library custom op, so torch.compile sees one opaque node.

``quantspec::quant_linear(x, tensors, names, backend, bits, group_size, symmetric, act_order,
activations, out_features, in_features, bias) -> Tensor`` runs any backend by name
("reference", "cpu", "triton") on its prepared tensors, passed as a list in a fixed order
(``flatten_prepared``: sorted by name, the names joined by ","). A fake (meta) kernel gives the
output's shape and dtype, so ``torch.compile(fullgraph=True)`` traces through it with no graph
break.

Nothing is registered at import: ``register_ops()`` does it once (it is idempotent), and
``quant_linear()`` calls it when not tracing. Call ``register_ops()`` (or run one eager
forward) before compiling a model that uses the op.
"""

from __future__ import annotations

import torch

from ..core.scheme import QuantScheme
from .op_call import call_quant_linear, flatten_prepared  # noqa: F401  (flatten_prepared: part of this API)

OP_NAME = "quantspec::quant_linear"


def unflatten_prepared(tensors: list[torch.Tensor], names: str) -> dict[str, torch.Tensor]:
    """Inverse of ``flatten_prepared``."""
    keys = names.split(",") if names else []
    if len(keys) != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for {len(keys)} names ({names!r})")
    return dict(zip(keys, tensors))


def _run(x, tensors, names, backend, bits, group_size, symmetric, act_order, activations,
         out_features, in_features, bias):
    from .backend import get_backend

    scheme = QuantScheme(bits=bits, group_size=group_size, symmetric=symmetric,
                         act_order=act_order, activations=activations or None)
    prepared = unflatten_prepared(list(tensors), names)
    y = get_backend(backend).linear(x, prepared, scheme, out_features, in_features, bias)
    return y.clone() if y is x else y  # a custom op's output may not alias an input


def _fake(x, tensors, names, backend, bits, group_size, symmetric, act_order, activations,
          out_features, in_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


def register_ops() -> None:
    """Register ``quantspec::quant_linear`` (and its fake kernel) once per process."""
    if hasattr(torch.ops.quantspec, "quant_linear"):
        return

    def quant_linear_impl(
        x: torch.Tensor, tensors: list[torch.Tensor], names: str, backend: str, bits: int,
        group_size: int, symmetric: bool, act_order: bool, activations: str,
        out_features: int, in_features: int, bias: torch.Tensor | None,
    ) -> torch.Tensor:
        return _run(x, tensors, names, backend, bits, group_size, symmetric, act_order,
                    activations, out_features, in_features, bias)

    op = torch.library.custom_op(OP_NAME, mutates_args=())(quant_linear_impl)
    op.register_fake(_fake)


def quant_linear(
    x: torch.Tensor,
    prepared: dict[str, torch.Tensor],
    backend: str,
    scheme: QuantScheme,
    out_features: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x @ W.T + bias`` through the custom op.

    x: [..., in_features] (the backend's activation dtypes). prepared: the dict the backend's
    ``prepare`` returned. backend: a registry name. scheme: the layer's QuantScheme
    (static_groups is not passed: no backend's ``linear`` reads it).
    Returns [..., out_features] in x's dtype.
    """
    if not torch.compiler.is_compiling():
        register_ops()
    return call_quant_linear(x, prepared, backend, scheme, out_features, in_features, bias)
