"""AWQ: activation-aware weight quantization (Lin et al. 2023, arXiv 2306.00978).

For each smoothing pair of a block (``prev`` -> balanced Linears, see ``smoothing.py``):

1. ``x_mean`` [K]: mean |x| per input channel of the balanced Linears over the calibration
   tokens.
2. Grid search over the exponent ``alpha`` (``search_scale``): candidates ``s = 1`` (plain
   RTN), the paper's ``s = x_mean^alpha`` for ``alpha = i / grid``, and the "duo" scales of
   AutoAWQ and llm-compressor ``s = x_mean^alpha / w_mean^(1-alpha)`` for ``grid`` exponents
   evenly spaced over [0, 1], where ``w_mean`` [K] is the mean of |w| / (its group's max |w|)
   over the balanced Linears' rows (``awq.duo_scaling``: "both" (default) searches both
   families, True the duo ones only, False the paper's only). Each ``s``
   is normalised by ``sqrt(max(s) * min(s))``; the balanced Linears' weights become
   ``Q(W * s) / s`` (Q = RTN fake quantization with the scheme) and the loss is the MSE of the
   *consuming module's output* against the float one: the module that holds the Linears (the
   attention for q/k/v, the MLP for gate/up), replayed with its recorded arguments on whole
   calibration sequences (``search_tokens`` worth), when it receives their input as one
   argument; else the Linears' concatenated outputs on a token sample (v -> o, up -> down).
   RTN is a candidate, so the chosen scales never do worse than RTN on the sample.
3. Fold the best ``s`` (exactly, ``smoothing.fold_scales``).
4. Optional clipping search (the paper's auto_clip; by default only at 3 bits and below,
   ``clip_wanted``): per output row and group, the max |w|
   shrinks by ``1 - i/20`` for i < 10; pick the one minimising the group's output error
   ``||x_g w_g^T - x_g Q(clip(w_g))^T||^2`` on a token sample, and clip the group only where
   that lowers its error by more than ``awq.clip_min_gain`` (30% by default; marginal clips
   fitted to a 512-token sample did not carry over to other text: see ``AWQOptions``). Skipped for Linears whose outputs
   feed attention scores (q/k, fused qkv), as in the reference implementation. A Linear's clip
   values are kept only where they lower its pair's step-2 objective (the consuming module's
   output on whole sequences; ``_keep_helpful_clips``), else it is quantized unclipped; then a
   block's kept clips are dropped together unless they lower the whole block's output error on
   held-out calibration sequences (``clip_check_seqs``, ``_block_errors``). Last, on the whole
   model (``clip_model_check``): those held-out sequences run through every block twice more,
   quantized with and without the kept clips; after the last block the variant whose
   next-token distribution is closer (KL) to the float model's is kept, model-wide (the
   calibration engine's ``alternative`` / ``prefer_alternative``): block-local errors do not
   add up to the model's (per-block choices by whole-model loss were noise-level on
   SmolLM2-135M W3 g64, benchmarks/results/awq-clip-study-smollm2-w3g64.jsonl). It judges on
   the calibration text only: on Qwen2.5-Coder-0.5B W3 g128, before ``clip_min_gain``, it kept
   clips (held-out C4 KL 0.509 with, 0.659 without) that raised wikitext2 perplexity (77.84 vs
   74.34 without); with the 30% least gain it keeps clips that lower it (69.36).
5. RTN of the (scaled, clipped) weights -> QuantResult.

Pure tensor functions: ``scale_from_alpha``, ``fake_quantize``, ``clip_error_curve``,
``pick_clip``, ``search_clip``,
``apply_clip``, ``awq_quantize``. The block glue is ``AWQMethod`` (a calibration-engine
BlockMethod); ``awq_gptq_from_recipe`` chains AWQ scaling with GPTQ.

Scales file (``save_scales`` / ``load_scales``): safetensors; tensors
``<block>.<prev>.scales`` fp32 [K] and ``<block>.<linear>.clip`` fp32 [N, G]; metadata
``quantspec_awq`` = JSON ``{"version", "recipe": {...}, "blocks": {block: sha256 of every byte
of the float block's parameters (``digest.module_digest``)}}``. Loading checks both
fingerprints and skips the search.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .calibrate import block_forward, check_finite
from .digest import module_digest
from .recipe import AWQOptions, Recipe
from .rtn import dequantize_codes, qparams, quantize_codes, rtn
from .scheme import QuantResult, QuantScheme
from .smoothing import ResolvedPair, collect_input_stats, fold_scales, resolve_pairs

# Linears whose outputs feed attention scores: the output MSE of a clip search means little there.
# (o_proj stays clipped: on Qwen2.5-Coder-0.5B's first 4 blocks at W4 g128 its clips alone raised
# perplexity, 51.05 -> 51.71, but skipping it on whole models at W3 did worse: Qwen2.5-Coder-0.5B
# g128 85.98 vs 77.84, SmolLM2-135M g64 68.04 vs 64.94; the skip runs searched in bf16.)
CLIP_SKIP = ("q_proj", "k_proj", "qkv_proj")
# Clipping by default only up to this many bits (0: never). Measured with 64 C4 x 512 and
# wikitext2: Qwen2.5-Coder-0.5B first 4 blocks, 20 windows: W4 g128 51.09 without, 52.30 with
# (RTN 51.55); whole model, 40 windows, W3 g128: 77.561 without, 80.253 with (2048-token search).
# SmolLM2-135M W3 g64 (8192-token search, 40 windows): 74.476 without, 64.939 with. So on at 3
# bits and below, where it can matter most, and a recipe can turn it off (awq.clip: false).
CLIP_AUTO_MAX_BITS = 3
# tokens per part of a Linear-output objective: a candidate scale's error is summed part by part
# and the search drops it once the sum passes the best candidate's (search_scale's ``bounded``)
PART_TOKENS = 512
SCALES_VERSION = 2  # 2: block fingerprints over every byte (1 sampled rows)


# ---------------------------------------------------------------------------------------------
# Pure tensor functions


def scale_from_alpha(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    """AWQ's candidate scale for exponent ``alpha``: [K] -> [K], geometric mean of max/min 1.

    ``x_mean^alpha``; with ``w_mean`` (``weight_group_mean``, "duo scaling" as AutoAWQ and
    llm-compressor do by default) ``x_mean^alpha / w_mean^(1 - alpha)``: channels whose weights
    are small within their groups get larger scales too.
    """
    s = x_mean.to(torch.float32).pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.to(torch.float32).pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_group_mean(weights: list[torch.Tensor], scheme: QuantScheme) -> torch.Tensor:
    """Mean over the output rows of ``weights`` ([N_i, K] each) of |w| / (max |w| of its
    quantization group): [K], how large each input channel's weights are on their grids."""
    total, rows = None, 0
    for w in weights:
        k = w.shape[1]
        g = _grouped(w.detach(), scheme).abs()
        g = g / (g.amax(dim=2, keepdim=True) + 1e-6)
        part = g.reshape(w.shape[0], -1)[:, :k].sum(dim=0)
        total = part if total is None else total + part
        rows += w.shape[0]
    return total / rows


def _grouped(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """fp32 [N, K] -> [N, G, L] (L = group length), a partial last group padded with zeros.

    Zero padding changes no group's grid: ``qparams`` takes min over values <= 0 and max over
    values >= 0, and a zero column adds nothing to any output.
    """
    n, k = weight.shape
    glen = scheme.group_len(k)
    g = scheme.num_groups(k)
    w = weight.to(torch.float32)
    if g * glen != k:
        w = torch.nn.functional.pad(w, (0, g * glen - k))
    return w.reshape(n, g, glen)


def _fake_quantize_rows(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Quantize-dequantize each row of [R, L] on its own min/max grid (fp32)."""
    s, z = qparams(w, scheme)
    return dequantize_codes(quantize_codes(w, s, z, scheme), s, z, scheme)


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN quantize-dequantize of [N, K] (fp32 out), equal to ``rtn(w).dequantize()``;
    a partial last group is quantized on its own."""
    n, k = weight.shape
    w = _grouped(weight, scheme)
    q = _fake_quantize_rows(w.reshape(-1, w.shape[-1]), scheme).reshape(w.shape)
    return q.reshape(n, -1)[:, :k]


def clip_error_curve(
    weight: torch.Tensor,
    x: torch.Tensor,
    scheme: QuantScheme,
    grid: int = 20,
    max_shrink: float = 0.5,
    row_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, group)'s output error at every clip candidate: (errors [S, N, G], amax [N, G]).

    weight [N, K], x [T, K] sample of its inputs. Candidate ``i < S = max_shrink * grid`` clips
    the group to ``amax * (1 - i/grid)``; error ``mean_t (x_g . (w_g - Q(clip(w_g))))^2`` (fp32;
    G = number of groups, a partial last group included). Step 0 is the unclipped group.
    """
    xg = _grouped(x.detach(), scheme).permute(1, 0, 2)  # [G, T, L]
    steps = max(1, int(max_shrink * grid))
    errs, amaxes = [], []
    for r0 in range(0, weight.shape[0], row_chunk):
        w = _grouped(weight.detach()[r0 : r0 + row_chunk], scheme)  # [n', G, L]
        amax = w.abs().amax(dim=2).clamp(min=1e-8)  # [n', G]
        rows = []
        for i in range(steps):
            m = (amax * (1 - i / grid)).unsqueeze(2)
            wc = torch.maximum(torch.minimum(w, m), -m)
            q = _fake_quantize_rows(wc.reshape(-1, w.shape[2]), scheme).reshape(w.shape)
            rows.append(torch.bmm(xg, (w - q).permute(1, 2, 0)).pow(2).mean(dim=1).T)  # [n', G]
        errs.append(torch.stack(rows))
        amaxes.append(amax)
    return torch.cat(errs, dim=1), torch.cat(amaxes, dim=0)


def pick_clip(errs: torch.Tensor, amax: torch.Tensor, grid: int = 20, min_gain: float = 0.0) -> torch.Tensor:
    """Clip values [N, G] from ``clip_error_curve``'s output: the candidate with the least error
    (the smaller shrink on ties), where it lowers the unclipped error by more than the fraction
    ``min_gain``; elsewhere the full range ``amax``."""
    best, step = errs.min(dim=0)
    factor = torch.tensor([1 - i / grid for i in range(errs.shape[0])], dtype=amax.dtype, device=amax.device)
    return torch.where(best < (1 - min_gain) * errs[0], amax * factor[step], amax)


def search_clip(weight: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, grid: int = 20,
                min_gain: float = 0.0, **curve: Any) -> torch.Tensor:
    """Per-(row, group) clip value (max |w|) minimising the group's output error on ``x``
    (``clip_error_curve``, which takes ``curve``: max_shrink, row_chunk); a group keeps its full
    range unless the best clip lowers that error by more than the fraction ``min_gain`` (0: any
    improvement). Returns fp32 [N, G]."""
    return pick_clip(*clip_error_curve(weight, x, scheme, grid, **curve), grid=grid, min_gain=min_gain)


def apply_clip(weight: torch.Tensor, clip: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[N, K] weight clamped to ``[-clip[n, g], clip[n, g]]`` per group (fp32 out)."""
    n, k = weight.shape
    w = _grouped(weight.detach(), scheme)
    m = clip.to(w).unsqueeze(2)
    return torch.maximum(torch.minimum(w, m), -m).reshape(n, -1)[:, :k].contiguous()


def clip_wanted(option: bool | None, scheme: QuantScheme) -> bool:
    """Whether to search clip values: the recipe's ``awq.clip``, or when None by bit width."""
    return option if option is not None else scheme.bits <= CLIP_AUTO_MAX_BITS


def awq_quantize(
    weight: torch.Tensor,
    scheme: QuantScheme,
    clip: torch.Tensor | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> QuantResult:
    """RTN of an AWQ-scaled weight [N, K], clamped first by ``clip`` [N, G] when given."""
    w = weight if clip is None else apply_clip(weight, clip, scheme)
    return rtn(w.to(torch.float32), scheme, scale_dtype)


def _coarse_to_fine(n: int) -> list[int]:
    """0 first (the identity, evaluated in full), then 1..n-1 halving the stride: the middle,
    the quarters, ... so that spread-out candidates come before their neighbours."""
    order, seen = [0], {0}
    stride = 1 << max(n - 1, 1).bit_length()
    while stride >= 1:
        for i in range(1 + stride // 2 if stride > 1 else 1, n, stride):
            if i not in seen:
                order.append(i)
                seen.add(i)
        stride //= 2
    return order + [i for i in range(n) if i not in seen]


def search_scale(
    x_mean: torch.Tensor,
    loss: Callable[[torch.Tensor], float],
    grid: int = 20,
    w_mean: torch.Tensor | None = None,
    plain: bool = True,
    bounded: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Best candidate scale under ``loss(s)``; returns (s, info).

    ``bounded``: ``loss(s, bound)`` gets the best loss so far and may stop early, returning any
    value above ``bound``, once its result is known to exceed it (a sum of non-negative terms
    already past the bound): the same choice as the full search, in less time.

    Candidates: all ones (plain RTN) first; with ``plain``, the paper's
    ``scale_from_alpha(x_mean, i / grid)`` for 0 < i < grid; with ``w_mean`` (duo scaling),
    ``scale_from_alpha(x_mean, a, w_mean)`` for ``grid`` exponents ``a`` evenly spaced over
    [0, 1]. ``info``: the chosen ``alpha`` (None for the identity), whether it is a ``duo``
    scale, its loss and the identity's (``loss_rtn``).
    """
    ones = torch.ones_like(x_mean, dtype=torch.float32)
    cands: list[tuple[float | None, bool, torch.Tensor]] = [(None, False, ones)]
    if plain:
        cands += [(i / grid, False, scale_from_alpha(x_mean, i / grid)) for i in range(1, grid)]
    if w_mean is not None:
        steps = max(grid - 1, 1)
        cands += [(i / steps, True, scale_from_alpha(x_mean, i / steps, w_mean)) for i in range(grid)]
    if bounded:  # coarse to fine, so that a good bound is found early; the choice is the same
        losses, best = [float("nan")] * len(cands), float("inf")
        for i in _coarse_to_fine(len(cands)):
            losses[i] = loss(cands[i][2], best)
            if losses[i] < best:  # False for NaN
                best = losses[i]
    else:
        losses = [loss(s) for *_, s in cands]
    finite = [i for i, v in enumerate(losses) if v == v]  # NaN != NaN
    if not finite:  # every loss was NaN: keep the identity
        return ones, {"alpha": None, "duo": False, "loss": float("nan"), "loss_rtn": float("nan")}
    best = min(finite, key=lambda i: losses[i])
    alpha, duo, s = cands[best]
    return s, {"alpha": alpha, "duo": duo, "loss": losses[best], "loss_rtn": losses[0]}


# ---------------------------------------------------------------------------------------------
# Block glue


@dataclass(frozen=True)
class AWQSettings:
    """AWQ's options plus the CPU-friendly sample sizes of the searches (tokens)."""

    awq: AWQOptions = AWQOptions()
    # tokens each candidate scale is scored on. Qwen2.5-Coder-0.5B W3 g128 (no clip, wikitext2
    # 40 windows): 77.530 at 2048, 74.335 at 8192 (llm-compressor, which scores on all 32768:
    # 74.173); first 4 blocks: 56.9 at 2048, 54.32 at 8192
    search_tokens: int = 8192
    clip_tokens: int = 512
    clip_skip: tuple[str, ...] = CLIP_SKIP  # Linear names (suffixes) never clipped
    quantize: bool = True  # False: scale (and clip search) only, e.g. before GPTQ
    # inputs of the next block: the output of this block with its "float" weights (scaled,
    # unquantized, as AutoAWQ and llm-compressor do) or with its "quantized" weights
    propagate: str = "float"
    # keep a block's clips only if, together, they lower the whole block's output error on
    # calibration sequences held out from the searches (up to this many; 0: no block check).
    # W3, bf16 search, 40 windows: SmolLM2-135M g64 64.409 with the check, 64.939 without (fp32
    # search); Qwen2.5-Coder-0.5B g128 76.997 with, 77.698 without (no clipping: 74.335)
    clip_check_seqs: int = 8
    # then keep the kept clips only if, on the whole model, they bring the next-token
    # distribution on those held-out sequences closer to the float model's than no clipping
    # (W3, 40 wikitext2 windows: kept them on SmolLM2-135M g64 and Qwen2.5-Coder-0.5B g128)
    clip_model_check: bool = True

    def __post_init__(self) -> None:
        if self.propagate not in ("float", "quantized"):
            raise QuantspecError(f"AWQ propagate={self.propagate!r} is not float or quantized.",
                                 "use float (the default) or quantized.")
        if self.clip_check_seqs < 0:
            raise QuantspecError(f"AWQ clip_check_seqs={self.clip_check_seqs} is negative.",
                                 "use 0 (no block check) or a number of sequences, e.g. 8.")


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bf16 matrices in hardware (CPU: AMX tiles; CUDA: bf16)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return device.type == "cpu" and is_amx is not None and bool(is_amx())


def search_precision(block: nn.Module, choice: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of contexts for a search's forward passes over ``block``: bf16 autocast for an
    fp32 block when ``choice`` is bfloat16, or auto on a device with native bf16 products; else
    no change. Enter a fresh one per evaluation: autocast caches each weight's bf16 copy until
    its outermost context exits, and the searches write every candidate into the same weights."""
    param = next(block.parameters())
    if param.dtype == torch.float32 and (choice == "bfloat16" or (choice == "auto" and native_bf16(param.device))):
        return functools.partial(torch.autocast, param.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def _parent_name(linear_names: tuple[str, ...]) -> str:
    """The deepest module that holds every Linear of a pair ('' for the block itself)."""
    parts = [n.split(".")[:-1] for n in linear_names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


@dataclass
class _ParentCalls:
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


def _capture_parents(block, inputs, kwargs, pairs, seqs: list[int]) -> list[_ParentCalls | None]:
    """For each pair, the calls of the module holding its Linears (the attention for q/k/v,
    the MLP for gate/up) on the calibration sequences ``seqs``, when that module receives the
    Linears' input as one of its arguments and holds no cache; else None (the search then
    measures the Linears' own outputs, as for up -> down)."""
    names = [_parent_name(p.linear_names) for p in pairs]
    parents = {n: block.get_submodule(n) for n in set(names) if n}
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
    found: list[_ParentCalls | None] = []
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
        pc = _ParentCalls(parents[n], slots[0], rec)
        # the slot must hold the Linears' input in every recorded call
        found.append(pc if all(x is y for x, y in zip(pc.inputs(), xs)) else None)
    return found


class _PairObjective:
    """loss(s) for one pair: MSE of the consuming module's output (the Linears' outputs when
    there is none) with ``Q(W*s)/s`` weights, against the float output. ``in_scale``: the
    pair's folded scale, when its Linears already hold ``W*s`` (the recorded inputs are then
    divided by it, so the float output is unchanged). ``precision``: a factory of the context
    that each evaluation runs in (``search_precision``)."""

    def __init__(self, pair: ResolvedPair, planned: dict[str, QuantScheme], x: torch.Tensor | None,
                 parent: _ParentCalls | None, in_scale: torch.Tensor | None = None,
                 precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.pair, self.planned, self.x, self.parent, self.precision = pair, planned, x, parent, precision
        self.parent_inputs = parent.inputs() if parent is not None else None
        if in_scale is not None and self.parent_inputs is not None:
            self.parent_inputs = [x / in_scale.to(x) for x in self.parent_inputs]
        self.dense = {n: lin.weight.detach().clone() for n, lin in zip(pair.linear_names, pair.linears)}
        with precision():
            self.ref = list(self._outputs())
        self.count = sum(r.numel() for r in self.ref)

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
        it): the remaining parts can only add to it."""
        limit = bound * self.count
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
            return total / self.count
        finally:
            for name, lin in zip(self.pair.linear_names, self.pair.linears):
                lin.weight.copy_(self.dense[name])

    def __call__(self, s: torch.Tensor, bound: float = float("inf")) -> float:
        return self.error({n: fake_quantize(self.dense[n].float() * s[None, :], scheme) / s[None, :]
                           for n, scheme in self.planned.items()}, bound)


def _keep_helpful_clips(pair: ResolvedPair, rel: dict[str, QuantScheme], x: torch.Tensor | None,
                        parent: _ParentCalls | None, scale: torch.Tensor | None,
                        found: dict[str, torch.Tensor],
                        precision: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                        ) -> dict[str, tuple[torch.Tensor | None, float]]:
    """Keep a Linear's clip values only where they lower the pair's objective (the consuming
    module's output on whole calibration sequences, or the Linears' outputs on the search
    sample): the clip search minimises each group's partial output error on a smaller sample,
    which on some models (Qwen2.5 at 4 bits) raised perplexity. Greedy, in the pair's order.
    Returns {name: (clip or None, error without / error with)}."""
    planned = {n: rel[n] for n in pair.linear_names if n in rel}
    objective = _PairObjective(pair, planned, x, parent, in_scale=scale, precision=precision)
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
def _fake_quantized(block: nn.Module, rel: dict[str, QuantScheme]) -> Iterator[Callable[[dict], None]]:
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
def _block_errors(block: nn.Module, rel: dict[str, QuantScheme], clips: dict[str, torch.Tensor],
                  inputs: torch.Tensor, kwargs: dict[str, Any]) -> tuple[float, float]:
    """The block's output MSE on ``inputs`` with every planned Linear fake-quantized, without
    and with ``clips`` (by relative name), against its float output."""
    ref = block_forward(block, inputs, kwargs)
    errors = []
    with _fake_quantized(block, rel) as use:
        for chosen in ({}, clips):
            use(chosen)
            errors.append(float((block_forward(block, inputs, kwargs) - ref).float().pow(2).mean()))
    return errors[0], errors[1]


@torch.no_grad()
def mean_kl(logits: Callable[[torch.Tensor], torch.Tensor], ref: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(logits(ref)) || softmax(logits(other))), hidden states
    [n, L, H] each, 256 tokens at a time (the logits of a large vocabulary are big)."""
    total, count = 0.0, 0
    a_all, b_all = ref.reshape(-1, 1, ref.shape[-1]), other.reshape(-1, 1, other.shape[-1])
    for a, b in zip(a_all.split(256), b_all.split(256)):
        lp = torch.log_softmax(logits(a.transpose(0, 1)).float(), dim=-1)
        lq = torch.log_softmax(logits(b.transpose(0, 1)).float(), dim=-1)
        total += float((lp.exp() * (lp - lq)).sum())
        count += a.shape[0]
    return total / max(count, 1)


def _held_out(total: int, used: set[int], k: int) -> list[int]:
    """Up to ``k`` of the ``total`` calibration sequences, evenly spread, avoiding ``used``
    (all of them when every sequence is used)."""
    held = [j for j in range(total) if j not in used] or list(range(total))
    return [held[round(i)] for i in torch.linspace(0, len(held) - 1, min(len(held), k)).tolist()]


def _spread(x: torch.Tensor, t: int) -> torch.Tensor:
    """At most ``t`` rows of ``x`` [T, K], evenly spaced (the sample spans every sequence)."""
    if x.shape[0] <= t:
        return x
    return x[torch.linspace(0, x.shape[0] - 1, t, device=x.device).round().long()]


class AWQMethod:
    """AWQ as a calibration-engine BlockMethod. ``info``: per-layer details of the last block.

    After ``process_block`` the block's smoothing scales are folded (norms and Linears changed
    in place); every planned Linear's ``.weight`` holds its scaled, unclipped float weight, the
    dense weight its QuantResult approximates.
    """

    def __init__(self, settings: AWQSettings | None = None, scale_dtype: torch.dtype = torch.float16,
                 recipe_fingerprint: dict | None = None):
        self.options = settings or AWQSettings()
        self.scale_dtype = scale_dtype
        self.recipe_fingerprint = recipe_fingerprint or {}
        self.info: dict[str, dict] = {}
        self._saved: dict[str, torch.Tensor] = {}
        self._block_fps: dict[str, str] = {}
        self._loaded: tuple[dict[str, torch.Tensor], dict] | None = None
        self.outputs: torch.Tensor | None = None
        # the model-level clip check: held-out sequences through the float, unclipped and
        # clipped quantized blocks so far; the clipped Linears; their unclipped results
        self._streams: dict[str, torch.Tensor] | None = None
        self._streamed_blocks, self._check_seconds = 0, 0.0
        self._clipped: list[str] = []
        self.alternative: dict[str, QuantResult] | None = None
        self.final_info: dict[str, dict] = {}

    # -- scales file ------------------------------------------------------------------------
    def _load_file(self) -> tuple[dict[str, torch.Tensor], dict]:
        if self._loaded is None:
            from safetensors import safe_open

            path = Path(self.options.awq.load_scales)
            if not path.is_file():
                raise QuantspecError(f"AWQ scales file {path} does not exist.", "check --load-scales.")
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("quantspec_awq", "{}"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("version") != SCALES_VERSION:
                raise QuantspecError(
                    f"AWQ scales file {path} was written by another version of quantspec "
                    f"(format {meta.get('version')}, not {SCALES_VERSION}).",
                    "drop --load-scales to search again, and --save-scales to write a new file.",
                )
            if meta.get("recipe") != self.recipe_fingerprint:
                raise QuantspecError(
                    f"AWQ scales file {path} was made with another recipe "
                    f"({meta.get('recipe')}, not {self.recipe_fingerprint}).",
                    "drop --load-scales to search again, or use the recipe it was made with.",
                )
            self._loaded = (tensors, meta)
        return self._loaded

    def _save_file(self) -> None:
        from safetensors.torch import save_file

        path = Path(self.options.awq.save_scales)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"version": SCALES_VERSION, "recipe": self.recipe_fingerprint, "blocks": self._block_fps}
        tmp = path.with_name(path.name + ".tmp")
        save_file({k: v.contiguous() for k, v in self._saved.items()}, str(tmp),
                  {"quantspec_awq": json.dumps(meta)})
        os.replace(tmp, path)

    # -- BlockMethod -------------------------------------------------------------------------
    def process_block(
        self,
        block: nn.Module,
        block_name: str,
        inputs: torch.Tensor,
        kwargs: dict[str, Any],
        plan: dict[str, QuantScheme],
        arch: ArchSpec,
    ) -> dict[str, QuantResult]:
        self.info, self.outputs, self.alternative = {}, None, None
        t0 = time.perf_counter()
        rel = {n[len(block_name) + 1 :]: s for n, s in plan.items()}
        pairs, skipped = resolve_pairs(block, arch)
        pairs = [p for p in pairs if any(n in rel for n in p.linear_names)]
        fp = module_digest(block) if self.options.awq.load_scales or self.options.awq.save_scales else ""
        if self.options.awq.load_scales:
            clips = self._apply_loaded(block_name, fp, pairs)
        else:
            clips = self._search(block, block_name, inputs, kwargs, rel, pairs)
        self._block_fps[block_name] = fp
        if self.options.awq.save_scales:
            self._save_file()
        if not self.options.quantize:
            return {}
        if self.options.propagate == "float":  # folding is exact: the float block's output
            self.outputs = block_forward(block, inputs, kwargs)
            check_finite(self.outputs, block_name, "its output")
        results = {}
        for name, scheme in plan.items():
            mod = block.get_submodule(name[len(block_name) + 1 :])
            results[name] = awq_quantize(mod.weight, scheme, clips.get(name), self.scale_dtype)
            self.info.setdefault(name, {})["clipped"] = name in clips
        if self._checks_model(rel):
            self._advance_streams(block, block_name, inputs, kwargs, rel, clips)
            if clips:
                self._clipped += list(clips)
                self.alternative = {n: awq_quantize(block.get_submodule(n[len(block_name) + 1 :]).weight,
                                                    plan[n], None, self.scale_dtype) for n in clips}
        for name in results:
            self.info[name]["awq_seconds"] = time.perf_counter() - t0
        if skipped:
            for name in results:
                self.info[name]["smoothing_skipped"] = skipped
        return results

    # -- model-level clip check ---------------------------------------------------------------
    def may_offer_alternatives(self, plan: dict[str, QuantScheme]) -> bool:
        """Whether quantizing ``plan`` (names -> schemes) may end with the model-level clip
        check (it needs the model's head at the end)."""
        opts = self.options
        if not (opts.clip_model_check and opts.clip_check_seqs and opts.quantize):
            return False
        if opts.awq.load_scales:
            return any(k.endswith(".clip") for k in self._load_file()[0])
        return any(clip_wanted(opts.awq.clip, sc) and not n.endswith(tuple(opts.clip_skip)) for n, sc in plan.items())

    def _checks_model(self, rel: dict[str, QuantScheme]) -> bool:
        """Whether to run the held-out streams through this block: from the first block on,
        when its Linears may be clipped."""
        return self._streams is not None or self.may_offer_alternatives(rel)

    @torch.no_grad()
    def _advance_streams(self, block, block_name, inputs, kwargs, rel, clips) -> None:
        """Run the held-out sequences through ``block``: float, quantized without clips, and
        quantized with this block's kept clips (each stream from its own inputs)."""
        t0 = time.perf_counter()
        held = _held_out(inputs.shape[0], set(self._search_seqs(inputs)), self.options.clip_check_seqs)
        if self._streams is None:
            self._streams = {k: inputs[held] for k in ("float", "plain", "clipped")}
        precision = search_precision(block, self.options.awq.search_dtype)
        if self.outputs is not None:  # propagate=float: the float stream is the held-out rows
            new = {"float": self.outputs[held]}
        else:
            with precision():
                new = {"float": block_forward(block, self._streams["float"], kwargs)}
        with _fake_quantized(block, rel) as use:
            for tag, chosen in (("plain", {}), ("clipped", {f[len(block_name) + 1 :]: c for f, c in clips.items()})):
                use(chosen)
                with precision():
                    new[tag] = block_forward(block, self._streams[tag], kwargs)
        self._streams = {k: v.to(self._streams[k].dtype) for k, v in new.items()}
        self._streamed_blocks += 1
        self._check_seconds += time.perf_counter() - t0

    @torch.no_grad()
    def prefer_alternative(self, logits: Callable[[torch.Tensor], torch.Tensor], n_blocks: int) -> bool | None:
        """After the last block: True (drop every clip) when the quantized model without clips
        is closer to the float model (mean next-token KL on the held-out sequences) than with
        them; None when the streams did not cover every block (the clips stay)."""
        self.final_info = {}
        if self._streams is None or self._streamed_blocks != n_blocks or not self._clipped:
            return None
        t0, s = time.perf_counter(), self._streams
        kl_clip, kl_plain = mean_kl(logits, s["float"], s["clipped"]), mean_kl(logits, s["float"], s["plain"])
        drop = kl_plain < kl_clip
        seconds = round(self._check_seconds + time.perf_counter() - t0, 3)
        check = {"kl_clipped": kl_clip, "kl_unclipped": kl_plain, "kept": not drop, "seconds": seconds}
        self.final_info = {n: {"clip_model_check": check, "clipped": not drop} for n in self._clipped}
        return drop

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What the model-level check carries between blocks (for resumed runs)."""
        if self._streams is None:
            return {}
        names = torch.frombuffer(bytearray(json.dumps(self._clipped).encode()), dtype=torch.uint8)
        return {**{f"stream.{k}": v for k, v in self._streams.items()},
                "streamed_blocks": torch.tensor([self._streamed_blocks]), "clipped_names": names}

    def load_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        streams = {k[len("stream.") :]: v for k, v in state.items() if k.startswith("stream.")}
        if not streams:
            return
        self._streams = streams
        self._streamed_blocks = int(state["streamed_blocks"][0])
        self._clipped = json.loads(bytes(state["clipped_names"].tolist()).decode())

    def _search_seqs(self, inputs: torch.Tensor) -> list[int]:
        """The calibration sequences the searches run on (``search_tokens`` worth, spread)."""
        n, seqlen = inputs.shape[0], inputs.shape[1]
        n_seq = min(n, max(1, -(-self.options.search_tokens // seqlen)))
        return torch.linspace(0, n - 1, n_seq).round().long().unique().tolist()

    def _apply_loaded(self, block_name, fp, pairs) -> dict[str, torch.Tensor]:
        tensors, meta = self._load_file()
        if meta.get("blocks", {}).get(block_name) != fp:
            raise QuantspecError(
                f"AWQ scales file has no scales for block {block_name} of this model "
                "(its float weights differ from those the scales were searched on).",
                "drop --load-scales to search again, or quantize the model they were made for.",
            )
        for p in pairs:
            key = f"{block_name}.{p.prev_name}.scales"
            if key not in tensors:
                raise QuantspecError(f"AWQ scales file lacks {key}.", "drop --load-scales.")
            s = tensors[key].to(p.linears[0].weight.device)
            fold_scales(p, s)
            self._saved[key] = s.cpu()
        clips = {k[: -len(".clip")]: v for k, v in tensors.items()
                 if k.startswith(block_name + ".") and k.endswith(".clip")}
        self._saved.update({f"{k}.clip": v for k, v in clips.items()})
        return clips

    def _search(self, block, block_name, inputs, kwargs, rel, pairs) -> dict[str, torch.Tensor]:
        opts = self.options
        seqs = self._search_seqs(inputs)
        parents = _capture_parents(block, inputs, kwargs, pairs, seqs)
        modules = {f"{block_name}.{p.linear_names[0]}": p.linears[0] for p in pairs}
        clip_mods = {f"{block_name}.{r}": block.get_submodule(r) for r, scheme in rel.items()
                     if clip_wanted(opts.awq.clip, scheme) and not r.endswith(tuple(opts.clip_skip))}
        tokens = max(opts.search_tokens, opts.clip_tokens if clip_mods else 0)
        stats = collect_input_stats(block, block_name, inputs, kwargs, {**modules, **clip_mods}, tokens)
        # inputs of Linears change with each fold (x -> x / s for the pair's Linears)
        samples = {n: st.sample for n, st in stats.items()}
        scales = []
        precision = search_precision(block, opts.awq.search_dtype)
        for p, parent in zip(pairs, parents):
            key = f"{block_name}.{p.linear_names[0]}"
            x = _spread(samples[key], opts.search_tokens) if parent is None else None
            planned = {n: rel[n] for n in p.linear_names if n in rel}
            objective = _PairObjective(p, planned, x, parent, precision=precision)
            w_mean = None
            if opts.awq.duo_scaling:
                scheme = next(iter(planned.values()))
                w_mean = weight_group_mean([lin.weight for lin in p.linears], scheme)
            plain = opts.awq.duo_scaling is not True  # False: the paper's only; "both": the union
            s, info = search_scale(stats[key].absmean, objective, opts.awq.grid, w_mean, plain,
                                   bounded=True)
            fold_scales(p, s)
            scales.append(s)
            for n in p.linear_names:
                full = f"{block_name}.{n}"
                if full in samples:
                    samples[full] = samples[full] / s.to(samples[full])[None, :]
                if n in rel:
                    self.info.setdefault(full, {}).update(
                        {"awq_alpha": info["alpha"], "awq_duo": info["duo"], "awq_loss": info["loss"],
                         "awq_loss_rtn": info["loss_rtn"],
                         "awq_objective": "parent" if parent is not None else "linears"}
                    )
            self._saved[f"{block_name}.{p.prev_name}.scales"] = s.cpu()
        found = {}
        for full, mod in clip_mods.items():
            r = full[len(block_name) + 1 :]
            found[r] = search_clip(mod.weight, _spread(samples[full], opts.clip_tokens), rel[r],
                                   min_gain=opts.awq.clip_min_gain)
        clips = {}
        for p, parent, s in self._clip_checks(block, pairs, parents, scales, found):
            x = None if parent is not None else _spread(samples[f"{block_name}.{p.linear_names[0]}"], opts.search_tokens)
            for n, (clip, gain) in _keep_helpful_clips(p, rel, x, parent, s, found, precision).items():
                full = f"{block_name}.{n}"
                self.info.setdefault(full, {})["clip_gain"] = gain
                if clip is not None:
                    clips[full] = clip
        if clips and opts.clip_check_seqs:
            held = _held_out(inputs.shape[0], set(seqs), opts.clip_check_seqs)
            plain, clipped = _block_errors(block, rel, {f[len(block_name) + 1 :]: c for f, c in clips.items()},
                                           inputs[held], kwargs)
            for full in clips:
                self.info[full]["clip_block_gain"] = plain / clipped if clipped > 0 else float("inf")
            if clipped >= plain:
                clips = {}
        for full, clip in clips.items():
            self._saved[f"{full}.clip"] = clip.cpu()
        return clips

    @staticmethod
    def _clip_checks(block, pairs, parents, scales, found):
        """(pair, parent, folded scale) for each pair holding a clipped Linear; a Linear in no
        pair (e.g. o_proj under grouped-query attention) is judged on its own output."""
        covered = set()
        for p, parent, s in zip(pairs, parents, scales):
            if any(n in found for n in p.linear_names):
                covered.update(p.linear_names)
                yield p, parent, s
        for n in found:
            if n not in covered:
                yield ResolvedPair("", None, (n,), (block.get_submodule(n),)), None, None


def _recipe_fingerprint(recipe: Recipe, with_clip: bool) -> dict:
    return {"method": recipe.method, "scheme": recipe.scheme.to_dict(),
            "grid": recipe.awq.grid, "duo_scaling": recipe.awq.duo_scaling, "clip": with_clip,
            "clip_min_gain": recipe.awq.clip_min_gain if with_clip is not False else None, "ignore": list(recipe.ignore),
            "targets": list(recipe.targets)}


def method_from_recipe(recipe: Recipe) -> AWQMethod:
    """AWQ with the recipe's options (grid, clip, save_scales, load_scales)."""
    return AWQMethod(AWQSettings(awq=recipe.awq), recipe_fingerprint=_recipe_fingerprint(recipe, recipe.awq.clip))


class AWQGPTQMethod:
    """AWQ scaling (no clipping: GPTQ picks its own grid) then GPTQ on the scaled block."""

    def __init__(self, awq: AWQMethod, gptq):
        self.awq, self.gptq = awq, gptq
        self.options = (awq.options, gptq.options)
        self.scale_dtype = gptq.scale_dtype
        self.info: dict[str, dict] = {}

    def process_block(self, block, block_name, inputs, kwargs, plan, arch) -> dict[str, QuantResult]:
        self.awq.process_block(block, block_name, inputs, kwargs, plan, arch)
        results = self.gptq.process_block(block, block_name, inputs, kwargs, plan, arch)
        self.info = {n: {**self.awq.info.get(n, {}), **self.gptq.info.get(n, {})} for n in plan}
        return results

    @property
    def outputs(self):
        """The block's output from GPTQ's single pass (None when it re-ran per group)."""
        return self.gptq.outputs


def awq_gptq_from_recipe(recipe: Recipe) -> AWQGPTQMethod:
    """AWQ scales (recipe.awq, clip off) followed by GPTQ (recipe.gptq) as one BlockMethod."""
    from dataclasses import replace

    from .block_methods import GPTQMethod

    awq_opts = replace(recipe.awq, clip=False)
    awq = AWQMethod(AWQSettings(awq=awq_opts, quantize=False),
                    recipe_fingerprint=_recipe_fingerprint(recipe, False))
    return AWQGPTQMethod(awq, GPTQMethod(recipe.gptq))


__all__ = [
    "AWQMethod", "AWQSettings", "AWQGPTQMethod", "apply_clip", "awq_quantize", "fake_quantize",
    "method_from_recipe", "awq_gptq_from_recipe", "scale_from_alpha", "clip_error_curve", "pick_clip", "search_clip", "search_scale",
]
