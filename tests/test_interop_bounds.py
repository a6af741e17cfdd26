"""The interop suite's judges can fail: the layer probe (tests/interop/probe.py) passes an
independent correct W8A8 implementation (our cpu backend's C++ int8 GEMM) and fails one that
quantizes activations with the other common convention (absmax / 127.5, as compressed-tensors'
own forward does); the end-to-end bounds are fixed from our own drift before any engine result."""

from __future__ import annotations

import inspect

import pytest
import torch

from helpers import make_tiny_model
from interop import exports, probe
from quantspec.kernels import reference as ref_backend


def _export(tmp_path, name):
    tiny = make_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    return exports.make_export(name, tiny, tmp_path / name)


def _engine_projection(ckpt, x, dtype, backend):
    import quantspec

    model = quantspec.load_quantized(str(ckpt), dtype=dtype, backend=backend)
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        return torch.cat([getattr(attn, p)(x.to(dtype)) for p in probe.PROJECTIONS], dim=-1)


def _absmax_over_127_5(x):
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / 127.5).clamp(min=1e-10)
    return torch.round(x.to(torch.float32) / scale).clamp(-128, 127).to(torch.int8), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_probe_passes_a_correct_w8a8_engine_and_fails_another_convention(tmp_path, monkeypatch, dtype):
    from quantspec.kernels.cpu_ext import load_cpu_ext

    ckpt = _export(tmp_path, "ct-w8a8")
    x = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    probe._layers.cache_clear()
    if load_cpu_ext() is not None:  # an independent implementation: int8 GEMM in C++
        correct = probe.check_probe(ckpt, x, _engine_projection(ckpt, x, dtype, "cpu"), dtype)
        assert correct["ok"], correct
    monkeypatch.setattr(ref_backend, "quantize_per_token_int8", _absmax_over_127_5)
    wrong_y = _engine_projection(ckpt, x, dtype, "reference")
    monkeypatch.undo()
    wrong = probe.check_probe(ckpt, x, wrong_y, dtype)
    assert not wrong["ok"], wrong
    assert wrong["over_2ulp"] > 5 * wrong["bound"], wrong


def test_layer_probe_fails_a_wrong_weight_layout(tmp_path):
    """A weight-only export read with its output channels swapped in pairs (a packing-order bug)."""
    ckpt = _export(tmp_path, "ct-w4g128-sym")
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    probe._layers.cache_clear()
    y = probe.our_projection(ckpt, x, torch.float32)
    swapped = y.view(16, -1, 2).flip(-1).reshape(16, -1)
    assert probe.check_probe(ckpt, x, y.clone(), torch.float32)["ok"]
    assert not probe.check_probe(ckpt, x, swapped, torch.float32)["ok"]


def test_end_to_end_bounds_are_fixed_before_the_engine_result():
    """`bounds` takes no engine result: the old one took the comparison and widened on failure."""
    params = list(inspect.signature(exports.bounds).parameters)
    assert params == ["ckpt", "ids", "dtype"], params
