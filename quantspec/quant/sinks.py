"""Where the calibration engine's results go, block by block (``calibrate.run_blockwise``).

``MemorySink`` keeps them (the model stays resident); ``ShardSink`` packs each finished block
into its own safetensors shard of the checkpoint being written (the streaming path), so no
result outlives its block in memory. ``resume.JournaledSink`` wraps either one and journals
every block first, so any sink resumes.

A sink sees: ``begin_block`` before a block is processed, ``write_block`` once it is done
(results on their home device), and ``replace`` when a method's post-pass (``Finish``) swaps
earlier results for others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..checkpoint.atomic import atomic_save_file
from ..sizes import tensors_bytes

from .block_ops import apply_results, relative
from .pack import checkpoint_state
from ..core.scheme import QuantResult


@dataclass
class BlockRecord:
    """A finished block: what the engine hands to its sink. ``report``: the report entries of
    its Linears; ``next_inputs``/``state``/``carry``: what a resumed run needs (``resume.py``)."""

    index: int
    name: str
    block: nn.Module
    results: dict[str, QuantResult]
    report: dict[str, dict] = field(default_factory=dict)
    next_inputs: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    carry: dict[str, torch.Tensor] = field(default_factory=dict)


class Sink:
    """Base of the sinks (``begin_block`` a no-op)."""

    def begin_block(self, index: int, block: nn.Module) -> None:
        """Block ``index`` is about to be processed (its float weights are loaded)."""

    def write_block(self, record: BlockRecord) -> None:
        raise NotImplementedError

    def replace(self, model: nn.Module, results: dict[str, QuantResult]) -> None:
        raise NotImplementedError


class MemorySink(Sink):
    """Keeps every result in ``results``; ``replace`` swaps the dequantized weights into the
    resident model too."""

    def __init__(self) -> None:
        self.results: dict[str, QuantResult] = {}

    def write_block(self, record: BlockRecord) -> None:
        self.results.update(record.results)

    def replace(self, model: nn.Module, results: dict[str, QuantResult]) -> None:
        self.results.update(results)
        apply_results(model, "", results)


class ShardSink(Sink):
    """Writes block i's tensors to ``model-{i+1:05d}-of-{n:05d}.safetensors`` in ``folder`` as
    it finishes (its dense tensors and its Linears packed by ``fmt``); ``write_rest`` adds the
    tensors outside the blocks (one shard, or one per tensor read lazily) and the index file.

    ``rest_keys``: the state-dict keys outside the blocks (``outside_keys``); ``rest_quantized``:
    some Linear outside the blocks is quantized (then the rest is one shard)."""

    def __init__(self, folder: Path, fmt, save_dtype: torch.dtype, n_blocks: int, rest_keys: list[str],
                 rest_quantized: bool, names=None):
        from ..models.experts import KeyMap

        self.names = names or KeyMap()  # module names -> tensor names on disk (MoE families)
        self.folder, self.fmt, self.save_dtype = folder, fmt, save_dtype
        self.n_blocks, self.rest_keys = n_blocks, rest_keys
        self.n_files = n_blocks + (1 if rest_quantized else len(rest_keys))
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def shard_name(self, index: int) -> str:
        return f"model-{index + 1:05d}-of-{self.n_files:05d}.safetensors"

    def write_block(self, record: BlockRecord) -> None:
        rel = {relative(n, record.name): r for n, r in record.results.items()}
        state = checkpoint_state(record.block, rel, self.fmt, self.save_dtype)
        self.write_state(record.index, {f"{record.name}.{k}": v for k, v in state.items()})

    def write_state(self, index: int, state: dict[str, torch.Tensor]) -> None:
        state = {self.names.to_disk(k): v.detach().contiguous().cpu() for k, v in state.items()}
        fname = self.shard_name(index)
        save_file(state, str(self.folder / fname), metadata={"format": "pt"})
        self.weight_map.update({k: fname for k in state})
        self.total += tensors_bytes(state.values())

    def replace(self, model: nn.Module, results: dict[str, QuantResult]) -> None:
        """Rewrite the shards that hold ``results``' layers with their new packed tensors (same
        names and shapes)."""
        by_file: dict[str, dict[str, QuantResult]] = {}
        for name, res in results.items():
            key = next(k for k in self.weight_map if k.startswith(self.names.to_disk(name) + "."))
            by_file.setdefault(self.weight_map[key], {})[name] = res
        for fname, layers in sorted(by_file.items()):
            path = self.folder / fname
            state = load_file(str(path))
            for name, res in layers.items():
                disk = self.names.to_disk(name)
                state.update({f"{disk}.{t}": v.contiguous().cpu() for t, v in self.fmt.pack(res).items()})
            atomic_save_file(state, path, metadata={"format": "pt"})

    def write_rest(self, model: nn.Module, results: dict[str, QuantResult], weights, inside) -> None:
        """The tensors outside the blocks (``inside(key)`` False), then the index file. With
        quantized ``results`` among them, as one shard; else one tensor at a time, each in its
        own shard, read from ``weights`` (``sources.LazyWeights``) if not in memory and released
        after writing."""
        from .sources import release_tensor

        if results:
            state = checkpoint_state(model, results, self.fmt, self.save_dtype)
            self.write_state(self.n_blocks, {k: v for k, v in state.items() if not inside(k)})
        else:
            for j, key in enumerate(self.rest_keys):
                mod_name, _, attr = key.rpartition(".")
                mod = model.get_submodule(mod_name) if mod_name else model
                t = getattr(mod, attr)
                t = weights.read(key, self.save_dtype) if t.is_meta else t.detach().to(self.save_dtype)
                self.write_state(self.n_blocks + j, {key: t})
                del t
                release_tensor(mod, attr)
        self.write_index()

    def write_index(self) -> None:
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def outside_keys(model: nn.Module, inside) -> list[str]:
    """State-dict keys outside the blocks; a tied output head is stored once (as the input)."""
    from .arch import head_name

    keys = [k for k in model.state_dict() if not inside(k)]
    if model.config.tie_word_embeddings:
        head = head_name(model)
        keys = [k for k in keys if head is None or k != f"{head}.weight"]
    return keys
