"""Turn a quantized float model plus its QuantResults into a checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint.save import write_checkpoint
from ..models.conv1d import conv1d_layout
from .plan import LayerPlan, override_patterns
from ..core.scheme import QuantResult

if TYPE_CHECKING:
    from .recipe import Recipe


def checkpoint_state(
    model: nn.Module, results: dict[str, QuantResult], fmt, save_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Dense tensors (cast to ``save_dtype``) plus each quantized layer's packed tensors.

    A tied output embedding is stored once (under the input embedding's name), as
    transformers and vLLM expect for ``tie_word_embeddings``.
    """
    state: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    quantized_weights = {f"{n}.weight" for n in results}
    for name, t in model.state_dict().items():
        if name in quantized_weights:
            continue
        ptr = t.data_ptr()
        if ptr in seen and t.numel() > 0:
            continue  # tied tensor, already stored under its first name
        seen[ptr] = name
        state[name] = t.to(save_dtype) if t.is_floating_point() else t
    state = conv1d_layout(model, state)  # dense GPT-2 Conv1D weights as the model stores them
    for name, result in results.items():
        for tname, tensor in fmt.pack(result).items():
            state[f"{name}.{tname}"] = tensor
    return state


def quantization_config(fmt, recipe: "Recipe", plan: LayerPlan, all_linears: list[str], names=None) -> dict:
    """The format's config, with per-layer overrides for regrouped layers; module names as on
    disk (``names``: a ``models.experts.KeyMap``)."""
    from ..formats.overrides import with_overrides
    from ..models.experts import KeyMap

    names = names or KeyMap()
    cfg = fmt.quantization_config(recipe.scheme, sorted(names.to_disk(n) for n in plan.dense))
    overrides = plan.overrides(recipe.scheme)
    if overrides:
        groups: dict[Any, list[str]] = {}
        for name, scheme in overrides.items():
            groups.setdefault(scheme, []).append(name)
        patterns = [
            ([names.pattern_to_disk(p) for p in override_patterns(layers, all_linears)], scheme)
            for scheme, layers in groups.items()
        ]
        cfg = with_overrides(fmt.name, cfg, patterns)
    return cfg


def checkpoint_config(model: nn.Module, recipe: "Recipe", plan: LayerPlan, fmt, save_dtype) -> dict:
    """config.json of the checkpoint: the model's config plus the quantization_config."""
    from ..models.experts import key_map

    all_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(fmt, recipe, plan, all_linears, key_map(model))
    config["torch_dtype"] = str(save_dtype).replace("torch.", "")
    config["dtype"] = config["torch_dtype"]
    config.pop("_name_or_path", None)
    return config


def build_checkpoint(
    out: Path,
    model: nn.Module,
    tokenizer,
    results: dict[str, QuantResult],
    plan: LayerPlan,
    recipe: "Recipe",
    fmt,
    save_dtype: torch.dtype,
    report: dict[str, Any],
    overwrite: bool,
) -> Path:
    from ..models.experts import key_map

    return write_checkpoint(
        out,
        key_map(model).state_to_disk(checkpoint_state(model, results, fmt, save_dtype)),
        checkpoint_config(model, recipe, plan, fmt, save_dtype),
        tokenizer=tokenizer,
        generation_config=getattr(model, "generation_config", None),
        recipe_yaml=recipe.to_yaml(),
        report=report,
        overwrite=overwrite,
    )
