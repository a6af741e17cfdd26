"""Byte counts (quantspec/sizes.py) and the checkpoint sizes built on them."""

from __future__ import annotations

import json

import torch

from quantspec.checkpoint.save import folder_size_bytes, write_safetensors
from quantspec.eval.compare import dense_size_bytes
from quantspec.sizes import files_bytes, tensors_bytes


def test_tensors_bytes_plain_distinct_and_16_bit():
    w = torch.zeros(4, 8)  # fp32: 128 bytes
    codes = torch.zeros(10, dtype=torch.uint8)
    assert tensors_bytes([w, codes, w]) == 128 + 10 + 128
    assert tensors_bytes([w, codes, w], distinct=True) == 128 + 10
    assert tensors_bytes([w, codes], float_bytes=2) == 64 + 10
    assert tensors_bytes([torch.empty(5, device="meta"), codes], distinct=True) == 10
    assert tensors_bytes([]) == 0


def test_dense_size_counts_tied_weights_once_at_16_bit():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    assert dense_size_bytes(model) == 10 * 4 * 2 + 3 * 8


def test_shards_index_total_and_folder_size(tmp_path):
    state = {f"t{i}": torch.zeros(256) for i in range(5)}  # 1 KiB each
    write_safetensors(tmp_path, state, max_bytes=2048)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    files = sorted(tmp_path.glob("*.safetensors"))
    assert folder_size_bytes(tmp_path) == files_bytes(files) == sum(p.stat().st_size for p in files)
