"""``quantize()``: one path from a model spec and a recipe to a checkpoint folder.

    model spec --> source: resident (load_dense) or lazy (meta model + shards, ``sources.py``)
      --plan--> layers to quantize --registry.build_method--> BlockMethod
      --calibrate.run_blockwise(source, sink)--> results (in memory, or packed per block into
        the checkpoint's shards: ``sinks.py``), journaled when resuming
      --RTN for planned Linears outside the decoder blocks--> the rest of the checkpoint
      --> config, tokenizer, recipe.yaml, quant_report.json, checksums, all in a temporary
      folder renamed into place (``checkpoint/atomic.py``)

``quantize_model`` (``api.py``) is the same up to the results, in memory, without a folder.
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
    written: bool = True  # False in a data-parallel helper process (rank > 0), which writes nothing


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
    names = sorted(f.stem for f in RECIPES_DIR.glob("*.yaml") if not f.stem.startswith("sweep-")) if RECIPES_DIR.is_dir() else []
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
    """Stream when asked; by default whenever it can: the weights are safetensors files, the
    architecture has a declaration (the generic fallback needs a real forward to find its
    groups, which the meta-device model of the streaming path cannot run), and MoE experts, if
    any, are stored one per expert (GPT-OSS keeps them fused on disk: read whole)."""
    if streaming is not None:
        return streaming
    import json

    from .arch import ARCHS

    from ..models.experts import LAYOUTS

    folder = Path(folder)
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    fused = model_type in LAYOUTS and LAYOUTS[model_type].fused_on_disk  # experts split in memory only
    return model_type in ARCHS and not fused and any(folder.glob("*.safetensors"))


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
    before any long work starts. Under ``torchrun --nproc-per-node N`` the calibration samples
    are split across the N processes (``distributed.py``) and rank 0 writes the checkpoint.
    """
    from ..checkpoint.atomic import atomic_folder, check_destination
    from ..checkpoint.checksums import write_manifest
    from ..checkpoint.save import CHECKPOINT_MARKS, write_metadata, write_safetensors
    from ..formats import get_format
    from ..models import dense_folder, model_slug, resolve_device
    from ..models.experts import key_map
    from ..models.source import check_calibration_seqlen
    from .distributed import from_environment, local_device
    from .job import prepare, run
    from .opened import Lazy, Resident
    from .pack import checkpoint_config, checkpoint_state

    recipe = resolve_recipe(recipe)
    check_calibration_seqlen(model, recipe.calibration.seqlen)
    fmt = get_format(recipe.format)
    out = Path(out) if out is not None else default_out(model_slug(model), recipe)
    check_destination(out, overwrite, CHECKPOINT_MARKS)
    reducer = from_environment()
    dev = local_device(reducer, resolve_device(device))
    lazy = want_streaming(streaming, dense_folder(model))
    opened = Lazy.open(model) if lazy else Resident.open(model)
    dense = opened.model
    job = prepare(dense, opened.tokenizer, recipe, fmt, dev)
    if reducer.active and not job.method.data_parallel:
        raise QuantspecError(f"{recipe.method} cannot split its calibration across processes (torchrun).",
                             "run it in one process, or use --method gptq or rtn.")
    kv = _kv_inputs(dense, job, opened.tokenizer, dev) if recipe.kv_cache is not None else None
    if lazy:
        opened.read_outside(job.arch, keep_head=job.method.uses_model_head(job.block_plan) or bool(job.outside_plan))
    if reducer.rank != 0:  # a helper process: calibrates its share of the samples, writes nothing
        from .sinks import MemorySink

        layers: dict[str, Any] = {}
        run(dense, job, device=dev, progress=False, report=layers, source=opened.source(job.arch),
            sink=MemorySink(), reducer=reducer)
        return QuantizeOutcome(out=out, report={"layers": layers}, recipe=recipe, written=False)
    save_dtype = save_dtype_for(dense.config)
    report: dict[str, Any] = {"layers": {}}
    resume_dir = resume_folder(out) if resume else None
    with atomic_folder(out, overwrite, CHECKPOINT_MARKS) as tmp:
        t0 = time.perf_counter()
        sink = opened.sink(tmp, job.arch, fmt, save_dtype, bool(job.outside_plan))
        results, rest = run(dense, job, device=dev, progress=progress, report=report["layers"],
                            resume_dir=resume_dir, source=opened.source(job.arch), sink=sink, reducer=reducer)
        seconds = time.perf_counter() - t0
        if lazy:
            sink.write_rest(dense, rest, opened.weights, job.inside)
        else:
            state = checkpoint_state(dense, {**results, **rest}, fmt, save_dtype)
            write_safetensors(tmp, key_map(dense).state_to_disk(state))
        fill_report(report, recipe, fmt, job.plan, job.calib, seconds, dev, model=opened.name,
                    source=str(opened.path), load_seconds=opened.load_seconds, streaming=lazy,
                    processes=reducer.world)
        write_metadata(tmp, checkpoint_config(dense, recipe, job.plan, fmt, save_dtype), tokenizer=opened.tokenizer,
                       generation_config=getattr(dense, "generation_config", None),
                       recipe_yaml=recipe.to_yaml(), report=report)
        if kv is not None:
            _write_kv_scales(tmp, *kv, recipe, report, progress)
        write_manifest(tmp)
    if resume_dir is not None:
        import shutil

        shutil.rmtree(resume_dir, ignore_errors=True)
    return QuantizeOutcome(out=out, report=report, recipe=recipe)


def _kv_inputs(model, job, tokenizer, device) -> tuple[torch.Tensor, list[str]]:
    """Calibration ids and the attention modules whose KV scales are written, checked before
    any long work (the family's attention, the tokenizer)."""
    from .job import calibration
    from .kv_calibrate import attention_names

    if job.arch is None:
        raise QuantspecError("KV-cache scales need the model's decoder blocks, which were not found.",
                             "drop --kv-cache for this architecture.")
    attn = attention_names(job.arch, [job.arch.block_name(i) for i in range(len(job.arch.block_list(model)))])
    if job.ids is not None:
        return job.ids, attn
    if tokenizer is None:
        raise QuantspecError("KV-cache scales are calibrated on text, so they need a tokenizer.",
                             "point at a model folder with its tokenizer, or drop --kv-cache.")
    return calibration(tokenizer, job.recipe, device, getattr(model, "config", None))[0], attn


def _write_kv_scales(folder: Path, ids, attn: list[str], recipe: Recipe, report: dict, progress: bool) -> None:
    """Observe the written checkpoint's keys and values, add their scales and kv_cache_scheme."""
    from ..checkpoint.extra_tensors import add_tensors
    from ..checkpoint.load import read_config
    from ..checkpoint.save import write_config, write_report
    from .kv_calibrate import calibrate_checkpoint_kv
    from ..core.kv_config import kv_cache_scheme

    t0 = time.perf_counter()
    cfg = recipe.kv_cache
    tensors = calibrate_checkpoint_kv(folder, ids, cfg, attn, progress)
    add_tensors(folder, tensors, stem="kv-scales")
    config = read_config(folder)
    config["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme(cfg)
    write_config(folder, config)
    report["kv_cache"] = {"kind": cfg.kind, "strategy": cfg.strategy, "scale_rule": cfg.rule,
                          "samples": min(cfg.samples, len(ids)),
                          **({"search_samples": min(cfg.searched, len(ids))} if cfg.rule == "mse" else {}),
                          "seconds": round(time.perf_counter() - t0, 2),
                          "max_k_scale": max(float(t.max()) for n, t in tensors.items() if n.endswith("k_scale")),
                          "max_v_scale": max(float(t.max()) for n, t in tensors.items() if n.endswith("v_scale"))}
    write_report(folder, report)


def resume_folder(out: Path) -> Path:
    """Where a ``resume`` run journals its finished blocks: a hidden sibling of ``out``."""
    return out.parent / f".{out.name}.resume"


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
