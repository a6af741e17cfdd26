"""The calibration engine: one driver that runs a ``BlockMethod`` (``method.py``) over the
decoder blocks of a model, block by block (as GPTQ, AWQ and llm-compressor's sequential
pipeline do).

1. Capture the inputs of every decoder block once (``capture.py``): the hidden states entering
   block 0 (one per calibration sample) and the keyword arguments each block receives
   (attention mask, position embeddings, position ids; caching disabled). Skipped for a method
   that needs no calibration (RTN).
2. For each block: the *source* loads its weights (``ResidentSource``: already there;
   ``sources.LazySource``: read from the safetensors shards), the block moves to the device,
   the method returns its ``BlockOutput``, the dequantized (fake-quant) weights are swapped in
   and the block replayed to produce the next block's inputs (measuring each Linear's relative
   output error on the way), the *sink* takes the results (``sinks.py``: kept in memory, or
   packed into the block's checkpoint shard), the source releases the block.
3. After the last block, the method's post-pass (``finish``) may replace earlier results.

Memory: one block plus the calibration activations (plus the model, for a resident source).
Resume is a sink wrapper (``resume.JournaledSink``): each finished block is journaled, and a
rerun reads the journaled blocks back instead of processing them, on any source and sink.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .block_ops import apply_results, block_forward, check_finite, input_scales, planned_linears
from .capture import capture_inputs
from .distributed import Reducer
from ..core.floatcodes import FP8_MAX
from .heap import reuse_freed_memory
from .method import BlockContext, BlockMethod, BlockOutput, FinishContext
from .moe import routed_tokens
from ..core.scheme import QuantResult, QuantScheme
from .sinks import BlockRecord, MemorySink, Sink

# Per-layer output errors are measured on the first ERROR_SAMPLES calibration samples only
# (the reference matmul would otherwise double the replay's Linear cost).
ERROR_SAMPLES = 16


class ResidentSource:
    """A model whose weights are all in memory: nothing to load or release."""

    def load(self, index: int, block: nn.Module) -> None:
        pass

    def release(self, index: int, block: nn.Module) -> None:
        pass


def split_plan(model: nn.Module, arch: ArchSpec, plan: dict[str, QuantScheme]) -> list[dict[str, QuantScheme]]:
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


def _block_device(block: nn.Module) -> torch.device:
    p = next(block.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


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


def run_blockwise(
    model: nn.Module,
    arch: ArchSpec,
    calib_ids: torch.Tensor | None,
    method: BlockMethod,
    plan: dict[str, QuantScheme],
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    resume_dir: str | None = None,
    report: dict | None = None,
    source: ResidentSource | None = None,
    sink: Sink | None = None,
    reducer: Reducer | None = None,
) -> dict[str, QuantResult]:
    """Quantize the planned Linears of ``model`` block by block; returns the results by full
    name when the sink keeps them (the default ``MemorySink``), else an empty dict.

    Planned names outside the decoder blocks (e.g. lm_head) are not touched and not returned.
    calib_ids: LongTensor [n, L] (n calibration samples of L tokens; None for a method that
    needs no calibration, whose layers then get no measured output error). device: where each block is processed (default: where the model's
    parameters are). With the default sink each quantized Linear's ``.weight`` is left holding
    its dequantized value in its own dtype. ``report`` (if given) receives ``report[name] =
    {"block", "rel_mse", "block_seconds", ...method info}``, where rel_mse is
    ``||x Wq^T - x W^T||^2 / ||x W^T||^2`` over the layer's inputs from the first ERROR_SAMPLES
    calibration samples. ``source``: where block weights come from (default: resident);
    ``sink``: where results go (default: kept in memory). ``resume_dir``: wrap the sink in a
    journal there (``resume.JournaledSink``); a rerun restores the finished blocks (each checked
    against the digest of the float weights it was quantized from) and marks their report
    entries ``"resumed"``. ``reducer``: data-parallel calibration (``distributed.py``): this
    process calibrates on its share of ``calib_ids`` and the method reduces its statistics.
    """
    from tqdm.auto import tqdm

    calibrated = calib_ids is not None  # a method that needs none is still measured on data given
    if (method.needs_calibration and not calibrated) or (calibrated and calib_ids.dim() != 2):
        raise QuantspecError(
            f"calibration ids must be [samples, seqlen], got "
            f"{None if calib_ids is None else tuple(calib_ids.shape)}.",
            "pass a 2-D LongTensor.",
        )
    reducer = reducer or Reducer()
    if reducer.active and not method.data_parallel:
        raise QuantspecError(f"{type(method).__name__} cannot split calibration across processes.",
                             "run it in one process (without torchrun), or use --method gptq.")
    if reducer.active and resume_dir is not None:
        raise QuantspecError("resume and data-parallel calibration do not combine.", "drop --resume under torchrun.")
    if calibrated:
        calib_ids = reducer.shard(calib_ids)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    source = source or ResidentSource()
    kept = sink = sink or MemorySink()
    per_block = split_plan(model, arch, plan)
    blocks = arch.block_list(model)
    report = {} if report is None else report
    journal = None
    if resume_dir is not None:
        from .resume import JournaledSink, ResumeState, fingerprint

        ids = calib_ids if calib_ids is not None else torch.zeros(0, 0, dtype=torch.long)
        sink = journal = JournaledSink(sink, ResumeState(resume_dir, fingerprint(model, arch, plan, method.describe(), ids)))
    ctx = lambda i, inputs, kwargs: BlockContext(blocks[i], arch.block_name(i), i, inputs, kwargs,  # noqa: E731
                                                 per_block[i], arch, reducer)
    with torch.no_grad(), reuse_freed_memory():
        inputs, kwargs = None, [{} for _ in blocks]
        if calibrated:
            inputs, kwargs = capture_inputs(model, arch, calib_ids, device)
            check_finite(inputs, arch.block_name(0), "its input (the embeddings)")
        start = journal.done if journal is not None else 0
        if start:  # blocks finished by an interrupted run, from the journal
            for i in range(start):
                source.load(i, blocks[i])
                record = journal.restore(i, blocks[i], arch.block_name(i))
                method.restore_block(ctx(i, None, kwargs[i]), record.state)
                source.release(i, blocks[i])
            journal.state.restore_report(report)
            saved, carry = journal.state.next_inputs()
            inputs = saved.to(device) if calibrated else None
            method.restore_carry(carry)
        bar = tqdm(total=len(blocks), initial=start, disable=not progress, desc="quantize", unit="block")
        for i in range(start, len(blocks)):
            block, name = blocks[i], arch.block_name(i)
            source.load(i, block)
            sink.begin_block(i, block)
            home = _block_device(block)
            block.to(device)
            try:
                t0 = time.perf_counter()
                routed = routed_tokens(block, name, inputs, kwargs[i]) if calibrated and per_block[i] else {}
                routed = dict(zip(routed, reducer.sum_ints(list(routed.values()))))
                out = _process(method, ctx(i, inputs, kwargs[i]))
                seconds = time.perf_counter() - t0
                block_inputs = inputs
                inputs, errors = _advance(block, name, inputs, kwargs[i], out, calibrated)
                _static_input_scales(block, name, block_inputs, kwargs[i], out, reducer)
                del block_inputs
                results = {n: r.to(home) for n, r in out.results.items()}
                for n in results:
                    measured = {"rel_mse": errors.get(n)} if calibrated else {}
                    if n in routed:
                        measured["routed_tokens"] = routed[n]
                    report.setdefault(n, {}).update(
                        {"block": i, **measured, "block_seconds": seconds, **out.info.get(n, {})})
                record = BlockRecord(i, name, block, results, {n: report[n] for n in results},
                                     inputs if calibrated else torch.zeros(0), out.state,
                                     method.carry() if journal is not None else {})
            finally:
                block.to(home)
            sink.write_block(record)
            source.release(i, block)
            bar.update(1)
        bar.close()
        fin = method.finish(FinishContext(final_logits(model, arch), len(blocks), reducer))
        for n, extra in fin.info.items():
            report.setdefault(n, {}).update(extra)
        if fin.replace:
            sink.replace(model, fin.replace)
    return kept.results if isinstance(kept, MemorySink) else {}


def _advance(block, name, inputs, kwargs, out: BlockOutput, calibrated: bool):
    """Swap the dequantized weights in; the next block's inputs and the per-layer errors."""
    refs = apply_results(block, name, out.results)
    if not calibrated:
        return None, {}
    # reference matmuls only for layers whose error the method did not report
    need = {n: r for n, r in refs.items() if "rel_mse" not in out.info.get(n, {})}
    next_inputs = out.next_inputs if out.results else None
    if next_inputs is None:
        return _replay(block, name, inputs, kwargs, need)
    errors = _replay(block, name, inputs[:ERROR_SAMPLES], kwargs, need)[1] if need else {}
    return next_inputs, errors


def _static_input_scales(block, name, inputs, kwargs, out: BlockOutput, reducer: Reducer) -> None:
    """Static activation schemes (fp8-tensor-static): each such Linear's input scale, observed
    on the block's calibration inputs with its quantized weights in place (the inputs the
    deployed layer sees), reduced over processes (max)."""
    static = {n: r for n, r in out.results.items() if r.scheme.static_activations}
    if not static:
        return
    if inputs is None:
        raise QuantspecError("static activation scales need calibration data.", "give the recipe calibration data.")
    scales = input_scales(block, name, inputs, kwargs, planned_linears(block, name, static), FP8_MAX)
    for n, r in static.items():
        out.results[n] = replace(r, input_scale=reducer.max(scales[n]))


def _process(method: BlockMethod, ctx: BlockContext) -> BlockOutput:
    if not ctx.plan:
        return BlockOutput({})
    out = method.process_block(ctx)
    missing = set(ctx.plan) - set(out.results)
    if missing:
        raise RuntimeError(f"{type(method).__name__} returned no result for {sorted(missing)}")
    out.results = {n: out.results[n] for n in ctx.plan}
    return out
