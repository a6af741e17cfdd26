"""A model's ArchSpec: the declared one (quantspec/quant/arch.py), else one found by structure.

For a family with no declaration (or one that does not fit the model), one short forward
through the model locates the parts:

* blocks: the longest ModuleList whose entries share one class and hold Linears, and that is not
  inside another such list (a MoE block's per-expert list);
* groups (``sequential``): Linears of block 0 that read the same tensor object, in call order;
* attention: block 0's outermost module that a forward with a KV cache hands the cache to (the
  name KV-cache scales are written under); none for multi-head latent attention;
* smoothing pairs (``smooth``): for each group, the module whose output channels can absorb a
  per-channel scale for it. Candidates are the block's norm-like leaf modules (a weight of
  shape [K]; tried with offset 0 and with Gemma's offset 1) and its Linears with K, 2K or 3K
  outputs (a fused prev whose last K rows feed the group). A candidate is accepted only when
  folding random positive scales into it and the group leaves block 0's output unchanged
  (fp32, relative error below ``FOLD_TOL``): the same invariance the declared pairs have.
  A norm that also feeds Linears outside the group, a nonlinearity between prev and the group
  (SiLU(gate) -> down), or attention scores (q -> o) all fail that test and are left out.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ARCHS, ArchSpec, SmoothPair, check_arch
from .smoothing import ResolvedPair, fold_scales

FOLD_TOL = 1e-4  # relative error of block 0's output after folding random scales (fp32)


def get_arch(model: nn.Module) -> ArchSpec:
    """The declared ArchSpec for ``model.config.model_type``, else one found by structure.

    Raises QuantspecError naming the model_type when neither the declaration fits the model
    nor the generic search finds decoder blocks with Linears.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = ARCHS.get(model_type or "")
    if spec is not None and check_arch(model, spec) == []:
        return spec
    try:
        return infer_arch(model)
    except QuantspecError as exc:
        raise QuantspecError(
            f"model_type {model_type!r} has no architecture declaration and its decoder blocks "
            f"could not be found by structure ({exc.problem})",
            "add an ArchSpec for it to quantspec/quant/arch.py (ARCHS).",
        ) from exc


def infer_arch(model: nn.Module) -> ArchSpec:
    """An ArchSpec found by structure (see the module docstring)."""
    blocks_name = _find_block_list(model)
    embed = _name_of(model, model.get_input_embeddings()) if hasattr(model, "get_input_embeddings") else ""
    head_mod = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lm_head = _name_of(model, head_mod) if head_mod is not None else ""
    spec = ArchSpec(
        name="generic",
        blocks=blocks_name,
        embed=embed,
        final_norm=_find_final_norm(model, blocks_name),
        lm_head=lm_head,
    )
    call = _BlockCall.capture(model, spec)
    spec = replace(spec, sequential=call.groups, attention=_find_attention(model, spec))
    pairs, offset = infer_smooth_pairs(spec.block_list(model)[0], call)
    return replace(spec, smooth=pairs, norm_offset=offset)


def _find_block_list(model: nn.Module) -> str:
    """The longest outermost candidate: a ModuleList inside another one's entries (a MoE
    block's experts, often more of them than there are blocks) is never the block list."""
    found: dict[str, int] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 1:
            continue
        if len({type(m) for m in mod}) != 1:
            continue
        if not any(isinstance(m, nn.Linear) for m in mod[0].modules()):
            continue
        found[name] = len(mod)
    outer = [n for n in found if not any(n.startswith(f"{o}.") for o in found if o != n)]
    if not outer:
        raise QuantspecError("no ModuleList of identical blocks holding Linears was found")
    return max(outer, key=lambda n: found[n])


def _name_of(model: nn.Module, target: nn.Module | None) -> str:
    for name, mod in model.named_modules():
        if mod is target:
            return name
    return ""


def _find_final_norm(model: nn.Module, blocks_name: str) -> str:
    """The last module named like a norm that is a sibling of the block list."""
    parent = blocks_name.rpartition(".")[0]
    owner = model.get_submodule(parent) if parent else model
    found = ""
    for name, mod in owner.named_children():
        if "norm" in name.lower() or "norm" in type(mod).__name__.lower():
            found = f"{parent}.{name}" if parent else name
    return found


class _StopForward(Exception):
    """Raised from a hook to end a forward early; never escapes this package."""


class _BlockCall:
    """Block 0's arguments from one short forward, and its Linears grouped by shared input."""

    def __init__(self, args: tuple, kwargs: dict[str, Any], groups: tuple[tuple[str, ...], ...],
                 producers: dict[str, str]):
        self.args, self.kwargs, self.groups = args, kwargs, groups
        self.producers = producers  # first Linear of a group -> the module whose output it reads

    @classmethod
    def capture(cls, model: nn.Module, spec: ArchSpec) -> "_BlockCall":
        block = spec.block_list(model)[0]
        names = {mod: rel for rel, mod in block.named_modules() if isinstance(mod, nn.Linear)}
        seen: list[tuple[torch.Tensor, list[str]]] = []  # keeps the tensors alive: no id reuse
        call: dict[str, Any] = {}
        outputs: list[tuple[torch.Tensor, str]] = []

        def produced(name: str):
            def hook(_mod, _args, out) -> None:
                if isinstance(out, torch.Tensor):
                    outputs.append((out, name))
            return hook

        def record(mod: nn.Module, args: tuple) -> None:
            x = args[0]
            for tensor, group in seen:
                if tensor is x:
                    group.append(names[mod])
                    return
            seen.append((x, [names[mod]]))

        def enter(_mod, args, kwargs) -> None:
            call.setdefault("args", args)
            call.setdefault("kwargs", kwargs)

        handles = [m.register_forward_pre_hook(record) for m in names]
        handles += [m.register_forward_hook(produced(n)) for n, m in block.named_modules()
                    if n and next(m.children(), None) is None]
        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        _forward_through_block0(model, spec, handles, use_cache=False)
        groups = [tuple(dict.fromkeys(g)) for _, g in seen]
        producers = {g[0]: name for x, g in seen for out, name in outputs if out is x}
        called = {n for g in groups for n in g}
        groups += [(n,) for n in names.values() if n not in called]  # Linears the forward skipped
        return cls(call.get("args", ()), call.get("kwargs", {}), tuple(groups), producers)


def _find_attention(model: nn.Module, spec: ArchSpec) -> str | None:
    """Block 0's outermost module that is handed the forward's KV cache (its attention), from one
    short forward with a cache; None when none is, or the family caches a compressed latent
    (multi-head latent attention: ``kv_lora_rank`` in its config)."""
    from transformers import DynamicCache

    from ..runtime.kv import cache_kwarg

    if getattr(model.config, "kv_lora_rank", None):
        return None
    block = spec.block_list(model)[0]
    cache = DynamicCache(config=model.config)
    found: list[str] = []

    def handed(name: str):
        def hook(_mod, args, kwargs) -> None:
            if any(a is cache for a in (*args, *kwargs.values())):
                found.append(name)
        return hook

    handles = [m.register_forward_pre_hook(handed(n), with_kwargs=True) for n, m in block.named_modules() if n]
    try:
        _forward_through_block0(model, spec, handles, use_cache=True, **{cache_kwarg(model): cache})
    except Exception:  # noqa: BLE001 - a family whose forward takes no such cache: no KV scales, nothing else lost
        return None
    return min(found, key=lambda n: n.count(".")) if found else None


def _forward_through_block0(model: nn.Module, spec: ArchSpec, handles: list, **kwargs) -> None:
    """One forward of 8 tokens through ``model`` (``kwargs`` added) that ends after block 0; the
    hooks of ``handles`` are removed after it."""
    def stop(_mod, _args, _out) -> None:
        raise _StopForward

    handles = [*handles, spec.block_list(model)[0].register_forward_hook(stop)]
    ids = torch.arange(1, 9, dtype=torch.long, device=next(model.parameters()).device).unsqueeze(0)
    try:
        with torch.no_grad():
            model(input_ids=ids, **kwargs)
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()


def _fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float32)
    if isinstance(value, (tuple, list)):
        return type(value)(_fp32(v) for v in value)
    return value


def _first_tensor(out: Any) -> torch.Tensor:
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


def _norm_like(mod: nn.Module, k: int) -> bool:
    w = getattr(mod, "weight", None)
    return (not isinstance(mod, nn.Linear) and next(mod.children(), None) is None
            and isinstance(w, torch.Tensor) and w.shape == (k,))


def infer_smooth_pairs(block: nn.Module, call: _BlockCall) -> tuple[tuple[SmoothPair, ...], float]:
    """Smoothing pairs of ``block`` (block 0) checked by folding, and the norms' offset."""
    if not call.args or any(t.is_meta for t in block.parameters()):
        return (), 0.0  # no real weights to fold (a meta-device model): no pairs
    work = copy.deepcopy(block).to(torch.float32).eval()  # no dropout in the folding test
    args, kwargs = _fp32(call.args), _fp32(call.kwargs)
    try:
        with torch.no_grad():
            ref = _first_tensor(work(*args, **kwargs))
    except (RuntimeError, ValueError, TypeError, IndexError):  # the block does not run on its own call
        return (), 0.0  # (XLM's "blocks" are its attention modules): no pair can be checked, so none
    gen = torch.Generator().manual_seed(0)
    modules = dict(work.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    pairs: list[SmoothPair] = []
    offset: float | None = None
    for group in call.groups:
        k = linears[group[0]].in_features
        # the module whose output the group reads comes first; then every other candidate
        cands: list[tuple[str, int, float]] = []
        for name, mod in modules.items():
            if name and _norm_like(mod, k):
                offsets = (0.0, 1.0) if offset is None else (offset,)
                cands += [(name, 1, o) for o in offsets]
            elif isinstance(mod, nn.Linear) and name not in group:
                cands += [(name, p, 0.0) for p in (1, 2, 3) if mod.out_features == p * k]
        cands.sort(key=lambda c: c[0] != call.producers.get(group[0]))  # stable
        for name, parts, off in cands:
            s = torch.empty(k).uniform_(0.5, 2.0, generator=gen)
            if _fold_keeps_output(work, args, kwargs, ref, name, group, off, s):
                pairs.append(SmoothPair(name, group, parts))
                if not isinstance(modules[name], nn.Linear):
                    offset = off
                break
    return tuple(pairs), offset or 0.0


def _fold_keeps_output(work, args, kwargs, ref, prev_name, group, offset, s) -> bool:
    prev = work.get_submodule(prev_name)
    lins = tuple(work.get_submodule(n) for n in group)
    saved = {id(t): t.detach().clone() for m in (prev, *lins) for t in m.parameters(recurse=False)}
    try:
        fold_scales(ResolvedPair(prev_name, prev, group, lins, offset), s)
        with torch.no_grad():
            out = _first_tensor(work(*args, **kwargs))
        err = float((out - ref).norm() / ref.norm().clamp(min=1e-12))
        return bool(torch.isfinite(out).all()) and err < FOLD_TOL
    finally:
        with torch.no_grad():
            for m in (prev, *lins):
                for t in m.parameters(recurse=False):
                    t.copy_(saved[id(t)])
