"""Linears that read the same input (q/k/v, gate/up), run as one product when their layouts allow.

Decode on CPU runs hundreds of small Linears per token, and each call has a fixed cost as large
as a small layer's work; fusing q/k/v and gate/up removes three of a Llama block's seven calls.
``Siblings(mods)`` stacks the layers' canonical ``QuantResult``s along the output dimension and
prepares them once for the first layer's backend, when every layer is a prepared QuantLinear
with that backend, the same scheme, input width, compute dtype and column order (``g_idx``);
otherwise it calls the layers one by one. Either way ``siblings(x)`` returns the layers' outputs
in order, as the layers themselves would compute them. Fused layers release their own prepared
layouts (``QuantLinear.release_prepared``), so memory holds one copy; called directly, such a
layer prepares itself again. ``prepared`` (optional) is the fused layout already made for this
backend (e.g. views of the stacked experts of ``kernels.cpu_moe``), used instead of a new copy.
``fuse=False`` leaves the layers as they are (a model whose own
forward runs between uses, e.g. a speculative target, would re-prepare them every time).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core.scheme import QuantResult
from .dense import fast_linear
from .quant_linear import QuantLinear


def _same_columns(results: list[QuantResult]) -> bool:
    first = results[0].g_idx
    return all(
        (r.g_idx is None) == (first is None) and (first is None or torch.equal(r.g_idx, first))
        for r in results[1:]
    )


def stack_results(results: list[QuantResult]) -> QuantResult:
    """One QuantResult whose output rows are ``results``' rows in order (same scheme and g_idx)."""
    zeros = [r.zeros for r in results]
    return QuantResult(
        qweight=torch.cat([r.qweight for r in results]),
        scales=torch.cat([r.scales for r in results]),
        zeros=None if zeros[0] is None else torch.cat(zeros),  # type: ignore[arg-type]
        g_idx=results[0].g_idx,
        scheme=results[0].scheme,
    )


def _fusable(mods: list[nn.Module]) -> bool:
    if len(mods) < 2 or not all(isinstance(m, QuantLinear) for m in mods):
        return False
    first = mods[0]
    return first._runner is not None and all(
        m._backend is first._backend and m.scheme == first.scheme
        and m.in_features == first.in_features and m.compute_dtype == first.compute_dtype
        for m in mods
    )


class Siblings:
    """``mods`` (Linears of one input) as a callable: x [..., K] -> tuple of [..., N_i]."""

    def __init__(self, mods: list[nn.Module], fuse: bool = True, prepared: dict[str, torch.Tensor] | None = None):
        self.mods = list(mods)
        self.sizes = [int(m.out_features) for m in self.mods]
        self._calls = [fast_linear(m) for m in self.mods]
        self._run = None
        if fuse and _fusable(self.mods):
            results = [m.quant_result() for m in self.mods]
            if _same_columns(results):
                self._fuse(results, prepared)

    @property
    def fused(self) -> bool:
        return self._run is not None

    def _fuse(self, results: list[QuantResult], prepared: dict[str, torch.Tensor] | None) -> None:
        first = self.mods[0]
        backend = first._backend
        if prepared is None:
            prepared = backend.prepare(stack_results(results), first.compute_dtype)
        self._prepared = prepared
        n = sum(self.sizes)
        self._run = backend.bind(self._prepared, results[0].scheme, n, first.in_features)
        if self._run is None:
            return
        for m in self.mods:
            m.release_prepared()
        biases = [m.bias for m in self.mods]
        self._bias = None
        if any(b is not None for b in biases):
            dev = next(b.device for b in biases if b is not None)
            parts = [
                torch.zeros(s, dtype=first.compute_dtype, device=dev) if b is None else b.detach()
                for b, s in zip(biases, self.sizes)
            ]
            self._bias = torch.cat(parts)

    def fused_op(self) -> tuple[object, dict[str, torch.Tensor], torch.Tensor | None] | None:
        """(bound op, prepared tensors, bias) of the one fused product, or None when unfused."""
        return None if self._run is None else (self._run, self._prepared, self._bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._run is None:
            return tuple(call(x) for call in self._calls)
        return self._run(x, self._prepared, self._bias).split(self.sizes, dim=-1)
