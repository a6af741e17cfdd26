"""BlockMethods for the calibration engine: GPTQ (true-sequential) and RTN.

GPTQMethod follows the reference GPTQ's ``--true-sequential`` loop, in one of two ways:

- single pass (when the activations of the whole calibration set fit in
  ``GPTQOptions.single_pass_gb``, by default half the memory free when the first block starts,
  and the block treats the samples of a batch independently):
  the block runs once on all samples as one batch; a forward pre-hook on each planned Linear
  forms the Hessian from the input it receives, quantizes the Linear and sets its weight to
  the dequantized values before the Linear runs. Every Linear thus sees
  already-quantized predecessors, and the forward's output is the next block's input (handed
  to the engine as ``outputs``, so no replay is needed). Linears called on the same tensors
  (q/k/v, gate/up) share one Hessian. One block forward instead of one per group plus a replay.
- per group: the Linear groups of the ArchSpec are handled in order; pre-hooks collect one
  group's Hessians on a forward that stops right after that group, sample by sample.

On return the dense weights are put back (the engine contract); the engine swaps the
fake-quant values in.

RTNMethod rounds each planned Linear to nearest; it needs no calibration (``round_layers`` does
the same for Linears outside the decoder blocks).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import QuantspecError
from .block_ops import block_groups, block_outputs, check_finite, never_called, planned_linears, run_linear_inputs
from .distributed import Reducer
from .fused_scales import block_global_scales
from .heap import free_memory_bytes
from .precision import forward_precision, native_bf16, precision_name
from .gptq import accumulate_hessian, asymmetric_target, gptq_quantize_with_values, make_empty_hessian
from .hessian import cross_term, weight_cross_term
from .method import BlockContext, BlockMethod, BlockOutput
from .options import GPTQOptions
from .rtn import rtn
from ..core.scheme import QuantResult, QuantScheme

if TYPE_CHECKING:
    from .recipe import Recipe


def collect_hessians(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    modules: dict[str, nn.Linear],
    rows: dict[str, int] | None = None,
    bf16: bool = False,
) -> dict[str, torch.Tensor]:
    """fp32 [K, K] Hessian of each Linear in ``modules`` over the block's calibration inputs;
    ``rows`` (if given) receives how many input rows made each; ``bf16``: products of inputs
    rounded to bf16 (``hessian.gram_bf16``).

    Linears that read the same tensor (q/k/v, gate/up) share one Hessian (computed once; the
    returned dict holds the same tensor under each of their names).
    """
    device = inputs.device
    acc: dict[str, list] = {}
    owner: dict[str, str] = {}  # name -> the name whose Hessian it shares
    last: list = [None, None]  # (tensor, name) of the latest call, kept alive: no id reuse

    def add(name: str, x: torch.Tensor) -> None:
        if x is last[0] and (owner.get(name, last[1]) == last[1]):
            owner[name] = owner.get(last[1], last[1])
            return
        last[0], last[1] = x, name
        owner[name] = name
        if name not in acc:
            acc[name] = [make_empty_hessian(x.shape[-1], device), 0]
        acc[name][0], acc[name][1] = accumulate_hessian(acc[name][0], x, acc[name][1], bf16)

    run_linear_inputs(block, block_name, inputs, kwargs, modules, add)
    if rows is not None:
        rows.update({n: acc[owner[n]][1] for n in modules if n in owner})
    return {n: acc[owner[n]][0] for n in modules if n in owner}


def relative_output_error(dense: torch.Tensor, deq: torch.Tensor, H: torch.Tensor) -> float:
    """``||X dW^T||^2 / ||X W^T||^2`` over the rows X that made ``H`` (~ X^T X), dW = deq - W.

    The relative output MSE of a Linear (bias left out) from its Hessian, with no forward.
    """
    W = dense.to(device=H.device, dtype=torch.float32)
    D = deq.to(device=H.device, dtype=torch.float32) - W
    num = float(((D @ H) * D).sum())
    den = float(((W @ H) * W).sum())
    return max(num, 0.0) / max(den, 1e-30)


def single_pass_bytes(modules: dict[str, nn.Module], inputs: torch.Tensor) -> int:
    """Rough bytes of the activations alive while a block of ``modules`` runs on all of
    ``inputs`` at once (hidden states in and out, residual, and three of the widest outputs)."""
    tokens = inputs.shape[0] * inputs.shape[1]
    widest = max([m.out_features for m in modules.values() if isinstance(m, nn.Linear)] + [inputs.shape[-1]])
    return tokens * (4 * inputs.shape[-1] + 3 * widest) * max(inputs.element_size(), 4)


def float_stream_bytes(modules: dict[str, nn.Module], inputs: torch.Tensor) -> int:
    """Rough bytes that asymmetric calibration keeps alive on top of ``single_pass_bytes``: the
    float model's hidden states after the block and the float input of each planned Linear
    (one per distinct input width, plus a second hidden-size one: attention and MLP read
    different tensors of that width)."""
    tokens = inputs.shape[0] * inputs.shape[1]
    widths = {m.in_features for m in modules.values() if isinstance(m, nn.Linear)}
    return tokens * (2 * inputs.shape[-1] + sum(widths)) * max(inputs.element_size(), 4)


def single_pass_limit(options: GPTQOptions, device: torch.device) -> float:
    """Bytes of block activations up to which the single pass runs: ``options.single_pass_gb``
    GiB, or (None) half the memory free on ``device`` (2 GiB where that is unknown)."""
    if options.single_pass_gb is not None:
        return options.single_pass_gb * 2**30
    free = free_memory_bytes(device)
    return free / 2 if free is not None else 2 * 2**30


def hessian_bf16(options: GPTQOptions, device: torch.device) -> bool:
    """Whether the Hessians' products run in bf16: ``options.hessian_dtype``, where ``auto`` is
    bf16 on a CPU that multiplies bf16 natively and fp32 elsewhere (a GPU's fp32 Gram is cheap)."""
    if options.hessian_dtype == "auto":
        return device.type == "cpu" and native_bf16(device)
    return options.hessian_dtype == "bfloat16"


class GPTQMethod(BlockMethod):
    """GPTQ as a BlockMethod: per-layer details (including ``rel_mse``) in the output's info,
    and the block's output with quantized weights as the next inputs when the single pass ran."""

    data_parallel = True  # Hessians reduced across processes (BlockContext.reducer)

    def __init__(self, options: GPTQOptions | None = None, scale_dtype: torch.dtype = torch.float16):
        super().__init__(options or GPTQOptions(), scale_dtype)
        self.info: dict[str, dict] = {}
        self._batches: dict[tuple, bool] = {}
        self._gscales: dict[str, torch.Tensor] = {}  # the block's NVFP4 global scales (fused_scales.py)
        self._limit: float | None = None  # single_pass_limit, fixed at the first block of a run
        self._bf16: bool | None = None  # hessian_bf16, fixed at the first block of a run
        # asymmetric: the float model's hidden states entering block _fp_next (None: none yet;
        # block 0's inputs are the float model's)
        self._fp_stream: torch.Tensor | None = None
        self._fp_next = 0

    def carry(self) -> dict[str, torch.Tensor]:
        if self._fp_stream is None:
            return {}
        return {"fp_stream": self._fp_stream, "fp_next": torch.tensor(self._fp_next)}

    def restore_carry(self, state: dict[str, torch.Tensor]) -> None:
        self._fp_stream = state.get("fp_stream")
        self._fp_next = int(state["fp_next"]) if "fp_next" in state else 0

    def _single_pass_ok(self, block, inputs, kwargs, reducer: Reducer | None = None, asym: bool = False) -> bool:
        """Whether the single pass applies (the same answer in every process); ``asym``: with
        asymmetric calibration's float stream."""
        return (reducer or Reducer()).all_true(self._single_pass_fits(block, inputs, kwargs, asym))

    def _single_pass_fits(self, block, inputs, kwargs, asym: bool = False) -> bool:
        if self._limit is None:  # once: a run does not switch paths as its memory use moves
            self._limit = single_pass_limit(self.options, inputs.device)
        mods = dict(block.named_modules())
        need = single_pass_bytes(mods, inputs)
        if asym:  # the float stream and the float inputs it keeps
            need += float_stream_bytes(mods, inputs)
        if need > self._limit:
            return False
        if inputs.shape[0] < 2:
            return True
        key = (type(block), tuple(sorted((k, id(v)) for k, v in kwargs.items())))
        if key not in self._batches:  # does the block treat the samples of a batch independently?
            try:
                both = block_outputs(block, inputs[:2], kwargs)
            except (RuntimeError, ValueError):  # kwargs made for one sample (Bloom's alibi is [heads, 1, L];
                # XGLM checks its attention mask's batch size)
                self._batches[key] = False
                return False
            each = torch.cat([block_outputs(block, inputs[j : j + 1], kwargs) for j in range(2)])
            err = (both.float() - each.float()).norm() / each.float().norm().clamp(min=1e-30)
            self._batches[key] = bool(err < (1e-4 if inputs.dtype == torch.float32 else 1e-2))
        return self._batches[key]

    def _float_pass(self, block, inputs, kwargs, modules, index: int,
                    precision) -> tuple[dict[str, torch.Tensor], bool]:
        """Asymmetric calibration: run the block with its float weights on the float model's
        hidden states, under ``precision`` (gptq.forward_dtype's context factory); returns each
        planned Linear's input there (its first call) and whether
        the float stream restarted here, and keeps the block's output as the next block's
        float stream. The stream restarts from the quantized model's inputs where the block
        before had nothing planned (the engine, not the method, ran it)."""
        follows = self._fp_stream is not None and self._fp_next == index
        fp_in = self._fp_stream.to(inputs.device) if follows else inputs
        seen: dict[str, torch.Tensor] = {}

        def hook(name: str):
            def pre(mod, args):
                seen.setdefault(name, args[0])

            return pre

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
        try:
            with precision():
                self._fp_stream = block_outputs(block, fp_in, kwargs).to(fp_in.dtype)  # the stream stays fp32
        finally:
            for h in handles:
                h.remove()
        self._fp_next = index + 1
        return seen, not follows and index > 0

    def _single_pass(self, block, block_name, inputs, kwargs, modules, plan, reducer, index,
                     asym: bool = False) -> BlockOutput:
        results: dict[str, QuantResult] = {}
        last: list = [None, None, 0, None]  # (input, its Hessian, rows, cross term): kept alive, shared by q/k/v
        precision = forward_precision(block, self.options.forward_dtype)
        fp_inputs, restarted = (self._float_pass(block, inputs, kwargs, modules, index, precision)
                                if asym else ({}, False))

        def hook(name: str):
            def pre(mod, args):
                # the forward may run under bf16 autocast (gptq.forward_dtype); the statistics and
                # the solve never do
                with torch.autocast(args[0].device.type, enabled=False):
                    quantize_at_call(name, mod, args[0])

            return pre

        def quantize_at_call(name: str, mod: nn.Module, x: torch.Tensor) -> None:
            if name in results:  # called twice in one forward: quantized at the first call
                return
            if last[0] is not x:
                H, _ = accumulate_hessian(make_empty_hessian(x.shape[-1], x.device), x, 0, self._bf16)
                if not torch.isfinite(H).all():  # cheaper than scanning x; NaN/Inf in x reach H
                    check_finite(x, block_name, f"the input of {name}")
                last[0] = x
                last[1], last[2] = reducer.hessian(H, x.numel() // max(x.shape[-1], 1))
                last[3] = None  # the cross term, computed for the first Linear that needs it
            xf = fp_inputs.get(name)
            cross = None
            if xf is not None and xf.shape == x.shape:
                if 2 * mod.out_features < x.shape[-1]:  # W C directly: cheaper than C for a wide K
                    cross = weight_cross_term(mod.weight, xf, x, self._bf16)
                else:
                    if last[3] is None:
                        last[3] = cross_term(xf, x, self._bf16)
                    cross = mod.weight.detach().float() @ last[3]
            results[name] = self._quantize(name, mod, last[1], plan[name], last[2], cross)
            if asym and cross is None:
                self.info[name]["asymmetric"] = (
                    "off: the float and quantized forwards gave it different rows (routing)"
                    if name in fp_inputs else "off: the float forward did not call it")
            elif restarted and self.info[name].get("asymmetric") == "on":
                self.info[name]["asymmetric"] = ("on, from this block's quantized inputs (the block before had nothing "
                                                  "planned or ran plain GPTQ)")

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
        try:
            with precision():
                outputs = block_outputs(block, inputs, kwargs).to(inputs.dtype)  # the stream stays fp32
        finally:
            for h in handles:
                h.remove()
        check_finite(outputs, block_name, "its output")
        for name in modules:
            if name not in results:
                raise never_called(name, "GPTQ")
            self.info[name].update(gptq_pass="single", forward_dtype=precision_name(block, precision))
        return BlockOutput(results, self.info, next_inputs=outputs)

    def process_block(self, ctx: BlockContext) -> BlockOutput:
        block, block_name, inputs, kwargs, plan = ctx.block, ctx.name, ctx.inputs, ctx.kwargs, ctx.plan
        self.info = {}
        modules = planned_linears(block, block_name, plan)
        dense = {n: m.weight.detach().clone() for n, m in modules.items()}
        self._gscales = block_global_scales(block, block_name, plan, ctx.arch)  # NVFP4: one per fused siblings
        if self._bf16 is None:
            self._bf16 = hessian_bf16(self.options, inputs.device)
        asym, off = self._asymmetric_here(block, block_name, inputs, kwargs, ctx.reducer)
        results: dict[str, QuantResult] = {}
        try:
            if asym:
                return self._single_pass(block, block_name, inputs, kwargs, modules, plan, ctx.reducer, ctx.index, True)
            if off:  # auto, and this block cannot run it: the next one restarts the float stream
                self._fp_stream = None
            if self._single_pass_ok(block, inputs, kwargs, ctx.reducer):
                out = self._single_pass(block, block_name, inputs, kwargs, modules, plan, ctx.reducer, ctx.index)
                return self._say_off(out, off)
            for group in block_groups(block, block_name, plan, ctx.arch):
                rows: dict[str, int] = {}
                hessians = collect_hessians(
                    block, block_name, inputs, kwargs, {n: modules[n] for n in group}, rows, self._bf16
                )
                hessians, rows = _reduced(hessians, rows, group, ctx.reducer)
                for name in group:
                    if name not in hessians:
                        raise never_called(name, "GPTQ")
                    results[name] = self._quantize(name, modules[name], hessians.pop(name), plan[name], rows[name])
                    self.info[name].update(gptq_pass="per-group", forward_dtype=precision_name(block, contextlib.nullcontext))
        finally:
            with torch.no_grad():
                for n, w in dense.items():
                    modules[n].weight.copy_(w)
        return self._say_off(BlockOutput(results, self.info), off)

    def _asymmetric_here(self, block, block_name, inputs, kwargs, reducer: Reducer) -> tuple[bool, str | None]:
        """Whether this block runs asymmetric calibration (one process, and the single pass with
        the float stream within the limit), and why not where ``auto`` does not; ``true`` raises
        there instead."""
        explicit = self.options.asymmetric is True
        if self.options.asymmetric is False:
            return False, None
        if reducer.active:
            if explicit:
                raise QuantspecError("gptq.asymmetric does not split its calibration across processes.",
                                     "run it in one process (without torchrun), or drop gptq.asymmetric.")
            return False, "off (auto): the calibration is split across processes"
        if self._single_pass_ok(block, inputs, kwargs, reducer, asym=True):
            return True, None
        if explicit:
            raise QuantspecError(
                f"gptq.asymmetric needs the single pass, and {block_name} takes the per-group path "
                f"(its activations and the float stream exceed gptq.single_pass_gb, or the block does not batch).",
                "raise gptq.single_pass_gb (or give fewer calibration samples), use gptq.asymmetric: auto "
                "(plain GPTQ where it cannot run), or drop it.")
        return False, ("off (auto): the single pass with the float stream exceeds gptq.single_pass_gb, "
                       "or the block does not batch")

    @staticmethod
    def _say_off(out: BlockOutput, off: str | None) -> BlockOutput:
        if off:
            for name in out.results:
                out.info[name]["asymmetric"] = off
        return out

    def _quantize(self, name: str, mod: nn.Linear, H: torch.Tensor, scheme: QuantScheme, rows: int,
                  cross: torch.Tensor | None = None) -> QuantResult:
        """GPTQ of ``mod`` under ``H``; ``cross`` (asymmetric): W C, which moves the weight rounded
        (``gptq.asymmetric_target``)."""
        t0 = time.perf_counter()
        gscale = self._gscales.get(name)
        if rows < self.options.min_rows:  # e.g. a MoE expert the router sent no token
            res = rtn(mod.weight.detach(), scheme, self.scale_dtype, gscale)
            with torch.no_grad():
                mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
            self.info[name] = {"fallback": f"round-to-nearest: {rows} calibration rows, fewer than gptq.min_rows="
                                           f"{self.options.min_rows}", "seconds": time.perf_counter() - t0}
            return res
        try:
            target, shift = mod.weight, None
            if cross is not None:
                target = asymmetric_target(mod.weight, H, cross * self.options.asymmetric_alpha, self.options.damp_percent)
                w32 = mod.weight.detach().float()
                shift = float((target - w32).norm() / w32.norm().clamp(min=1e-30))
                if shift > self.options.asymmetric_max_shift:
                    target = mod.weight
            res, deq, info = gptq_quantize_with_values(
                target, H, scheme,
                damp_percent=self.options.damp_percent,
                block_size=self.options.block_size,
                scale_dtype=self.scale_dtype,
                gscale=gscale,
            )
        except QuantspecError as exc:
            raise QuantspecError(f"GPTQ failed on {name}: {exc.problem}", exc.fix) from exc
        info["rel_mse"] = relative_output_error(mod.weight, deq, H)
        with torch.no_grad():
            mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        self.info[name] = {**info, "hessian_dtype": "bfloat16" if self._bf16 else "float32",
                           **({} if shift is None else {"asymmetric_shift": shift, "asymmetric": "on" if target is not mod.weight else
                                  f"off: the correction would move the weight by {shift:.3g} of its norm "
                                  f"(gptq.asymmetric_max_shift={self.options.asymmetric_max_shift:g})"}),
                           "seconds": time.perf_counter() - t0}
        return res


def _reduced(hessians: dict[str, torch.Tensor], rows: dict[str, int], group: list[str], reducer):
    """Each distinct Hessian of ``group`` (q/k/v share one) reduced across processes, in the
    group's order (the same in every process)."""
    if not reducer.active:
        return hessians, rows
    done: dict[int, tuple[torch.Tensor, int]] = {}
    out_h, out_rows = {}, {}
    for name in group:  # a Linear the forward never called is missing in every process alike
        if name not in hessians:
            continue
        H = hessians[name]
        if id(H) not in done:
            done[id(H)] = reducer.hessian(H, rows[name])
        out_h[name], out_rows[name] = done[id(H)]
    return out_h, out_rows


def gptq_from_recipe(recipe: "Recipe") -> GPTQMethod:
    """The GPTQ BlockMethod for a Recipe (``recipe.gptq`` options)."""
    return GPTQMethod(recipe.gptq)


class RTNMethod(BlockMethod):
    """Round-to-nearest as a BlockMethod: no statistics, so no calibration needed (given
    calibration data, the engine still replays the block and measures each layer's error)."""

    needs_calibration = False
    data_parallel = True  # nothing to reduce

    def __init__(self, scale_dtype: torch.dtype = torch.float16):
        super().__init__(None, scale_dtype)

    def process_block(self, ctx: BlockContext) -> BlockOutput:
        gscales = block_global_scales(ctx.block, ctx.name, ctx.plan, ctx.arch)
        return BlockOutput(*round_layers(planned_linears(ctx.block, ctx.name, ctx.plan), ctx.plan,
                                         self.scale_dtype, gscales))


def round_layers(modules: dict[str, nn.Linear], plan: dict[str, QuantScheme],
                 scale_dtype: torch.dtype = torch.float16, gscales: dict[str, torch.Tensor] | None = None,
                 ) -> tuple[dict[str, QuantResult], dict[str, dict]]:
    """RTN of each Linear of ``modules`` with its scheme in ``plan``: (results, per-layer info:
    ``weight_rel_mse`` = ||W - Q(W)||^2 / ||W||^2 and ``seconds``). Weights are not changed.
    ``gscales``: NVFP4 global scales shared by fused siblings (``fused_scales.py``)."""
    results, info = {}, {}
    for name, mod in modules.items():
        t0 = time.perf_counter()
        w = mod.weight.detach()
        results[name] = rtn(w, plan[name], scale_dtype, (gscales or {}).get(name))
        deq = results[name].dequantize(torch.float32)
        err = ((deq - w.float()).pow(2).mean() / w.float().pow(2).mean().clamp(min=1e-30)).item()
        info[name] = {"weight_rel_mse": err, "seconds": round(time.perf_counter() - t0, 4)}
    return results, info
