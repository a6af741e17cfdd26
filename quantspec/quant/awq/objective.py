"""What AWQ's searches score a candidate on: the output of the module that consumes a smoothing
pair's Linears (the attention for q/k/v, the MLP for gate/up), replayed with its recorded
arguments on whole calibration sequences; else the Linears' own outputs on a token sample (v ->
o, up -> down). Also the block-level check of a block's clips, and the precision the searches
run in. Under data-parallel calibration (``distributed.py``) each process scores its own
sequences and tokens and the sums of squared errors and their counts are reduced before any
division.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..block_ops import block_forward
from ...core.scheme import QuantScheme
from ..distributed import Reducer, Share
from ..smoothing import ResolvedPair
from .clip import apply_clip, fake_quantize

# tokens per part of a Linear-output objective: a candidate scale's error is summed part by part
# and the search drops it once the sum passes the best candidate's (search_scale's ``bounded``)
PART_TOKENS = 512


def parent_name(linear_names: tuple[str, ...]) -> str:
    """The deepest module that holds every Linear of a pair ('' for the block itself)."""
    parts = [n.split(".")[:-1] for n in linear_names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


@dataclass
class ParentCalls:
    """Recorded calls of the module that consumes a pair's Linears, one per calibration
    sequence, with the pair's input at ``slot`` (a positional index or a keyword)."""

    module: nn.Module
    slot: int | str
    calls: list[tuple[tuple, dict]]

    def inputs(self) -> list[torch.Tensor]:
        return [args[self.slot] if isinstance(self.slot, int) else kw[self.slot] for args, kw in self.calls]

    def run_each(self, xs: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """The module's output (flat, fp32) for each recorded call, with ``xs`` at the slot."""
        for (args, kw), x in zip(self.calls, xs):
            if isinstance(self.slot, int):
                args = args[: self.slot] + (x,) + args[self.slot + 1 :]
            else:
                kw = {**kw, self.slot: x}
            out = self.module(*args, **kw)
            yield (out[0] if isinstance(out, tuple) else out).float().reshape(-1)


def _stateful(value: Any) -> bool:
    """A key-value cache (calling the module again would append to it)."""
    return value is not None and "cache" in type(value).__name__.lower()


def capture_parents(block, inputs, kwargs, pairs, seqs: list[int]) -> list[ParentCalls | None]:
    """For each pair, the calls of the module holding its Linears (the attention for q/k/v,
    the MLP for gate/up) on the calibration sequences ``seqs``, when that module receives the
    Linears' input as one of its arguments and holds no cache; else None (the search then
    measures the Linears' own outputs, as for up -> down). With no sequences (a process that
    holds none of the chosen ones), every pair with such a module gets it with no calls."""
    names = [parent_name(p.linear_names) for p in pairs]
    parents = {n: block.get_submodule(n) for n in set(names) if n}
    if not seqs:
        return [ParentCalls(parents[n], 0, []) if n else None for n in names]
    calls: dict[str, list] = {n: [] for n in parents}
    lin_in: list[list[torch.Tensor]] = [[] for _ in pairs]
    seq_no = 0

    def keep_first(store: list, item) -> None:  # one record per sequence: its first call
        if len(store) == seq_no:
            store.append(item)

    handles = [m.register_forward_pre_hook(lambda _m, a, kw, n=n: keep_first(calls[n], (a, kw)), with_kwargs=True)
               for n, m in parents.items()]
    handles += [p.linears[0].register_forward_pre_hook(lambda _m, a, i=i: keep_first(lin_in[i], a[0]))
                for i, p in enumerate(pairs)]
    try:
        with torch.no_grad():
            for seq_no, j in enumerate(seqs):
                block(inputs[j : j + 1], **kwargs)
    finally:
        for h in handles:
            h.remove()
    found: list[ParentCalls | None] = []
    for n, xs in zip(names, lin_in):
        rec = calls.get(n, [])
        if not n or len(rec) != len(seqs) or len(xs) != len(seqs):
            found.append(None)
            continue
        args0, kw0 = rec[0]
        slots = [j for j, v in enumerate(args0) if v is xs[0]] + [k for k, v in kw0.items() if v is xs[0]]
        if len(slots) != 1 or any(_stateful(v) for v in (*args0, *kw0.values())):
            found.append(None)
            continue
        pc = ParentCalls(parents[n], slots[0], rec)
        # the slot must hold the Linears' input in every recorded call
        found.append(pc if all(x is y for x, y in zip(pc.inputs(), xs)) else None)
    return found


class PairObjective:
    """loss(s) for one pair: MSE of the consuming module's output (the Linears' outputs when
    there is none) with ``Q(W*s)/s`` weights, against the float output. ``in_scale``: the
    pair's folded scale, when its Linears already hold ``W*s`` (the recorded inputs are then
    divided by it, so the float output is unchanged). ``precision``: a factory of the context
    that each evaluation runs in (``precision.forward_precision``). ``reducer``: the calls or tokens are
    this process's share; the squared errors and their count are summed over every process."""

    def __init__(self, pair: ResolvedPair, planned: dict[str, QuantScheme], x: torch.Tensor | None,
                 parent: ParentCalls | None, in_scale: torch.Tensor | None = None,
                 precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 reducer: Reducer | None = None):
        self.pair, self.planned, self.x, self.parent, self.precision = pair, planned, x, parent, precision
        self.reducer = reducer or Reducer()
        self.parent_inputs = parent.inputs() if parent is not None else None
        if in_scale is not None and self.parent_inputs is not None:
            self.parent_inputs = [x / in_scale.to(x) for x in self.parent_inputs]
        self.dense = {n: lin.weight.detach().clone() for n, lin in zip(pair.linear_names, pair.linears)}
        with precision():
            self.ref = list(self._outputs())
        self.count = self.reducer.sum_int(sum(r.numel() for r in self.ref))

    def _outputs(self) -> Iterator[torch.Tensor]:
        """The output in parts (one per calibration sequence for a parent module)."""
        if self.parent is not None:
            yield from self.parent.run_each(self.parent_inputs)
            return
        for x in self.x.split(PART_TOKENS):
            yield torch.cat([lin(x.to(lin.weight.dtype)).float() for lin in self.pair.linears], -1)

    @torch.no_grad()
    def error(self, weights: dict[str, torch.Tensor], bound: float = float("inf")) -> float:
        """Output MSE with ``weights`` (by Linear name; the others stay float). Stops after the
        part where the squared error's running sum passes ``bound`` (returning a value above
        it): the remaining parts can only add to it. Not across processes (``reducer``): each
        evaluates all its parts, since only the sum over every process is known."""
        limit = bound * self.count if not self.reducer.active else float("inf")
        try:
            for name, lin in zip(self.pair.linear_names, self.pair.linears):
                if name in weights:
                    lin.weight.copy_(weights[name].to(lin.weight.dtype))
            total = 0.0
            with self.precision():
                for out, ref in zip(self._outputs(), self.ref):
                    total += float((out - ref).pow(2).sum())
                    if total > limit:
                        break
            return self.reducer.sum_float(total) / self.count
        finally:
            for name, lin in zip(self.pair.linear_names, self.pair.linears):
                lin.weight.copy_(self.dense[name])

    def __call__(self, s: torch.Tensor, bound: float = float("inf")) -> float:
        return self.error({n: fake_quantize(self.dense[n].float() * s[None, :], scheme) / s[None, :]
                           for n, scheme in self.planned.items()}, bound)


def keep_helpful_clips(pair: ResolvedPair, rel: dict[str, QuantScheme], x: torch.Tensor | None,
                        parent: ParentCalls | None, scale: torch.Tensor | None,
                        found: dict[str, torch.Tensor],
                        precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                        reducer: Reducer | None = None,
                        ) -> dict[str, tuple[torch.Tensor | None, float]]:
    """Keep a Linear's clip values only where they lower the pair's objective (the consuming
    module's output on whole calibration sequences, or the Linears' outputs on the search
    sample): the clip search minimises each group's partial output error on a smaller sample,
    which on some models (Qwen2.5 at 4 bits) raised perplexity. Greedy, in the pair's order.
    Returns {name: (clip or None, error without / error with)}. ``reducer``: as for
    ``PairObjective``."""
    planned = {n: rel[n] for n in pair.linear_names if n in rel}
    objective = PairObjective(pair, planned, x, parent, in_scale=scale, precision=precision, reducer=reducer)
    weights = {n: fake_quantize(objective.dense[n].float(), sc) for n, sc in planned.items()}
    best = objective.error(weights)
    kept = {}
    for n in pair.linear_names:
        if n not in found:
            continue
        trial = {**weights, n: fake_quantize(apply_clip(objective.dense[n], found[n], planned[n]), planned[n])}
        err = objective.error(trial)
        gain = best / err if err > 0 else float("inf")
        if err < best:
            weights, best, kept[n] = trial, err, (found[n], gain)
        else:
            kept[n] = (None, gain)
    return kept


@contextlib.contextmanager
def fake_quantized(block: nn.Module, rel: dict[str, QuantScheme]) -> Iterator[Callable[[dict], None]]:
    """Within: ``use(clips)`` writes every planned Linear (by relative name) fake-quantized
    into ``block``, clamped first where ``clips`` has its clip values; on exit the float
    weights are back."""
    mods = {r: block.get_submodule(r) for r in rel}
    dense = {r: m.weight.detach().clone() for r, m in mods.items()}

    def use(clips: dict[str, torch.Tensor]) -> None:
        for r, m in mods.items():
            w = apply_clip(dense[r], clips[r], rel[r]) if r in clips else dense[r].float()
            m.weight.copy_(fake_quantize(w, rel[r]).to(m.weight.dtype))

    try:
        yield use
    finally:
        with torch.no_grad():
            for r, m in mods.items():
                m.weight.copy_(dense[r])


@torch.no_grad()
def block_errors(block: nn.Module, rel: dict[str, QuantScheme], clips: dict[str, torch.Tensor],
                  inputs: torch.Tensor, kwargs: dict[str, Any], reducer: Reducer | None = None) -> tuple[float, float]:
    """The block's output MSE on ``inputs`` with every planned Linear fake-quantized, without
    and with ``clips`` (by relative name), against its float output. ``reducer``: ``inputs``
    are this process's share (possibly none) of the sequences; the MSE is over every process's."""
    reducer = reducer or Reducer()
    ref = block_forward(block, inputs, kwargs)
    errors = []
    with fake_quantized(block, rel) as use:
        for chosen in ({}, clips):
            use(chosen)
            mse = (block_forward(block, inputs, kwargs) - ref).float().pow(2).mean()
            errors.append(float(reducer.mean(mse, ref.numel())[0]))
    return errors[0], errors[1]




def held_out(total: int, used: set[int], k: int) -> list[int]:
    """Up to ``k`` of the ``total`` calibration sequences, evenly spread, avoiding ``used``
    (all of them when every sequence is used)."""
    held = [j for j in range(total) if j not in used] or list(range(total))
    return [held[round(i)] for i in torch.linspace(0, len(held) - 1, min(len(held), k)).tolist()]


def spread(x: torch.Tensor, t: int, part: Share | None = None) -> torch.Tensor:
    """At most ``t`` rows of ``x`` [T, K], evenly spaced (the sample spans every sequence).
    ``part``: ``x`` is this process's part of a sample held by every process
    (``InputStats.sample_part``); the rows are spread over the whole sample and this process's
    of them returned."""
    total = x.shape[0] if part is None else part.total
    if total <= t:
        return x
    idx = torch.linspace(0, total - 1, t, device=x.device).round().long()
    if part is not None:
        idx = idx[(idx >= part.offset) & (idx < part.offset + part.size)] - part.offset
    return x[idx]

