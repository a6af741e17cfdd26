"""Per-channel smoothing scales: exact folding, and the activation statistics that choose them.

AWQ (Lin et al. 2023, arXiv 2306.00978) and SmoothQuant (Xiao et al. 2022, arXiv 2211.10438)
both rewrite ``y = W x`` as ``y = (W diag(s)) (diag(s)^-1 x)``: for each smoothing pair of the
ArchSpec (``prev`` -> ``linears``) the output channels of ``prev`` are divided by ``s`` and the
input columns of the balanced Linears are multiplied by ``s``. In exact arithmetic the float
model computes the same function; only the quantization grid sees different numbers.

Folding rules, for ``s`` float [K] (K = the balanced Linears' in_features):

* norm ``prev`` (RMSNorm / LayerNorm, ``y = norm(x) * (offset + weight) [+ bias]``):
  ``weight' = (offset + weight) / s - offset`` (offset 1.0 for Gemma's RMSNorm, else 0),
  ``bias' = bias / s``;
* Linear ``prev`` [P*K, Kin] whose last K output rows feed the balanced Linears (P = 1, or a
  fused Phi-3 ``qkv_proj`` (P = 3: v is the last chunk) / ``gate_up_proj`` (P = 2: up is the
  second half)): those rows and their bias entries are divided by ``s``;
* balanced Linear [N, K]: ``W' = W * s`` (columns); so are a pair's followers (MoE routers),
  whose outputs therefore stay exactly what they were.

The pure tensor functions (``scale_norm``, ``scale_rows``, ``scale_columns``) compute in fp32
and return the parameter's dtype; ``fold_scales`` applies them to a resolved pair in place.
``collect_input_stats`` gathers per-input-channel max |x| and mean |x| (and optionally a
token sample) of Linears with forward hooks on the calibration engine's block forward, over
every process's calibration samples under data-parallel calibration (``distributed.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .arch import ArchSpec, submodule_or_none
from .block_ops import never_called, run_linear_inputs
from .distributed import Reducer, Share


# ---------------------------------------------------------------------------------------------
# Pure folding functions


def scale_norm(weight: torch.Tensor, s: torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """Norm weight [K] whose output is divided by ``s`` [K]: ``(offset + w) / s - offset``."""
    w = weight.detach().to(torch.float32)
    return ((offset + w) / s.to(w) - offset).to(weight.dtype)


def scale_rows(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[P*K, Kin] (or bias [P*K]) with its last K rows divided by ``s`` [K]."""
    w = weight.detach().to(torch.float32).clone()
    k = s.numel()
    w[-k:] = w[-k:] / (s.to(w).unsqueeze(1) if w.dim() == 2 else s.to(w))
    return w.to(weight.dtype)


def scale_columns(weight: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[N, K] weight with column k multiplied by ``s[k]``."""
    w = weight.detach().to(torch.float32)
    return (w * s.to(w).unsqueeze(0)).to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Pairs of one block


@dataclass(frozen=True)
class ResolvedPair:
    """One smoothing pair of a concrete block (names block-relative)."""

    prev_name: str
    prev: nn.Module
    linear_names: tuple[str, ...]
    linears: tuple[nn.Linear, ...]
    norm_offset: float = 0.0
    followers: tuple[nn.Module, ...] = ()  # read prev's output, not quantized (MoE routers)

    @property
    def channels(self) -> int:
        return self.linears[0].in_features

    @property
    def prev_is_linear(self) -> bool:
        return isinstance(self.prev, nn.Linear)


def resolve_pairs(block: nn.Module, arch: ArchSpec) -> tuple[list[ResolvedPair], list[str]]:
    """The ArchSpec's smoothing pairs that fit this block, and why the others were skipped.

    A pair is skipped when a module is missing, the balanced Linears differ in in_features,
    a norm's weight is not [K], or a Linear ``prev`` does not have ``prev_parts * K`` output
    rows (grouped-query attention: v_proj is narrower than o_proj's input).
    """
    pairs, skipped = [], []
    for p in arch.pairs_in(block):
        prev = submodule_or_none(block, p.prev)
        linears = [submodule_or_none(block, n) for n in p.linears]
        followers = [submodule_or_none(block, n) for n in p.followers]
        why = None
        if prev is None or any(not isinstance(m, nn.Linear) for m in linears):
            why = "module missing"
        elif any(not _has_columns(f, linears[0].in_features) for f in followers if f is not None):
            why = "a follower has no weight [*, K]"
        elif len({m.in_features for m in linears}) != 1:
            why = "balanced Linears differ in in_features"
        else:
            k = linears[0].in_features
            if isinstance(prev, nn.Linear):
                if prev.out_features != p.prev_parts * k:
                    why = f"{p.prev} has {prev.out_features} outputs, not {p.prev_parts} x {k}"
            else:
                w = getattr(prev, "weight", None)
                if not isinstance(w, torch.Tensor) or w.shape != (k,):
                    why = f"{p.prev} has no weight of shape [{k}]"
        if why is not None:
            skipped.append(f"{p.prev} -> {','.join(p.linears)}: {why}")
            continue
        offset = 0.0 if isinstance(prev, nn.Linear) else arch.norm_offset
        pairs.append(ResolvedPair(p.prev, prev, tuple(p.linears), tuple(linears), offset,
                                  tuple(f for f in followers if f is not None)))
    return pairs, skipped


def _has_columns(mod: nn.Module, k: int) -> bool:
    w = getattr(mod, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[1] == k


@torch.no_grad()
def fold_scales(pair: ResolvedPair, s: torch.Tensor) -> None:
    """Fold ``s`` [K] (positive) into ``pair`` in place: prev's outputs / s, inputs * s."""
    prev = pair.prev
    s = s.detach().to(torch.float32)
    if pair.prev_is_linear:
        prev.weight.copy_(scale_rows(prev.weight, s.to(prev.weight.device)))
        if prev.bias is not None:
            prev.bias.copy_(scale_rows(prev.bias, s.to(prev.bias.device)))
    else:
        prev.weight.copy_(scale_norm(prev.weight, s.to(prev.weight.device), pair.norm_offset))
        bias = getattr(prev, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(scale_rows(bias, s.to(bias.device)))
    for lin in (*pair.linears, *pair.followers):
        lin.weight.copy_(scale_columns(lin.weight, s.to(lin.weight.device)))


# ---------------------------------------------------------------------------------------------
# Activation statistics


@dataclass
class InputStats:
    """Per-input-channel statistics of one Linear over the calibration tokens.

    absmax, absmean: fp32 [K]. sample: fp32 [T, K] tokens kept for searches (T <= the
    requested number; evenly spaced within each calibration sample), or None. sample_part:
    where this process's sample lies in the sample of every process (data-parallel
    calibration; one process: the whole), None without a sample.
    """

    absmax: torch.Tensor
    absmean: torch.Tensor
    sample: torch.Tensor | None
    tokens: int
    sample_part: Share | None = None


def collect_input_stats(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    modules: dict[str, nn.Module],
    sample_tokens: int = 0,
    reducer: Reducer | None = None,
) -> dict[str, InputStats]:
    """max |x|, mean |x| per input channel (and a token sample) of each module in ``modules``.

    inputs: the block's calibration inputs [n, L, H]. ``sample_tokens``: how many tokens of
    each module's input to keep (``ceil(sample_tokens / n)`` per sample), 0 for none.
    ``reducer``: ``inputs`` are this process's share of the samples (``distributed.py``); the
    statistics are over every process's (max, sum and count reduced; n the number of all
    samples), and the processes' samples, in rank order, are the one process's sample.
    """
    reducer = reducer or Reducer()
    n = reducer.sum_int(inputs.shape[0])
    per_sample = math.ceil(sample_tokens / n) if sample_tokens > 0 else 0
    acc: dict[str, dict] = {name: {"max": None, "sum": None, "count": 0, "rows": []} for name in modules}

    def add(name: str, x: torch.Tensor) -> None:
        a = acc[name]
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        ax = x.abs()
        m, s = ax.amax(dim=0), ax.sum(dim=0)
        a["max"] = m if a["max"] is None else torch.maximum(a["max"], m)
        a["sum"] = s if a["sum"] is None else a["sum"] + s
        a["count"] += x.shape[0]
        if per_sample:
            idx = torch.linspace(0, x.shape[0] - 1, min(per_sample, x.shape[0]), device=x.device)
            a["rows"].append(x[idx.round().long()].clone())

    run_linear_inputs(block, block_name, inputs, kwargs, modules, add)
    missing = [name for name, a in acc.items() if a["max"] is None]
    if missing:
        raise never_called(missing[0], "AWQ")
    out = {}
    for name, a in acc.items():
        sample, part = _cut_sample(torch.cat(a["rows"], dim=0) if a["rows"] else None, sample_tokens, reducer)
        count = reducer.sum_int(a["count"])
        out[name] = InputStats(reducer.max(a["max"]), reducer.sum(a["sum"]) / max(count, 1), sample, count, part)
    return out


def _cut_sample(rows: torch.Tensor | None, limit: int, reducer: Reducer) -> tuple[torch.Tensor | None, Share | None]:
    """This process's rows of the first ``limit`` rows of every process's ``rows`` (in rank
    order), and where they lie among them; (None, None) without a sample (``limit`` 0)."""
    if limit <= 0:
        return None, None
    count = rows.shape[0] if rows is not None else 0
    part = reducer.share(count)
    keep = max(0, min(count, limit - part.offset))
    return (rows[:keep] if rows is not None else None), Share(min(part.offset, limit), keep, min(part.total, limit))


def pair_stats(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    pairs: list[ResolvedPair],
    sample_tokens: int = 0,
) -> list[InputStats]:
    """``collect_input_stats`` of each pair's shared input (read at its first Linear)."""
    modules = {f"{block_name}.{p.linear_names[0]}": p.linears[0] for p in pairs}
    stats = collect_input_stats(block, block_name, inputs, kwargs, modules, sample_tokens)
    return [stats[f"{block_name}.{p.linear_names[0]}"] for p in pairs]
