"""Add tensors to a checkpoint folder being written (e.g. KV-cache scales, computed from the
finished checkpoint), in a form every loader reads: the standard safetensors index.

A single ``model.safetensors`` becomes shard 1 of 2 (renamed, not rewritten) with the new
tensors in shard 2 and an index naming both (transformers reads a lone model.safetensors and
would not see a second file); a sharded checkpoint gets one more file in its index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..sizes import tensors_bytes

INDEX = "model.safetensors.index.json"


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor], stem: str = "extra") -> str:
    """Write ``tensors`` into ``folder``'s weights; returns the new file's name."""
    from safetensors import safe_open

    folder = Path(folder)
    index_path = folder / INDEX
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        fname = f"model-{stem}.safetensors"
    else:
        single = folder / "model.safetensors"
        with safe_open(str(single), framework="pt") as h:
            keys = list(h.keys())
        first, fname = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        total = single.stat().st_size
        single.rename(folder / first)
        index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(keys, first)}
    clash = sorted(set(tensors) & set(index["weight_map"]))
    if clash:
        raise ValueError(f"tensors already in the checkpoint: {clash[:3]}")
    save_file(tensors, str(folder / fname), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(tensors, fname))
    index["metadata"]["total_size"] = int(index["metadata"].get("total_size", 0)) + tensors_bytes(tensors.values())
    index_path.write_text(json.dumps(index, indent=2))
    return fname
