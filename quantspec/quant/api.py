"""``quantize_model``: quantize a model in memory, as torchao's ``quantize_`` does: every planned
nn.Linear is replaced by a QuantLinear holding its packed weights, run by the fastest kernel
backend here. Saving is a separate step (``quantspec.quantize`` writes a checkpoint folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from .recipe import Recipe
from ..core.scheme import QuantScheme


def quantize_model(
    model: nn.Module,
    recipe: Recipe | str | Path | None = None,
    *,
    tokenizer=None,
    device: str | torch.device | None = None,
    backend: str = "auto",
    overrides: dict[str, QuantScheme] | None = None,
    progress: bool = False,
) -> tuple[nn.Module, dict[str, Any]]:
    """Quantize ``model`` in place with ``recipe`` (a Recipe, YAML path or shipped recipe name;
    None: the default) and return it with a report ``{"layers", "quantized", "dense",
    "regrouped", "backends"}``.

    tokenizer: needed by calibrated methods (every method but RTN). device: where each block is
    processed (default: the model's). backend: the QuantLinear kernel backend ("auto": the
    fastest here). overrides: other schemes for some planned layers (e.g. an 8-bit head).
    The compute dtype of each QuantLinear is that of the Linear it replaces.
    """
    from ..formats import get_format
    from ..kernels.quant_linear import QuantLinear
    from ..models.conv1d import linearize_conv1d
    from ..models.experts import linearize_experts
    from .job import prepare, run
    from .pipeline import resolve_recipe

    recipe = resolve_recipe(recipe)
    fmt = get_format(recipe.format)
    linearize_conv1d(model)
    linearize_experts(model)  # MoE: one Linear per expert (models/experts.py)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    job = prepare(model, tokenizer, recipe, fmt, dev, overrides)
    layers: dict[str, dict] = {}
    results, rest = run(model, job, device=dev, progress=progress, report=layers)
    backends = {}
    for name, result in {**results, **rest}.items():
        lin = model.get_submodule(name)
        qlin = QuantLinear.from_result(result, recipe.format, lin.bias, dtype=lin.weight.dtype).to(lin.weight.device)
        backends[name] = qlin.prepare(backend)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, qlin)
    from ..kernels.cpu_moe import attach_cpu_token
    from ..kernels.moe import attach_grouped

    grouped = attach_grouped(model)
    report = {
        "grouped_experts": grouped,
        "cpu_token_experts": attach_cpu_token(model),
        "layers": layers,
        "quantized": {n: s.short_name for n, s in job.plan.quantize.items()},
        "dense": dict(job.plan.dense),
        "regrouped": dict(job.plan.regrouped),
        "backends": backends,
    }
    return model, report
