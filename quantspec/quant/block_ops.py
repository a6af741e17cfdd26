"""Operations on one decoder block that the calibration engine and the methods share: run it,
feed its Linears' inputs to a function, group and find its planned Linears.

A leaf module: it imports nothing of the engine or of any method.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .capture import StopBlock
from ..core.scheme import QuantResult, QuantScheme


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


def never_called(name: str, method: str) -> QuantspecError:
    """A planned Linear its block's forward never calls (TrOCR's cross-attention without encoder states)."""
    return QuantspecError(f"{name} is never called by its block's forward, so {method} has no statistics for it.",
                          "add it to the recipe's ignore list.")


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
    groups = [[f"{block_name}.{r}" for r in g if f"{block_name}.{r}" in plan] for g in arch.groups_in(block)]
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


def relative(name: str, block_name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``mlp.up_proj`` for block ``model.layers.3`` ('' = no block)."""
    return name[len(block_name) + 1 :] if block_name else name


def apply_results(block: nn.Module, block_name: str, results: dict[str, QuantResult]) -> dict:
    """Swap dequantized weights in (``block_name`` '' when ``block`` is the model); returns
    {name: (module, dense weight)}."""
    refs = {}
    for name, res in results.items():
        mod = block.get_submodule(relative(name, block_name))
        dense = mod.weight.detach().clone()
        with torch.no_grad():
            mod.weight.copy_(res.dequantize(mod.weight.dtype).to(mod.weight.device))
        refs[name] = (mod, dense)
    return refs


def input_scales(block: nn.Module, block_name: str, inputs: torch.Tensor, kwargs: dict[str, Any],
                 modules: dict[str, nn.Module], top: float) -> dict[str, torch.Tensor]:
    """fp32 [1] per Linear of ``modules``: the max |input| over the samples ``inputs``, / ``top``
    (a static activation scale: FP8's 448); a layer that saw only zeros gets 1."""
    amax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        m = x.detach().abs().amax().float().reshape(1).cpu()
        amax[name] = torch.maximum(amax[name], m) if name in amax else m

    run_linear_inputs(block, block_name, inputs, kwargs, modules, record)
    return {n: torch.where(a > 0, a / top, torch.ones_like(a)) for n, a in amax.items()}
