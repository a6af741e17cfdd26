"""Method runners: from a float model and a layer plan to ``{name: QuantResult}``.

RTN needs no data and runs layer by layer. Calibrated methods (GPTQ, AWQ, SmoothQuant and
their combinations) run block by block on the calibration engine (``calibrate.py``); each is
a BlockMethod built from the recipe by the table below.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.fallback import FALLBACK_FROM  # noqa: F401  (eval/compare.py reads it from here)
from ..errors import QuantspecError
from .plan import LayerPlan
from .recipe import Recipe
from .rtn import rtn
from .scheme import QuantResult

# method name -> (module, factory name); the factory takes the Recipe and returns a BlockMethod.
BLOCK_METHODS: dict[str, tuple[str, str]] = {
    "gptq": ("quantspec.quant.block_methods", "gptq_from_recipe"),
    "awq": ("quantspec.quant.awq", "method_from_recipe"),
    "awq+gptq": ("quantspec.quant.awq", "awq_gptq_from_recipe"),
    "smoothquant": ("quantspec.quant.smoothquant", "method_from_recipe"),
}


def run_rtn(model: nn.Module, plan: LayerPlan, progress: bool, report: dict) -> dict[str, QuantResult]:
    results = {}
    modules = dict(model.named_modules())
    for name in tqdm(list(plan.quantize), desc="rtn", disable=not progress, unit="layer"):
        t0 = time.perf_counter()
        w = modules[name].weight.data
        r = rtn(w, plan.quantize[name])
        deq = r.dequantize(torch.float32)
        err = ((deq - w.float()).pow(2).mean() / w.float().pow(2).mean().clamp(min=1e-30)).item()
        modules[name].weight.data = deq.to(w.dtype)
        results[name] = r
        report.setdefault(name, {}).update(
            {"weight_rel_mse": err, "seconds": round(time.perf_counter() - t0, 4)}
        )
    return results


def block_method(recipe: Recipe):
    """The BlockMethod that runs ``recipe`` on the calibration engine (a calibrated method)."""
    return _factory(recipe.method)(recipe)


def _factory(method: str) -> Callable[[Recipe], Any]:
    module, attr = BLOCK_METHODS[method]
    return getattr(importlib.import_module(module), attr)


def run_method(
    model: nn.Module,
    tokenizer,
    plan: LayerPlan,
    recipe: Recipe,
    *,
    device: torch.device,
    progress: bool = True,
    resume_dir=None,
    report: dict | None = None,
) -> tuple[dict[str, QuantResult], dict | None]:
    """Run the recipe's method; returns the results and the calibration actually used."""
    report = {} if report is None else report
    if recipe.method == "rtn":
        return run_rtn(model, plan, progress, report), None
    from .arch_infer import get_arch
    from .calibrate import run_blockwise

    arch = get_arch(model)
    check_smoothing(arch, recipe, model)
    ids, method, info = calibrated_setup(tokenizer, recipe, device)
    results = run_blockwise(
        model, arch, ids, method, plan.quantize,
        device=device, progress=progress, resume_dir=resume_dir, report=report,
    )
    missing = [n for n in plan.quantize if n not in results]
    if missing:  # planned Linears outside the decoder blocks: round to nearest
        rest = LayerPlan(quantize={n: plan.quantize[n] for n in missing})
        results.update(run_rtn(model, rest, progress=False, report=report))
    return results, info


SMOOTHING_METHODS = ("awq", "awq+gptq", "smoothquant")


def check_smoothing(arch, recipe: Recipe, model) -> None:
    """AWQ and SmoothQuant need smoothing pairs: refuse, before calibrating, a model with none."""
    if recipe.method in SMOOTHING_METHODS and not arch.smooth:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise QuantspecError(
            f"{recipe.method} needs smoothing pairs (a norm or Linear whose output channels can "
            f"absorb a per-channel scale), and none were found in model_type {model_type!r} "
            f"(architecture {arch.name!r})",
            "use --method gptq or rtn for this model, or declare its pairs in an ArchSpec in "
            "quantspec/quant/arch.py (ARCHS).",
        )


def calibrated_setup(tokenizer, recipe: Recipe, device: torch.device):
    """Calibration ids [n, L], the recipe's BlockMethod, and the calibration actually used."""
    from ..data import calibration_samples
    from ..data.fallback import load_or_fallback

    calib = recipe.calibration.resolved(on_gpu=device.type != "cpu")
    _, source = load_or_fallback(calib.data, "calibration")
    ids = calibration_samples(tokenizer, source, calib.samples, calib.seqlen, calib.seed)
    method = block_method(recipe)
    info = {"data": source.label, "samples": calib.samples, "seqlen": calib.seqlen, "seed": calib.seed}
    return ids, method, info
