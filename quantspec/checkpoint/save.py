"""Write a quantized checkpoint folder that real engines load as it is.

Layout: config.json (with ``quantization_config``), model.safetensors (or shards plus
model.safetensors.index.json), generation_config.json, tokenizer files, recipe.yaml (the
resolved recipe) and quant_report.json. Everything is written to a temporary folder and renamed
at the end (see ``atomic.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..sizes import files_bytes, tensors_bytes
from .atomic import atomic_folder
from . import checksums

CHECKPOINT_MARKS = (checksums.MANIFEST, "quant_report.json")  # a folder --overwrite may replace holds one

SHARD_BYTES = 4 * 1024**3


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        nbytes = tensors_bytes([t])
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def write_safetensors(folder: Path, state: dict[str, torch.Tensor], max_bytes: int = SHARD_BYTES) -> None:
    """Write ``state`` as one file or as shards with the standard index file."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards = _shards(state, max_bytes)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update(dict.fromkeys(shard, fname))
        total += tensors_bytes(shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_config(folder: Path, config: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_report(folder: Path, report: dict[str, Any]) -> None:
    (folder / "quant_report.json").write_text(json.dumps(report, indent=2) + "\n")


def write_metadata(
    folder: Path,
    config: dict[str, Any],
    *,
    tokenizer=None,
    generation_config=None,
    recipe_yaml: str | None = None,
    report: dict[str, Any] | None = None,
) -> None:
    """Everything but the weights: config.json, generation config, tokenizer, recipe, report."""
    write_config(folder, config)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if recipe_yaml is not None:
        (folder / "recipe.yaml").write_text(recipe_yaml)
    if report is not None:
        write_report(folder, report)


def write_checkpoint(
    out: str | Path,
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    overwrite: bool = False,
    **metadata: Any,
) -> Path:
    """Write a complete checkpoint folder atomically and return its path.

    ``metadata``: the keyword arguments of ``write_metadata`` (tokenizer, generation_config,
    recipe_yaml, report)."""
    out = Path(out)
    with atomic_folder(out, overwrite, CHECKPOINT_MARKS) as tmp:
        write_safetensors(tmp, state)
        write_metadata(tmp, config, **metadata)
        checksums.write_manifest(tmp)
    return out


def folder_size_bytes(folder: str | Path) -> int:
    """Bytes of the weight files of a checkpoint folder (safetensors only)."""
    return files_bytes(Path(folder).glob("*.safetensors"))
