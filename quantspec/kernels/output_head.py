"""A model's output head: its logits, and their argmax without reading every fp32 weight.

Greedy decoding needs only the argmax of each position's logits. The fp32 head of a small model
is a large part of what a decode step reads: 544 MB of Qwen2.5-Coder-0.5B's 2 GB (its 151936
tokens), 113 MB of SmolLM2-135M's 540 MB. ``OutputHead.argmax`` reads an int8 copy of the head
instead (a quarter of the bytes) and then the fp32 rows of the few tokens that can still win:

* ``screen_tables(weight)``: each row rounded to int8 with one fp32 scale (absmax / 127), and a
  bound per row such that |logit - screened logit| <= bound * ||x||_2 for every x: the row's
  rounding error (Cauchy-Schwarz: ||w - scale * q||_2) plus the fp32 rounding of both products
  (at most (K/16 + 4) unit roundoffs of ||w||_2 ||x||_2 for a 16-lane sum; the tables keep
  4 (K/16 + 8), more than four times that).
* the extension's ``screened_argmax`` (csrc/cpu_screen.cpp): the screened logits; every token
  whose upper bound reaches the best lower bound is a candidate; the candidates' fp32 logits
  come from the same tile as ``f32_gemv``'s, bit for bit; the first maximum among them wins.

So ``argmax(x)`` is exactly ``logits(x).argmax(-1)`` (the first maximum, NaN as torch orders it)
for 1 to ``GEMV_MAX_M`` rows, where ``logits`` runs through ``f32_gemv`` at every row count that
``argmax`` screens (one row included: the head's own row rule, as fast as torch's matmul there).
On the validation prompts, one or two candidates per position on average for both models (16
to 26 at worst), so the fp32 reads are a few KB.

Where the head cannot be screened (``refusal`` says why: a quantized or biased head, another
dtype than fp32, no AVX-512 in this CPU or no extension), and for weights that are not all finite,
``argmax`` is the argmax of ``logits``.
The int8 copy costs a quarter of the head's size in memory; it is built on the first ``argmax``
(0.3 s for SmolLM2-135M's head here) and kept with the weight, by identity and in-place version, so that
every decoder over the same model shares it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .cpu_ext import ext_supports
from .dense import GEMV_MAX_M, DenseGemv, fast_linear
from .small_ops import argmax as argmax_rows

UNIT_ROUNDOFF = 2.0**-24  # fp32


@dataclass(frozen=True)
class ScreenTables:
    """The int8 copy of a head [N, K] and its error bounds."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # fp32 [N]
    bound: torch.Tensor  # fp32 [N]: |logit - scale * (q . x)| <= bound * ||x||_2


def screen_tables(weight: torch.Tensor, chunk: int = 4096) -> ScreenTables:
    """``weight`` (fp32 [N, K], finite) rounded to int8 per row, with each row's bound (see the
    module docstring), in fp64 a ``chunk`` of rows at a time."""
    n, k = weight.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    bound = torch.empty(n, dtype=torch.float64)
    slack = (k / 16 + 8) * 4 * UNIT_ROUNDOFF
    for lo in range(0, n, chunk):
        w = weight[lo: lo + chunk].detach().to(torch.float64)
        s = (w.abs().amax(dim=1) / 127).to(torch.float32)
        s = torch.where(s > 0, s, torch.ones_like(s))
        codes = (w / s.double().unsqueeze(1)).round().clamp(-127, 127)
        deq = codes * s.double().unsqueeze(1)
        err, deq_norm = (w - deq).norm(dim=1), deq.norm(dim=1)
        q[lo: lo + chunk] = codes.to(torch.int8)
        scale[lo: lo + chunk] = s
        b = err + slack * (w.norm(dim=1) + deq_norm)
        # the kernel forms a -/+ bound * ||x|| in fp32, |a| <= ||deq|| ||x||: one rounding each
        bound[lo: lo + chunk] = (b + 4 * UNIT_ROUNDOFF * (deq_norm + b)) * (1 + 1e-6)
    b32 = bound.to(torch.float32)
    return ScreenTables(q, scale, torch.nextafter(b32, torch.full_like(b32, float("inf"))))


def screen_refusal(module: nn.Module) -> str | None:
    """Why ``module``'s argmax cannot be screened (one line), or None."""
    if type(module) is not nn.Linear:
        return f"the head is a {type(module).__name__}, not a dense nn.Linear"
    w = module.weight
    if module.bias is not None:
        return "the head has a bias"
    if w.dtype != torch.float32:
        return f"the head is {w.dtype}; screening takes fp32 heads (bit-exact candidates need f32_gemv)"
    if not w.is_cpu or not w.is_contiguous():
        return "the head is not a contiguous CPU tensor"
    if not ext_supports("has_screened_argmax"):  # AVX-512 F, BW and VL
        return "this CPU or build has no screened_argmax (the C++ extension with AVX-512 F/BW/VL)"
    return None


# id(weight) -> (a weak reference to it, its in-place version, tables): shared by every OutputHead
# over the same weight, dropped with it (tensors compare by value, so no WeakKeyDictionary)
_TABLES: dict[int, tuple[weakref.ref, int, ScreenTables | None]] = {}


def _tables(weight: torch.Tensor) -> ScreenTables | None:
    """``screen_tables(weight)``, built once per weight and in-place version; None for a weight
    with non-finite values (no bound holds)."""
    held = _TABLES.get(id(weight))
    if held is None or held[0]() is not weight or held[1] != weight._version:
        key = id(weight)
        tables = screen_tables(weight) if bool(torch.isfinite(weight).all()) else None
        held = (weakref.ref(weight, lambda _, key=key: _TABLES.pop(key, None)), weight._version, tables)
        _TABLES[key] = held
    return held[2]


class OutputHead:
    """``logits(x)`` of an output head module, and ``argmax(x)``: their argmax, screened where
    ``refusal`` is None (see the module docstring). ``screened_rows`` counts the rows screened
    so far."""

    def __init__(self, module: nn.Module, screen: bool = True):
        self.module = module
        self.refusal = screen_refusal(module) if screen else "turned off (screen=False)"
        # where argmax screens, logits come from f32_gemv at every row count it screens
        self.logits = DenseGemv(module, min_rows=1) if self.refusal is None else fast_linear(module)
        self.screened_rows = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> int64 [...]: ``logits(x).argmax(-1)``."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.refusal is not None or x.dtype != torch.float32 or not 1 <= rows <= GEMV_MAX_M:
            return argmax_rows(self.logits(x))
        w = self.module.weight
        t = _tables(w)
        if t is None:
            return argmax_rows(self.logits(x))
        ids, _ = torch.ops.quantspec_cpu.screened_argmax.default(
            x.reshape(rows, x.shape[-1]), t.q, t.scale, t.bound, w)
        self.screened_rows += rows
        return ids.reshape(x.shape[:-1])
