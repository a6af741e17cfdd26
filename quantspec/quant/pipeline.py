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

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"  # a link to the repo's recipes/, shipped in the wheel


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


def want_streaming(streaming: bool | None, folder: Path) -> bool:
    """Stream when asked; by default whenever it can: the weights are safetensors files and the
    architecture has a declaration (the generic fallback needs a real forward to find its
    groups, which the meta-device model of the streaming path cannot run)."""
    if streaming is not None:
        return streaming
    import json

    from .arch import ARCHS

    folder = Path(folder)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return model_type in ARCHS and any(folder.glob("*.safetensors"))


def quantize(
    model: str | None = None,
    recipe: Recipe | str | Path | None = None,
    out: str | Path | None = None,
    *,
    overwrite: bool = False,
    device: str | None = None,
    resume: bool = False,
    progress: bool = True,
    streaming: bool | None = None,
) -> QuantizeOutcome:
    """Quantize ``model`` (hub id, local folder, .gguf file, alias; None = smollm2-135m) with
    ``recipe`` and write the checkpoint to ``out`` (default ./quantspec-out/<model>-<recipe>/).

    streaming: read and write one decoder block at a time, so peak memory is one block plus
    the calibration activations (models larger than RAM); None = whenever possible (see
    ``want_streaming``). resume: journal every finished block in ``.<out>.resume/`` beside
    ``out`` and continue from it after an interruption (either path; removed once the
    checkpoint is written); the report's ``resumed_blocks`` counts the blocks reused.
    Bad input (unknown model, impossible scheme, existing output folder) raises QuantspecError
    before any long work starts.
    """
    from ..checkpoint.atomic import check_destination
    from ..formats import get_format
    from ..models import dense_folder, model_slug, resolve_device

    recipe = resolve_recipe(recipe)
    fmt = get_format(recipe.format)
    out = Path(out) if out is not None else default_out(model_slug(model), recipe)
    check_destination(out, overwrite)
    dev = resolve_device(device)
    report: dict[str, Any] = {"layers": {}}
    resume_dir = resume_folder(out) if resume else None
    if want_streaming(streaming, dense_folder(model)):
        _quantize_streaming(model, recipe, fmt, out, dev, overwrite, progress, resume_dir, report)
    else:
        _quantize_in_memory(model, recipe, fmt, out, dev, overwrite, progress, resume_dir, report)
    if resume_dir is not None:
        import shutil

        shutil.rmtree(resume_dir, ignore_errors=True)
    return QuantizeOutcome(out=out, report=report, recipe=recipe)


def resume_folder(out: Path) -> Path:
    """Where a ``resume`` run journals its finished blocks: a hidden sibling of ``out``."""
    return out.parent / f".{out.name}.resume"


def _quantize_in_memory(model, recipe, fmt, out, dev, overwrite, progress, resume_dir, report) -> None:
    from ..models import load_dense
    from ..models.conv1d import linearize_conv1d
    from .methods import run_method
    from .pack import build_checkpoint
    from .plan import make_plan

    t_load = time.perf_counter()
    dense, tokenizer, info = load_dense(model, dtype=torch.float32, device="cpu")
    linearize_conv1d(dense)  # GPT-2 style models: their Conv1D projections as nn.Linear
    load_seconds = time.perf_counter() - t_load
    plan = make_plan(dense, recipe.scheme, fmt, recipe.targets, recipe.ignore)
    t0 = time.perf_counter()
    results, calib = run_method(
        dense, tokenizer, plan, recipe, device=dev, progress=progress,
        resume_dir=resume_dir, report=report["layers"],
    )
    fill_report(report, recipe, fmt, plan, calib, time.perf_counter() - t0, dev,
                model=info.name, source=str(info.path), load_seconds=load_seconds, streaming=False)
    build_checkpoint(
        out, dense, tokenizer, results, plan, recipe, fmt, save_dtype_for(dense.config), report, overwrite
    )


def _quantize_streaming(model, recipe, fmt, out, dev, overwrite, progress, resume_dir, report) -> None:
    from ..checkpoint.save import write_metadata
    from ..models import dense_folder, load_tokenizer, model_slug
    from .streaming import quantize_streaming

    folder = dense_folder(model)
    tokenizer = load_tokenizer(folder)

    def finish(tmp, dense, plan, calib, seconds, config):
        fill_report(report, recipe, fmt, plan, calib, seconds, dev,
                    model=model_slug(model), source=str(folder), load_seconds=0.0, streaming=True)
        write_metadata(tmp, config, tokenizer=tokenizer,
                       generation_config=getattr(dense, "generation_config", None),
                       recipe_yaml=recipe.to_yaml(), report=report)

    quantize_streaming(
        folder, tokenizer, recipe, fmt, out, overwrite=overwrite, device=dev, progress=progress,
        report=report["layers"], save_dtype_for=save_dtype_for, finish=finish, resume_dir=resume_dir,
    )


def fill_report(report, recipe, fmt, plan, calib, seconds, dev, **fields) -> None:
    """quant_report.json: what was done, to which layer, how long it took, with which versions."""
    report.update(
        {
            **fields,
            "method": recipe.method,
            "format": fmt.name,
            "scheme": recipe.scheme.to_dict(),
            "calibration": calib,
            "quantize_seconds": round(seconds, 3),
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
    report["resumed_blocks"] = len({e["block"] for e in report["layers"].values() if e.get("resumed")})
    for name, reason in plan.dense.items():
        report["layers"].setdefault(name, {})["status"] = f"dense: {reason}"
    for name, scheme in plan.quantize.items():
        entry = report["layers"].setdefault(name, {})
        entry["status"] = "quantized"
        entry["scheme"] = scheme.short_name
        if name in plan.regrouped:
            entry["note"] = plan.regrouped[name]
