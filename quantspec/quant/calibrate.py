"""Block-sequential calibration engine (as in GPTQ, AWQ, llm-compressor's sequential pipeline).

1. Capture the inputs of every decoder block once (``capture.py``): the hidden states entering
   block 0 (one per calibration sample) and the keyword arguments each block receives
   (attention mask, position embeddings from the model's rotary module, position ids; caching
   disabled).
2. For each block: move only that block to the device, let a ``BlockMethod`` compute its
   QuantResults, swap the dequantized (fake-quant) weights in, replay the block to produce the
   next block's inputs (measuring each Linear's relative output error on the way), move the
   block back. Memory: one block plus the calibration activations.

Optionally, after each block the engine saves its results and the next block's inputs under
``resume_dir`` (see ``resume.py``), so an interrupted run continues where it stopped and gives
bit-identical results, on the in-memory and the streaming path alike.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .capture import StopBlock, capture_inputs
from .heap import reuse_freed_memory
from .resume import ResumeState, fingerprint
from .scheme import QuantResult, QuantScheme

# Per-layer output errors are measured on the first ERROR_SAMPLES calibration samples only
# (the reference matmul would otherwise double the replay's Linear cost).
ERROR_SAMPLES = 16



class BlockMethod(Protocol):
    """A quantization algorithm that works on one decoder block at a time.

    ``process_block`` gets the block (on the device), its full name (``model.layers.3``), its
    inputs (hidden states [n, L, H], one row per calibration sample), the keyword arguments
    the block is called with, ``plan`` (this block's full Linear names -> QuantScheme; other
    Linears stay dense) and the ArchSpec. It returns a QuantResult for every planned name.

    Contract: when it returns, every planned Linear's ``.weight`` holds the dense weight its
    QuantResult approximates (smoothing methods leave the smoothed weight); the engine then
    swaps in the dequantized values. Other tensors of the block (e.g. a norm a smoothing scale
    was folded into) may be changed. Optional attributes: ``info: dict[str, dict]``, per-layer
    details of the last call, merged into the engine's report (a ``rel_mse`` there replaces
    the engine's); ``outputs``, when not None, the next block's inputs, which the engine then
    takes instead of replaying the block with the dequantized weights (GPTQ's from its single
    pass; AWQ's, by default, the float block's output).

    A method may also offer a second choice for some layers, made at the end on the whole model:
    ``alternative`` (after ``process_block``: {name: QuantResult} for some of the block's layers,
    or None) and ``prefer_alternative(logits, n_blocks) -> bool | None``, called once after the
    last block with ``logits(h)`` (the model's final norm and head on hidden states [n, L, H]);
    True swaps every offered alternative in (AWQ: its clipping, kept or dropped model-wide).
    ``final_info`` (per-layer details of that choice) is merged into the report, and for resumed
    runs ``state_tensors()`` / ``load_state_tensors(d)`` carry what the choice needs.
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


def check_finite(x: torch.Tensor, block_name: str, where: str) -> None:
    if not torch.isfinite(x).all():
        raise QuantspecError(
            f"NaN/Inf activations in block {block_name} at {where}.",
            "load the model in float32 or bfloat16 (float16 overflows in some models), or "
            "check the calibration data.",
        )


def block_outputs(block: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """One call of ``block`` on ``inputs`` as a batch; its hidden-states output."""
    out = block(inputs, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def block_forward(block: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run ``block`` on each calibration sample; [n, L, H] -> [n, L, H]."""
    outs = [inputs[:0]] + [block_outputs(block, inputs[j : j + 1], kwargs) for j in range(inputs.shape[0])]
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
            check_finite(x, block_name, f"the input of {name}")
            fn(name, x)
            seen.add(name)
            if len(seen) == len(modules):
                raise StopBlock

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        for j in range(inputs.shape[0]):
            seen.clear()
            try:
                block(inputs[j : j + 1], **kwargs)
            except StopBlock:
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
            check_finite(x, block_name, f"the input of {name}")
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
    check_finite(out, block_name, "its output")
    return out, {n: num[n] / max(den[n], 1e-30) for n in refs}


def _apply_results(block: nn.Module, block_name: str, results: dict[str, QuantResult]) -> dict:
    """Swap dequantized weights in (``block_name`` '' when ``block`` is the model); returns
    {name: (module, dense weight)}."""
    refs = {}
    for name, res in results.items():
        mod = block.get_submodule(name[len(block_name) + 1 :] if block_name else name)
        dense = mod.weight.detach().clone()
        with torch.no_grad():
            mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        refs[name] = (mod, dense)
    return refs


def _to_device(res: QuantResult, device: torch.device) -> QuantResult:
    """Results leave the processing device: only one block's worth may live there."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return replace(res, qweight=move(res.qweight), scales=move(res.scales),
                   zeros=move(res.zeros), g_idx=move(res.g_idx))


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
    on_block_start: Callable[[int, nn.Module], None] | None = None,
    on_block_end: Callable[[int, nn.Module, dict[str, QuantResult]], None] | None = None,
    on_block_alternative: Callable[[int, nn.Module, dict[str, QuantResult]], None] | None = None,
    on_choice: Callable[[bool], None] | None = None,
) -> dict[str, QuantResult]:
    """Quantize the planned Linears of ``model`` block by block; returns results by full name.

    Planned names outside the decoder blocks (e.g. lm_head) are not touched and not returned.

    calib_ids: LongTensor [n, L] (n calibration samples of L tokens). device: where each block
    is processed (default: where the model's parameters are). Each quantized Linear's
    ``.weight`` is left holding its dequantized value in its own dtype. ``report`` (if given)
    receives ``report[name] = {"block", "rel_mse", "block_seconds", ...method info}``, where
    rel_mse is ``||x Wq^T - x W^T||^2 / ||x W^T||^2`` over the layer's inputs from the first
    ERROR_SAMPLES calibration samples.

    Streaming (``streaming.py``): ``on_block_start(i, block)`` runs before block i is touched
    (e.g. to read its weights lazily) and ``on_block_end(i, block, results)`` after it is done
    (e.g. to write its packed tensors and release it); with ``on_block_end`` set, results are
    handed over block by block and not accumulated (the return value is empty).
    A method's alternatives (``BlockMethod``) then go to ``on_block_alternative(i, block,
    results with the alternatives swapped in)`` before ``on_block_end``, and the final choice
    to ``on_choice(use_alternatives)``; without ``on_block_alternative`` no choice is made.

    ``resume_dir``: journal each finished block there (``resume.py``); on a rerun the finished
    blocks are restored (each checked against the digest of the float weights it was quantized
    from) and pass through the same hooks, and their report entries are marked ``"resumed"``.
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
    alternatives: dict[str, QuantResult] = {}
    offered = False
    state = None
    if resume_dir is not None:
        fp = fingerprint(model, arch, plan, method_description(method), calib_ids)
        state = ResumeState(resume_dir, fp)
    with torch.no_grad(), reuse_freed_memory():
        inputs, kwargs = capture_inputs(model, arch, calib_ids, device)
        check_finite(inputs, arch.block_name(0), "its input (the embeddings)")
        start = state.done if state is not None else 0
        if start:  # blocks finished by an interrupted run, from the resume folder
            hooks = (on_block_start, on_block_end, on_block_alternative)
            offered = _restore_finished(state, blocks, arch, hooks, results, alternatives)
            state.restore_report(report)
            inputs = state.next_inputs().to(device)
            if state.method_state and hasattr(method, "load_state_tensors"):
                method.load_state_tensors(state.method_state)
        bar = tqdm(total=len(blocks), initial=start, disable=not progress, desc="quantize", unit="block")
        for i in range(start, len(blocks)):
            block, name = blocks[i], arch.block_name(i)
            if on_block_start is not None:
                on_block_start(i, block)
            home = _block_device(block)
            block.to(device)
            try:
                before = state.snapshot(block) if state is not None else None
                t0 = time.perf_counter()
                block_results = _process(method, block, name, inputs, kwargs[i], per_block[i], arch)
                seconds = time.perf_counter() - t0
                refs = _apply_results(block, name, block_results)
                info = getattr(method, "info", None) or {}
                outputs = getattr(method, "outputs", None) if block_results else None
                # reference matmuls only for layers whose error the method did not report
                need = {n: r for n, r in refs.items() if "rel_mse" not in info.get(n, {})}
                if outputs is None:
                    inputs, errors = _replay(block, name, inputs, kwargs[i], need)
                else:  # the method gave the next block's inputs
                    errors = _replay(block, name, inputs[:ERROR_SAMPLES], kwargs[i], need)[1] if need else {}
                    inputs = outputs
                block_results = {n: _to_device(r, home) for n, r in block_results.items()}
                alt = getattr(method, "alternative", None) if block_results else None
                alt = {n: _to_device(r, home) for n, r in alt.items()} if alt else None
                if alt:
                    offered = True
                    if on_block_end is None:
                        alternatives.update(alt)
                    elif on_block_alternative is not None:
                        on_block_alternative(i, block, {**block_results, **alt})
                for n in block_results:
                    report.setdefault(n, {}).update(
                        {"block": i, "rel_mse": errors.get(n), "block_seconds": seconds, **info.get(n, {})}
                    )
                if on_block_end is None:
                    results.update(block_results)
                if state is not None:
                    method_state = method.state_tensors() if hasattr(method, "state_tensors") else None
                    state.save_block(i, name, block, before, block_results, inputs, report, alt, method_state)
            finally:
                block.to(home)
            if on_block_end is not None:
                on_block_end(i, block, block_results)
            bar.update(1)
        bar.close()
        if offered and (on_block_end is None or on_block_alternative is not None):
            _final_choice(model, arch, method, results, alternatives, len(blocks), report, on_choice)
    return results


def _restore_finished(state: ResumeState, blocks: nn.ModuleList, arch: ArchSpec, hooks: tuple,
                      results: dict[str, QuantResult], alternatives: dict[str, QuantResult]) -> bool:
    """Restore the ``state.done`` finished blocks as if just processed: through the streaming
    hooks ``(on_block_start, on_block_end, on_block_alternative)`` when set (so their shards
    are written again), else into ``results`` / ``alternatives``. True when any block offered
    alternatives."""
    on_start, on_end, on_alternative = hooks
    offered = False
    for i in range(state.done):
        if on_start is not None:
            on_start(i, blocks[i])
        block_results, alt = state.restore_block(i, blocks[i], arch.block_name(i))
        offered = offered or bool(alt)
        if on_end is None:
            results.update(block_results)
            alternatives.update(alt)
            continue
        if alt and on_alternative is not None:
            on_alternative(i, blocks[i], {**block_results, **alt})
        on_end(i, blocks[i], block_results)
    return offered


def final_logits(model: nn.Module, arch: ArchSpec) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``logits(h)``: the model's final norm and head (ArchSpec names) on hidden states
    [n, L, H] (on the head's device and dtype); None when the model lacks either."""
    try:
        norm, head = model.get_submodule(arch.final_norm), model.get_submodule(arch.lm_head)
    except AttributeError:
        return None
    weight = getattr(head, "weight", None)
    if weight is None or weight.is_meta:
        return None

    def logits(h: torch.Tensor) -> torch.Tensor:
        return head(norm(h.to(weight.device, weight.dtype)))

    return logits


def _final_choice(model, arch, method, results, alternatives, n_blocks, report, on_choice) -> None:
    """Ask the method whether its alternatives win on the whole model; swap them in if so."""
    prefer = getattr(method, "prefer_alternative", None)
    logits = final_logits(model, arch)
    if prefer is None or logits is None:
        return
    use = bool(prefer(logits, n_blocks))
    for name, extra in (getattr(method, "final_info", None) or {}).items():
        report.setdefault(name, {}).update(extra)
    if use and alternatives:
        results.update(alternatives)
        _apply_results(model, "", alternatives)
    if on_choice is not None:
        on_choice(use)


def _process(method, block, name, inputs, kwargs, plan, arch) -> dict[str, QuantResult]:
    if not plan:
        return {}
    out = method.process_block(block, name, inputs, kwargs, plan, arch)
    missing = set(plan) - set(out)
    if missing:
        raise RuntimeError(f"{type(method).__name__} returned no result for {sorted(missing)}")
    return {n: out[n] for n in plan}
