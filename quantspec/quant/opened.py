"""A model opened for quantization, resident or lazy: what ``pipeline.quantize`` needs of it
(the module, its tokenizer, where it came from) and the source and sink that fit it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .arch import ArchSpec, head_name
from .sinks import MemorySink, ShardSink, Sink, outside_keys
from .sources import LazySource, LazyWeights, empty_model, load_outside_blocks


@dataclass
class Resident:
    """Every weight loaded in fp32 on the CPU (``models.load_dense``)."""

    model: nn.Module
    tokenizer: Any
    name: str
    path: Path
    load_seconds: float
    weights: None = None

    @classmethod
    def open(cls, spec: str | None) -> "Resident":
        from ..models import load_dense
        from ..models.conv1d import linearize_conv1d
        from ..models.experts import linearize_experts

        t0 = time.perf_counter()
        model, tokenizer, info = load_dense(spec, dtype=torch.float32, device="cpu")
        linearize_conv1d(model)  # GPT-2 style models: their Conv1D projections as nn.Linear
        linearize_experts(model)  # MoE models: one nn.Linear per expert, named as on disk
        return cls(model, tokenizer, info.name, Path(info.path), time.perf_counter() - t0)

    def source(self, arch: ArchSpec) -> None:
        return None  # the engine's default: resident

    def sink(self, folder: Path, arch: ArchSpec | None, fmt, save_dtype: torch.dtype, rest_quantized: bool) -> Sink:
        return MemorySink()


@dataclass
class Lazy:
    """A meta-device model over a folder of safetensors files, read block by block."""

    model: nn.Module
    tokenizer: Any
    name: str
    path: Path
    weights: LazyWeights
    load_seconds: float = 0.0

    @classmethod
    def open(cls, spec: str | None) -> "Lazy":
        from ..models import dense_folder, load_tokenizer, model_slug
        from ..models.experts import key_map, linearize_experts

        folder = dense_folder(spec)
        model = empty_model(folder, torch.float32)
        linearize_experts(model)  # on the meta device: per-expert Linears read by their disk names
        return cls(model, load_tokenizer(folder), model_slug(spec), folder, LazyWeights(folder, key_map(model)))

    def read_outside(self, arch: ArchSpec, keep_head: bool) -> None:
        """Read every tensor outside the decoder blocks; the output head is streamed to the
        checkpoint at the end instead, unless ``keep_head`` (something quantizes it or needs the
        logits) or it is tied to the embeddings."""
        head = head_name(self.model)
        stream_head = head is not None and not keep_head and not self.model.config.tie_word_embeddings
        load_outside_blocks(self.model, self.weights, arch.blocks, torch.float32, (head,) if stream_head else ())

    def source(self, arch: ArchSpec) -> LazySource:
        fp32_bytes = 4 * sum(p.numel() for p in self.model.parameters())
        return LazySource(self.weights, arch, torch.float32, fp32_bytes)

    def sink(self, folder: Path, arch: ArchSpec, fmt, save_dtype: torch.dtype, rest_quantized: bool) -> ShardSink:
        inside = lambda n: n.startswith(arch.blocks + ".")  # noqa: E731
        from ..models.experts import key_map

        return ShardSink(folder, fmt, save_dtype, len(arch.block_list(self.model)),
                         outside_keys(self.model, inside), rest_quantized, key_map(self.model))
