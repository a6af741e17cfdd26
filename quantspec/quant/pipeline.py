"""``quantize()``: load a dense model, run a recipe's method, pack, write a checkpoint.

    model spec --load_dense--> float model --plan--> layers to quantize
      --method (rtn | gptq | awq | smoothquant | awq+gptq)--> {name: QuantResult}
      --format.pack--> named tensors --write_checkpoint--> folder (atomic)

The method runners live in ``methods.py``; this file only sequences the steps.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import QuantspecError
from .recipe import Recipe

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


@dataclass
class QuantizeOutcome:
    out: Path
    report: dict[str, Any]
    recipe: Recipe


def resolve_recipe(recipe: Recipe | str | Path | None) -> Recipe:
    """A Recipe, a YAML path, the name of a shipped recipe (recipes/NAME.yaml), or the default."""
    if recipe is None:
        return Recipe()
    if isinstance(recipe, Recipe):
        return recipe
    p = Path(recipe)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return Recipe.from_yaml(p)
    shipped = RECIPES_DIR / f"{recipe}.yaml"
    if shipped.is_file():
        return Recipe.from_yaml(shipped)
    names = sorted(f.stem for f in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    raise QuantspecError(
        f"unknown recipe {recipe!r}.", f"give a YAML path or one of {names or ['(none shipped)']}."
    )


def default_out(model_slug: str, recipe: Recipe) -> Path:
    return Path("quantspec-out") / f"{model_slug}-{recipe.name}"


def save_dtype_for(config) -> torch.dtype:
    """Dense tensors are stored in the model's own half dtype, else fp16 (what engines expect)."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if d in (torch.float16, torch.bfloat16) else torch.float16


def quantize(
    model: str | None = None,
    recipe: Recipe | str | Path | None = None,
    out: str | Path | None = None,
    *,
    overwrite: bool = False,
    device: str | None = None,
    resume: bool = False,
    progress: bool = True,
) -> QuantizeOutcome:
    """Quantize ``model`` (hub id, local folder, .gguf file, alias; None = smollm2-135m) with
    ``recipe`` and write the checkpoint to ``out`` (default ./quantspec-out/<model>-<recipe>/).

    Bad input (unknown model, impossible scheme, existing output folder) raises QuantspecError
    before any long work starts.
    """
    from ..checkpoint.atomic import check_destination
    from ..formats import get_format
    from ..models import load_dense, model_slug
    from .methods import run_method
    from .pack import build_checkpoint

    recipe = resolve_recipe(recipe)
    fmt = get_format(recipe.format)
    out = Path(out) if out is not None else default_out(model_slug(model), recipe)
    check_destination(out, overwrite)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    t_load = time.perf_counter()
    dense, tokenizer, info = load_dense(model, dtype=torch.float32, device="cpu")
    load_seconds = time.perf_counter() - t_load
    save_dtype = save_dtype_for(dense.config)

    from .plan import make_plan

    plan = make_plan(dense, recipe.scheme, fmt, recipe.targets, recipe.ignore)
    report: dict[str, Any] = {"layers": {}}
    t0 = time.perf_counter()
    results, calib = run_method(
        dense, tokenizer, plan, recipe, device=dev, progress=progress,
        resume_dir=(out.parent / f".{out.name}.resume") if resume else None,
        report=report["layers"],
    )
    quant_seconds = time.perf_counter() - t0

    report.update(
        {
            "model": info.name,
            "source": str(info.path),
            "method": recipe.method,
            "format": fmt.name,
            "scheme": recipe.scheme.to_dict(),
            "calibration": calib,
            "quantize_seconds": round(quant_seconds, 3),
            "load_seconds": round(load_seconds, 3),
            "device": str(dev),
            "versions": {
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "python": platform.python_version(),
            },
            "dense_layers": plan.dense,
            "regrouped_layers": plan.regrouped,
        }
    )
    for name, reason in plan.dense.items():
        report["layers"].setdefault(name, {})["status"] = f"dense: {reason}"
    for name, scheme in plan.quantize.items():
        entry = report["layers"].setdefault(name, {})
        entry["status"] = "quantized"
        entry["scheme"] = scheme.short_name
        if name in plan.regrouped:
            entry["note"] = plan.regrouped[name]
    build_checkpoint(
        out, dense, tokenizer, results, plan, recipe, fmt, save_dtype, report, overwrite
    )
    if resume:
        import shutil

        shutil.rmtree(out.parent / f".{out.name}.resume", ignore_errors=True)
    return QuantizeOutcome(out=out, report=report, recipe=recipe)
