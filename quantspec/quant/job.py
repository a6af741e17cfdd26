"""The steps every quantize path shares, from a model module and a recipe to QuantResults:
``prepare`` (method, architecture, plan, calibration ids) and ``run`` (the calibration engine
over the decoder blocks, then RTN for planned Linears outside them). ``pipeline.quantize``
writes a checkpoint from them; ``api.quantize_model`` swaps QuantLinear modules in."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec
from .block_methods import round_layers
from .block_ops import apply_results
from .calibrate import run_blockwise
from .method import BlockMethod
from .moe import plan_moe
from ..models.experts import experts_modules, set_calibration
from .plan import LayerPlan, make_plan
from .precision import emulated_bf16, native_bf16
from .recipe import Recipe
from .registry import build_method, option_sections
from ..core.scheme import QuantResult, QuantScheme


@dataclass
class Job:
    """One recipe on one model: its method, architecture (None: blocks not found, every planned
    Linear is rounded on its own), plan, and calibration ids and description (None without)."""

    recipe: Recipe
    method: BlockMethod
    arch: ArchSpec | None
    plan: LayerPlan
    ids: torch.Tensor | None
    calib: dict | None

    def inside(self, name: str) -> bool:
        """Whether ``name`` lies in a decoder block."""
        return self.arch is not None and name.startswith(self.arch.blocks + ".")

    @property
    def block_plan(self) -> dict[str, QuantScheme]:
        return {n: s for n, s in self.plan.quantize.items() if self.inside(n)}

    @property
    def outside_plan(self) -> dict[str, QuantScheme]:
        return {n: s for n, s in self.plan.quantize.items() if not self.inside(n)}


def prepare(model: nn.Module, tokenizer, recipe: Recipe, fmt, device: torch.device,
            overrides: dict[str, QuantScheme] | None = None) -> Job:
    """Everything checked and chosen before the long work: the method (registry), the
    architecture (refusing a smoothing method on a model without pairs), the plan (with
    ``overrides``: other schemes for some planned layers), the calibration ids."""
    method = build_method(recipe)
    sections = {name: getattr(recipe, name) for name in option_sections(recipe.method)}
    for option in emulated_bf16(sections, native_bf16(device)):
        warnings.warn(f"{option}=bfloat16 on {device.type} without native bf16 products: bf16 is emulated "
                      f"there, slower than float32 ({option}: auto takes float32 on this device).", stacklevel=2)
    if method.needs_calibration and tokenizer is None:
        raise QuantspecError(f"{recipe.method} needs calibration data, so a tokenizer.",
                             "pass the model's tokenizer, or use --method rtn.")
    arch = _arch(model, method, recipe.method)
    experts = experts_modules(model)
    if experts and recipe.calibration.experts == "routed" and method.needs_smoothing:
        raise QuantspecError(f"calibration experts=routed leaves some experts without tokens, which "
                             f"{recipe.method}'s smoothing statistics cannot do without.",
                             "use calibration experts=all (the default) or --method gptq / rtn.")
    set_calibration(model, recipe.calibration.experts if method.needs_calibration else None)
    plan = make_plan(model, recipe.scheme, fmt, recipe.targets, recipe.ignore)
    plan_moe(model, plan)
    for name, scheme in (overrides or {}).items():
        if name in plan.quantize:
            plan.quantize[name] = scheme
    static = recipe.scheme.static_activations  # input scales are calibrated whatever the method
    if static and tokenizer is None:
        raise QuantspecError(f"{recipe.scheme.short_name} calibrates activation scales on text, so it needs a tokenizer.",
                             "pass the model's tokenizer, or use --scheme fp8-dynamic.")
    if static and arch is None:
        raise QuantspecError(f"{recipe.scheme.short_name} calibrates activation scales block by block, but the "
                             "model's decoder blocks were not found.", "use --scheme fp8-dynamic.")
    if static and any(not n.startswith(arch.blocks + ".") for n in plan.quantize):
        outside = sorted(n for n in plan.quantize if not n.startswith(arch.blocks + "."))
        raise QuantspecError(f"{recipe.scheme.short_name} calibrates activation scales inside the decoder blocks; "
                             f"{outside[:3]} lie outside.", "leave them dense (recipe ignore, e.g. lm_head).")
    wants_data = method.needs_calibration or static
    ids, calib = calibration(tokenizer, recipe, device, getattr(model, "config", None)) if wants_data else (None, None)
    if calib is not None and experts:
        calib["experts"] = recipe.calibration.experts
    return Job(recipe, method, arch, plan, ids, calib)


def run(model: nn.Module, job: Job, *, device: torch.device, progress: bool, report: dict,
        resume_dir=None, source=None, sink=None, reducer=None) -> tuple[dict[str, QuantResult], dict[str, QuantResult]]:
    """(block results as the sink keeps them, results of the Linears outside the blocks); each
    layer's details in ``report``."""
    results = {}
    if job.arch is not None:
        try:
            results = run_blockwise(model, job.arch, job.ids, job.method, job.block_plan, device=device, progress=progress,
                                    resume_dir=resume_dir, report=report, source=source, sink=sink, reducer=reducer)
        finally:
            set_calibration(model, None)  # MoE experts back to routed inference
    outside = job.outside_plan
    rest, info = round_layers({n: model.get_submodule(n) for n in outside}, outside)
    apply_results(model, "", rest)
    for n, entry in info.items():
        report.setdefault(n, {}).update(entry)
    return results, rest


def _arch(model: nn.Module, method: BlockMethod, name: str) -> ArchSpec | None:
    """The model's ArchSpec, after refusing a smoothing method on a model without smoothing
    pairs. None for a method that needs no calibration on a model whose blocks cannot be found."""
    from .arch_infer import get_arch

    try:
        arch = get_arch(model)
    except QuantspecError:
        if method.needs_calibration:
            raise
        return None
    check_smoothing(arch, method, model, name)
    return arch


def check_smoothing(arch: ArchSpec, method: BlockMethod, model: nn.Module, name: str) -> None:
    """A smoothing method needs smoothing pairs: refuse, before calibrating, a model with none."""
    if method.needs_smoothing and not arch.smooth:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise QuantspecError(
            f"{name} needs smoothing pairs (a norm or Linear whose output channels can "
            f"absorb a per-channel scale), and none were found in model_type {model_type!r} "
            f"(architecture {arch.name!r})",
            "use --method gptq or rtn for this model, or declare its pairs in an ArchSpec in "
            "quantspec/quant/arch.py (ARCHS).",
        )


def calibration(tokenizer, recipe: Recipe, device: torch.device, config=None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Calibration ids [n, L] and the calibration actually used (for the report). A default
    length (no ``calibration.seqlen``) past the context the model's ``config`` declares is cut
    to it, with a warning and ``seqlen_cut`` in the report (an explicit one is refused earlier:
    ``models.source.check_calibration_seqlen``)."""
    import warnings
    from dataclasses import replace

    from ..data import calibration_samples
    from ..data.fallback import load_or_fallback
    from ..models.source import declared_context

    calib = recipe.calibration.resolved(on_gpu=device.type != "cpu")
    info: dict[str, Any] = {}
    declared = declared_context(config) if config is not None else None
    if recipe.calibration.seqlen is None and declared is not None and declared[1] < calib.seqlen:
        info["seqlen_cut"] = (f"the default calibration length {calib.seqlen} is past the model's context "
                              f"({declared[0]} {declared[1]}): windows of {declared[1]} tokens")
        warnings.warn(info["seqlen_cut"] + ".", stacklevel=2)
        calib = replace(calib, seqlen=declared[1])
    _, source = load_or_fallback(calib.data, "calibration")
    ids = calibration_samples(tokenizer, source, calib.samples, calib.seqlen, calib.seed)
    info = {"data": source.label, "samples": calib.samples, "seqlen": calib.seqlen, "seed": calib.seed, **info}
    return ids, info
