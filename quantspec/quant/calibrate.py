"""Block-sequential calibration engine (as in GPTQ, AWQ, llm-compressor's sequential pipeline).

1. Capture the inputs of every decoder block once: the hidden states entering block 0 (one per
   calibration sample) and the keyword arguments each block receives (attention mask,
   position embeddings from the model's rotary module, position ids; caching disabled). Every
   block is swapped for a ``_Catcher`` that records its call, so no block computes anything.
2. For each block: move only that block to the device, let a ``BlockMethod`` compute its
   QuantResults, swap the dequantized (fake-quant) weights in, replay the block to produce the
   next block's inputs (measuring each Linear's relative output error on the way), move the
   block back. Memory: one block plus the calibration activations.

Optionally, after each block the engine saves its results and the next block's inputs under
``resume_dir`` (see ``resume.py``), so an interrupted run continues where it stopped and gives
bit-identical results.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .resume import ResumeState, fingerprint
from .scheme import QuantResult, QuantScheme

# Per-layer output errors are measured on the first ERROR_SAMPLES calibration samples only
# (the reference matmul would otherwise double the replay's Linear cost).
ERROR_SAMPLES = 16

# Keyword arguments that carry a KV cache: never replayed into a block.
_CACHE_KWARGS = ("past_key_value", "past_key_values", "cache", "layer_past")


class BlockMethod(Protocol):
    """A quantization algorithm that works on one decoder block at a time.

    ``process_block`` gets the block (on the device), its full name (``model.layers.3``), its
    inputs (hidden states [n, L, H], one row per calibration sample), the keyword arguments
    the block is called with, ``plan`` (this block's full Linear names -> QuantScheme; other
    Linears stay dense) and the ArchSpec. It returns a QuantResult for every planned name.

    Contract: when it returns, every planned Linear's ``.weight`` holds the dense weight its
    QuantResult approximates (smoothing methods leave the smoothed weight); the engine then
    swaps in the dequantized values. Other tensors of the block (e.g. a norm a smoothing scale
    was folded into) may be changed. Optional attribute ``info: dict[str, dict]``: per-layer
    details of the last call, merged into the engine's report.
    """

    def process_block(
        self,
        block: nn.Module,
        block_name: str,
        inputs: torch.Tensor,
        kwargs: dict[str, Any],
        plan: dict[str, QuantScheme],
        arch: ArchSpec,
    ) -> dict[str, QuantResult]: ...


class _StopBlock(Exception):
    """Ends a forward early from a hook; caught by the function that raised it."""


class _Catcher(nn.Module):
    """Stands in for a decoder block while inputs are captured; passes hidden states on."""

    def __init__(self, block: nn.Module, index: int, store: dict, stop: bool):
        super().__init__()
        self.block = block
        self.index = index
        self.store = store
        self.stop = stop

    def __getattr__(self, name: str):  # the model loop may read attributes of its blocks
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def forward(self, hidden_states=None, *args, **kwargs):
        if args:
            raise QuantspecError(
                "a decoder block was called with extra positional arguments.",
                "declare this architecture or call its blocks with keyword arguments.",
            )
        if hidden_states is None:
            hidden_states = kwargs.pop("hidden_states")
        if self.index == 0:
            self.store.setdefault("hidden", []).append(hidden_states)
        self.store.setdefault("kwargs", {}).setdefault(self.index, kwargs)
        if self.stop:
            raise _StopBlock
        return hidden_states


def _move_outside_blocks(model: nn.Module, arch: ArchSpec, device: torch.device) -> dict:
    """Move every direct parameter/buffer outside the blocks and lm_head to ``device``.

    Returns {(module, kind, key): original device} for ``_restore_outside``.
    """
    moved: dict = {}
    skip = (arch.blocks, arch.lm_head)
    for name, mod in model.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skip if s):
            continue
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(mod, kind).items():
                if t is not None and t.device != device:
                    moved[(mod, kind, key)] = t.device
                    t.data = t.data.to(device)
    return moved


def _restore_outside(moved: dict) -> None:
    for (mod, kind, key), dev in moved.items():
        t = getattr(mod, kind)[key]
        t.data = t.data.to(dev)


def capture_inputs(
    model: nn.Module, arch: ArchSpec, calib_ids: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """Hidden states entering block 0 ([n, L, H] on ``device``) and each block's kwargs.

    One forward per sample up to block 0 (the embedding only); sample 0 runs through all
    catchers so blocks whose kwargs differ (Gemma's sliding/full attention) get their own.
    """
    blocks = arch.block_list(model)
    originals = list(blocks)
    store: dict = {}
    moved = _move_outside_blocks(model, arch, device)
    try:
        for j in range(calib_ids.shape[0]):
            for i, block in enumerate(originals):
                last = i == len(originals) - 1
                blocks[i] = _Catcher(block, i, store, stop=last if j == 0 else i == 0)
            try:
                model(input_ids=calib_ids[j : j + 1].to(device), use_cache=False)
            except _StopBlock:
                pass
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
        _restore_outside(moved)
    kwargs = [_clean_kwargs(store["kwargs"][i]) for i in range(len(originals))]
    return torch.cat(store["hidden"], dim=0), kwargs


def _clean_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in kwargs.items() if k not in _CACHE_KWARGS}
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def _check_finite(x: torch.Tensor, block_name: str, where: str) -> None:
    if not torch.isfinite(x).all():
        raise QuantspecError(
            f"NaN/Inf activations in block {block_name} at {where}.",
            "load the model in float32 or bfloat16 (float16 overflows in some models), or "
            "check the calibration data.",
        )


def block_forward(block: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run ``block`` on each calibration sample; [n, L, H] -> [n, L, H]."""
    outs = [inputs[:0]]
    for j in range(inputs.shape[0]):
        out = block(inputs[j : j + 1], **kwargs)
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return torch.cat(outs, dim=0)


def run_linear_inputs(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    modules: dict[str, nn.Module],
    fn: Callable[[str, torch.Tensor], None],
) -> None:
    """Call ``fn(name, x)`` with the input of every Linear in ``modules`` on each sample.

    The block forward stops as soon as every module of ``modules`` has been called, so
    statistics of early groups (q/k/v) cost only the part of the block before them.
    Non-finite inputs raise QuantspecError naming the block and layer.
    """
    seen: set[str] = set()

    def hook(name: str):
        def pre(_mod, args):
            x = args[0]
            _check_finite(x, block_name, f"the input of {name}")
            fn(name, x)
            seen.add(name)
            if len(seen) == len(modules):
                raise _StopBlock

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        for j in range(inputs.shape[0]):
            seen.clear()
            try:
                block(inputs[j : j + 1], **kwargs)
            except _StopBlock:
                pass
    finally:
        for h in handles:
            h.remove()


def block_groups(
    block: nn.Module, block_name: str, plan: dict[str, QuantScheme], arch: ArchSpec
) -> list[list[str]]:
    """Planned full Linear names of this block in true-sequential groups.

    The ArchSpec's groups first (filtered by the plan), then planned Linears it does not
    declare, one group each, in module order.
    """
    groups = [[f"{block_name}.{r}" for r in g if f"{block_name}.{r}" in plan] for g in arch.sequential]
    groups = [g for g in groups if g]
    covered = {n for g in groups for n in g}
    for rel, mod in block.named_modules():
        name = f"{block_name}.{rel}"
        if isinstance(mod, nn.Linear) and name in plan and name not in covered:
            groups.append([name])
    return groups


def planned_linears(block: nn.Module, block_name: str, plan: dict[str, QuantScheme]) -> dict[str, nn.Linear]:
    """{full name: Linear} for the names of ``plan`` (all inside ``block``)."""
    return {n: block.get_submodule(n[len(block_name) + 1 :]) for n in plan}  # type: ignore[misc]


def _split_plan(
    model: nn.Module, arch: ArchSpec, plan: dict[str, QuantScheme]
) -> list[dict[str, QuantScheme]]:
    """The plan per block; names outside the blocks are left out (the caller handles them)."""
    blocks = arch.block_list(model)
    per_block: list[dict[str, QuantScheme]] = [{} for _ in blocks]
    for name, scheme in plan.items():
        rest = name[len(arch.blocks) + 1 :] if name.startswith(arch.blocks + ".") else ""
        idx, _, rel = rest.partition(".")
        if not idx.isdigit() or int(idx) >= len(blocks):
            continue
        mod = _submodule(blocks[int(idx)], rel)
        if not isinstance(mod, nn.Linear):
            raise QuantspecError(
                f"{name} is not a Linear of the model.", "check the recipe's targets and ignore."
            )
        per_block[int(idx)][name] = scheme
    return per_block


def _submodule(block: nn.Module, rel: str) -> nn.Module | None:
    try:
        return block.get_submodule(rel) if rel else None
    except AttributeError:
        return None


def _replay(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    refs: dict[str, tuple[nn.Linear, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, float]]:
    """Next block's inputs, and each planned Linear's relative output MSE vs its dense ref
    (on the first ERROR_SAMPLES samples)."""
    num = {n: 0.0 for n in refs}
    den = {n: 0.0 for n in refs}

    def hook(name: str, dense: torch.Tensor):
        def post(mod, args, out):
            x = args[0]
            _check_finite(x, block_name, f"the input of {name}")
            ref = torch.nn.functional.linear(x, dense, mod.bias)
            num[name] += float((out.float() - ref.float()).pow(2).sum())
            den[name] += float(ref.float().pow(2).sum())

        return post

    k = min(ERROR_SAMPLES, inputs.shape[0])
    handles = [m.register_forward_hook(hook(n, w)) for n, (m, w) in refs.items()]
    try:
        head = block_forward(block, inputs[:k], kwargs)
    finally:
        for h in handles:
            h.remove()
    out = torch.cat([head, block_forward(block, inputs[k:], kwargs)], dim=0)
    _check_finite(out, block_name, "its output")
    return out, {n: num[n] / max(den[n], 1e-30) for n in refs}


def _apply_results(block: nn.Module, block_name: str, results: dict[str, QuantResult]) -> dict:
    """Swap dequantized weights in; returns {name: (module, dense weight)}."""
    refs = {}
    for name, res in results.items():
        mod = block.get_submodule(name[len(block_name) + 1 :])
        dense = mod.weight.detach().clone()
        with torch.no_grad():
            mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        refs[name] = (mod, dense)
    return refs


def _block_device(block: nn.Module) -> torch.device:
    p = next(block.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def method_description(method: BlockMethod) -> str:
    """What identifies a method's behaviour: its class and its options."""
    options = getattr(method, "options", None)
    return f"{type(method).__qualname__}({options!r}, {getattr(method, 'scale_dtype', None)})"


def run_blockwise(
    model: nn.Module,
    arch: ArchSpec,
    calib_ids: torch.Tensor,
    method: BlockMethod,
    plan: dict[str, QuantScheme],
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    resume_dir: str | None = None,
    report: dict | None = None,
) -> dict[str, QuantResult]:
    """Quantize the planned Linears of ``model`` block by block; returns results by full name.

    Planned names outside the decoder blocks (e.g. lm_head) are not touched and not returned.

    calib_ids: LongTensor [n, L] (n calibration samples of L tokens). device: where each block
    is processed (default: where the model's parameters are). Each quantized Linear's
    ``.weight`` is left holding its dequantized value in its own dtype. ``report`` (if given)
    receives ``report[name] = {"block", "rel_mse", "block_seconds", ...method info}``, where
    rel_mse is ``||x Wq^T - x W^T||^2 / ||x W^T||^2`` over the layer's inputs from the first
    ERROR_SAMPLES calibration samples.
    """
    from tqdm.auto import tqdm

    if calib_ids.dim() != 2:
        raise QuantspecError(
            f"calibration ids must be [samples, seqlen], got shape {tuple(calib_ids.shape)}.",
            "pass a 2-D LongTensor.",
        )
    device = torch.device(device) if device is not None else next(model.parameters()).device
    per_block = _split_plan(model, arch, plan)
    blocks = arch.block_list(model)
    report = {} if report is None else report
    results: dict[str, QuantResult] = {}
    state = None
    if resume_dir is not None:
        fp = fingerprint(model, arch, plan, method_description(method), calib_ids)
        state = ResumeState(resume_dir, fp)
    with torch.no_grad():
        inputs, kwargs = capture_inputs(model, arch, calib_ids, device)
        _check_finite(inputs, arch.block_name(0), "its input (the embeddings)")
        start = 0
        if state is not None and state.done > 0:
            start = state.done
            inputs = state.restore(blocks, arch, results, report).to(device)
        bar = tqdm(total=len(blocks), initial=start, disable=not progress, desc="quantize", unit="block")
        for i in range(start, len(blocks)):
            block, name = blocks[i], arch.block_name(i)
            home = _block_device(block)
            block.to(device)
            before = state.snapshot(block) if state is not None else None
            t0 = time.perf_counter()
            block_results = _process(method, block, name, inputs, kwargs[i], per_block[i], arch)
            seconds = time.perf_counter() - t0
            refs = _apply_results(block, name, block_results)
            inputs, errors = _replay(block, name, inputs, kwargs[i], refs)
            info = getattr(method, "info", None) or {}
            for n in block_results:
                report[n] = {"block": i, "rel_mse": errors[n], "block_seconds": seconds, **info.get(n, {})}
            results.update(block_results)
            if state is not None:
                state.save_block(i, name, block, before, block_results, inputs, report)
            block.to(home)
            bar.update(1)
        bar.close()
    return results


def _process(method, block, name, inputs, kwargs, plan, arch) -> dict[str, QuantResult]:
    if not plan:
        return {}
    out = method.process_block(block, name, inputs, kwargs, plan, arch)
    missing = set(plan) - set(out)
    if missing:
        raise RuntimeError(f"{type(method).__name__} returned no result for {sorted(missing)}")
    return {n: out[n] for n in plan}
