"""Where the calibration engine reads block weights from (``calibrate.run_blockwise``).

``calibrate.ResidentSource``: a model in memory. ``LazySource``: a model built on the meta
device from a folder of safetensors files; only the tensors outside the decoder blocks are read
up front (``load_outside_blocks``), block i's weights are read just before it is processed and
dropped back to the meta device right after its shard is written. Peak memory: the outside
tensors + one block + the calibration activations, for models larger than RAM.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..errors import QuantspecError
from .arch import ArchSpec


class LazyWeights:
    """Read named tensors from a folder's safetensors files on demand (never all at once)."""

    def __init__(self, folder: Path, keys=None):
        from ..checkpoint.reader import CheckpointReader
        from ..models.experts import KeyMap

        self.reader = CheckpointReader(folder)
        self.names = keys or KeyMap()  # module names in memory -> tensor names in the files
        self.keys = self.reader.keys()

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        from safetensors import safe_open

        key = self.names.to_disk(key)
        with safe_open(str(self.reader.file_of(key)), framework="pt") as h:
            return _owned(h.get_tensor(key), dtype)

    def load_into(self, module: nn.Module, prefix: str, dtype: torch.dtype) -> None:
        """Assign every parameter/buffer of ``module`` (named ``prefix.*`` in the files)."""
        from safetensors import safe_open

        wanted: dict[Path, list[str]] = {}
        for rel, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_meta:
                continue
            key = self.names.to_disk(f"{prefix}.{rel}" if prefix else rel)
            if key not in self.keys:
                continue  # e.g. a tied head, filled by tie_weights
            wanted.setdefault(self.reader.file_of(key), []).append(rel)
        state = {}
        for f, rels in wanted.items():
            with safe_open(str(f), framework="pt") as h:
                for rel in rels:
                    state[rel] = _owned(h.get_tensor(self.names.to_disk(f"{prefix}.{rel}" if prefix else rel)), dtype)
        module.load_state_dict(state, strict=False, assign=True)


def _owned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (floating tensors cast to ``dtype``) in memory of its own. safetensors hands out
    tensors over a private mapping of the whole file: writing one (the engine swaps dequantized
    values in) dirties copy-on-write pages that stay resident as long as anything read from that
    file lives, so a streamed model's every block would stay in memory."""
    if t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t.clone()


def empty_model(folder: Path, dtype: torch.dtype) -> nn.Module:
    """The model of ``folder``'s config on the meta device (no weights read)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def load_outside_blocks(
    model: nn.Module, weights: LazyWeights, blocks_name: str, dtype, skip: tuple[str, ...] = ()
) -> None:
    """Materialise every tensor outside the decoder blocks, except the modules in ``skip``."""
    blocks = model.get_submodule(blocks_name)
    inside = {id(t) for t in list(blocks.parameters()) + list(blocks.buffers())}
    for name, mod in model.named_modules():
        if name == blocks_name or name.startswith(blocks_name + ".") or name in skip:
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
        if t.is_meta and not n.startswith(blocks_name + ".") and n.rpartition(".")[0] not in skip
    ]
    if missing:
        raise QuantspecError(f"the model's weights lack {missing[:4]}.", "check the model folder.")


class LazySource:
    """Block weights read from ``weights`` just before a block is processed, released (back to
    the meta device) after its results are written."""

    def __init__(self, weights: LazyWeights, arch: ArchSpec, dtype: torch.dtype, model_bytes: int):
        from .heap import TRIM_ENV, available_memory_bytes, trims_each_block

        self.weights, self.arch, self.dtype = weights, arch, dtype
        self.trim = trims_each_block(model_bytes, available_memory_bytes(), os.environ.get(TRIM_ENV, "auto"))

    def load(self, index: int, block: nn.Module) -> None:
        self.weights.load_into(block, self.arch.block_name(index), self.dtype)

    def release(self, index: int, block: nn.Module) -> None:
        from .heap import release_heap

        block.to("meta")
        if self.trim:
            release_heap()


def release_tensor(module: nn.Module, attr: str) -> None:
    """Put ``module.<attr>`` back on the meta device (its memory freed)."""
    t = getattr(module, attr)
    meta = torch.empty_like(t, device="meta")
    if isinstance(t, nn.Parameter):
        setattr(module, attr, nn.Parameter(meta, requires_grad=False))
    else:
        setattr(module, attr, meta)
