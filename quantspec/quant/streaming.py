"""Streaming quantization: models larger than RAM, one decoder block in memory at a time.

The model is built on the meta device; only the tensors outside the decoder blocks (embeddings,
final norm, output head) are read up front. Block i's weights are read lazily from the
safetensors shards just before it is processed, and its packed tensors are written to their own
shard right after, before block i+1 is read; then the block goes back to the meta device. Peak
memory is the outside tensors + one block + the calibration activations, not the model.

The checkpoint is the same as the in-memory path's, tensor for tensor (tested), laid out as one
shard per block plus one for the rest, with the standard index file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..errors import QuantspecError
from .pack import checkpoint_state
from .scheme import QuantResult


class LazyWeights:
    """Read named tensors from a folder's safetensors files on demand (never all at once)."""

    def __init__(self, folder: Path):
        from ..checkpoint.reader import CheckpointReader

        self.reader = CheckpointReader(folder)
        self.keys = self.reader.keys()
        self._where = self.reader._keys  # name -> file

    def load_into(self, module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
        """Assign every parameter/buffer of ``module`` (named ``prefix.*`` in the files)."""
        from safetensors import safe_open

        wanted: dict[Path, list[str]] = {}
        for rel, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_meta:
                continue
            key = f"{prefix}.{rel}" if prefix else rel
            if key not in self.keys:
                continue  # e.g. a tied head, filled by tie_weights
            wanted.setdefault(self._where[key], []).append(rel)
        state = {}
        for f, rels in wanted.items():
            with safe_open(str(f), framework="pt") as h:
                for rel in rels:
                    key = f"{prefix}.{rel}" if prefix else rel
                    t = h.get_tensor(key)
                    state[rel] = t.to(dtype) if t.is_floating_point() else t
        module.load_state_dict(state, strict=False, assign=True)


def empty_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def load_outside_blocks(model: nn.Module, weights: LazyWeights, blocks_name: str, dtype) -> None:
    """Materialise every tensor that is not inside the decoder blocks."""
    blocks = model.get_submodule(blocks_name)
    inside = {id(t) for t in list(blocks.parameters()) + list(blocks.buffers())}
    for name, mod in model.named_modules():
        if name == blocks_name or name.startswith(blocks_name + "."):
            continue
        direct = [
            (n, t)
            for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            if t.is_meta and id(t) not in inside
        ]
        if not direct:
            continue
        shell = nn.Module()
        for n, t in direct:
            shell.register_parameter(n, nn.Parameter(t, requires_grad=False)) if isinstance(
                t, nn.Parameter
            ) else shell.register_buffer(n, t)
        weights.load_into(shell, name, dtype)
        for n, _ in direct:
            setattr(mod, n, getattr(shell, n))
    model.tie_weights()
    missing = [
        n for n, t in model.named_parameters()
        if t.is_meta and not n.startswith(blocks_name + ".")
    ]
    if missing:
        raise QuantspecError(f"the model's weights lack {missing[:4]}.", "check the model folder.")


class BlockShardWriter:
    """Writes block i's tensors to ``model-{i+1:05d}-of-{n:05d}.safetensors`` as it finishes."""

    def __init__(self, folder: Path, n_files: int, fmt, save_dtype: torch.dtype):
        self.folder, self.n_files, self.fmt, self.save_dtype = folder, n_files, fmt, save_dtype
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def write(self, index: int, prefix: str, module: nn.Module, results: dict[str, QuantResult]) -> None:
        rel = {n[len(prefix) + 1 :] if prefix else n: r for n, r in results.items()}
        state = checkpoint_state(module, rel, self.fmt, self.save_dtype)
        state = {(f"{prefix}.{k}" if prefix else k): v.contiguous() for k, v in state.items()}
        fname = f"model-{index + 1:05d}-of-{self.n_files:05d}.safetensors"
        save_file(state, str(self.folder / fname), metadata={"format": "pt"})
        for k, v in state.items():
            self.weight_map[k] = fname
            self.total += v.numel() * v.element_size()

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def outside_state_module(model: nn.Module, blocks_name: str) -> nn.Module:
    """A view of the model without its decoder blocks, for writing the remaining tensors."""
    holder = nn.Module()
    for name, mod in model.named_children():
        holder.add_module(name, mod)
    blocks_parent, _, child = blocks_name.rpartition(".")
    parent = holder.get_submodule(blocks_parent) if blocks_parent else holder
    saved = getattr(parent, child)
    setattr(parent, child, nn.ModuleList())
    return holder, (parent, child, saved)


def block_shard_hooks(
    model: nn.Module, weights: LazyWeights, writer: BlockShardWriter, arch, dtype: torch.dtype
) -> tuple[Any, Any]:
    """(on_block_start, on_block_end) callbacks for the calibration engine."""

    def start(i: int, block: nn.Module) -> None:
        weights.load_into(block, arch.block_name(i), dtype)

    def end(i: int, block: nn.Module, results: dict[str, QuantResult]) -> None:
        writer.write(i, arch.block_name(i), block, results)
        block.to("meta")

    return start, end
