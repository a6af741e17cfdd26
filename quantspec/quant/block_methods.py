"""BlockMethods for the calibration engine: GPTQ (true-sequential) and RTN.

GPTQMethod follows the reference GPTQ's ``--true-sequential`` loop: within a block the Linear
groups of the ArchSpec are handled in order; forward pre-hooks collect the Hessians of one
group's Linears on the block's current forward (which stops right after that group), the
group is quantized with ``gptq.gptq_quantize`` and its weights are set to their dequantized
values, so the next group sees already-quantized predecessors. On return the dense weights are
put back (the engine contract); the engine swaps the fake-quant values in.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .calibrate import block_groups, planned_linears, run_linear_inputs
from .gptq import accumulate_hessian, gptq_quantize, make_empty_hessian
from .recipe import GPTQOptions
from .rtn import rtn
from .scheme import QuantResult, QuantScheme


def collect_hessians(
    block: nn.Module,
    block_name: str,
    inputs: torch.Tensor,
    kwargs: dict[str, Any],
    modules: dict[str, nn.Linear],
) -> dict[str, torch.Tensor]:
    """fp32 [K, K] Hessian of each Linear in ``modules`` over the block's calibration inputs.

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
        acc[name][0], acc[name][1] = accumulate_hessian(acc[name][0], x, acc[name][1])

    run_linear_inputs(block, block_name, inputs, kwargs, modules, add)
    return {n: acc[owner[n]][0] for n in modules if n in owner}


class GPTQMethod:
    """GPTQ as a BlockMethod. ``info`` holds per-layer details of the last block."""

    def __init__(self, options: GPTQOptions | None = None, scale_dtype: torch.dtype = torch.float16):
        self.options = options or GPTQOptions()
        self.scale_dtype = scale_dtype
        self.info: dict[str, dict] = {}

    def process_block(
        self,
        block: nn.Module,
        block_name: str,
        inputs: torch.Tensor,
        kwargs: dict[str, Any],
        plan: dict[str, QuantScheme],
        arch: ArchSpec,
    ) -> dict[str, QuantResult]:
        self.info = {}
        modules = planned_linears(block, block_name, plan)
        dense = {n: m.weight.detach().clone() for n, m in modules.items()}
        results: dict[str, QuantResult] = {}
        try:
            for group in block_groups(block, block_name, plan, arch):
                hessians = collect_hessians(
                    block, block_name, inputs, kwargs, {n: modules[n] for n in group}
                )
                for name in group:
                    if name not in hessians:
                        raise QuantspecError(
                            f"{name} is never called by its block's forward, so GPTQ has no "
                            "statistics for it.",
                            "add it to the recipe's ignore list.",
                        )
                    results[name] = self._quantize(name, modules[name], hessians.pop(name), plan[name])
        finally:
            with torch.no_grad():
                for n, w in dense.items():
                    modules[n].weight.copy_(w)
        return results

    def _quantize(self, name: str, mod: nn.Linear, H: torch.Tensor, scheme: QuantScheme) -> QuantResult:
        t0 = time.perf_counter()
        try:
            res, info = gptq_quantize(
                mod.weight, H, scheme,
                damp_percent=self.options.damp_percent,
                block_size=self.options.block_size,
                scale_dtype=self.scale_dtype,
            )
        except QuantspecError as exc:
            raise QuantspecError(f"GPTQ failed on {name}: {exc.problem}", exc.fix) from exc
        with torch.no_grad():
            mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        self.info[name] = {**info, "seconds": time.perf_counter() - t0}
        return res


class RTNMethod:
    """Round-to-nearest as a BlockMethod (no statistics; the inputs are only replayed)."""

    options = None

    def __init__(self, scale_dtype: torch.dtype = torch.float16):
        self.scale_dtype = scale_dtype
        self.info: dict[str, dict] = {}

    def process_block(
        self,
        block: nn.Module,
        block_name: str,
        inputs: torch.Tensor,
        kwargs: dict[str, Any],
        plan: dict[str, QuantScheme],
        arch: ArchSpec,
    ) -> dict[str, QuantResult]:
        self.info = {}
        out = {}
        for name, mod in planned_linears(block, block_name, plan).items():
            t0 = time.perf_counter()
            out[name] = rtn(mod.weight.detach(), plan[name], self.scale_dtype)
            self.info[name] = {"seconds": time.perf_counter() - t0}
        return out
