"""transformers + compressed-tensors runs our W8A8 exports with another activation-scale
convention: its forward quantizes activations per token with scale absmax / 127.5, while vLLM's
int8 kernels and quantspec use absmax / 127. End to end that hides in int8 rounding noise; on one
layer with the same input it does not (tests/interop/probe.py). Asserted both ways, so that the
day compressed-tensors changes convention this test says so."""

from __future__ import annotations

import pytest
import torch

from helpers import make_tiny_model
from interop import exports, probe
from quantspec.kernels import reference as ref_backend

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (extra: compressed-tensors)")


def _transformers_projection(ckpt, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    attn = model.model.layers[0].self_attn
    seen = {}
    hooks = [getattr(attn, p).register_forward_hook(
        lambda mod, inp, out, p=p: seen.__setitem__(p, (inp[0][0].detach().clone(), out[0].detach().clone())))
        for p in probe.PROJECTIONS]
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    return seen["q_proj"][0], torch.cat([seen[p][1] for p in probe.PROJECTIONS], dim=-1)


def _absmax_over_127_5(x):
    amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / 127.5).clamp(min=1e-10)
    return torch.round(x.to(torch.float32) / scale).clamp(-128, 127).to(torch.int8), scale


def test_transformers_w8a8_quantizes_activations_with_absmax_over_127_5(tmp_path, monkeypatch):
    tiny = make_tiny_model(tmp_path, "llama", hidden_size=128, intermediate_size=256)
    ckpt = exports.make_export("ct-w8a8", tiny, tmp_path / "ct-w8a8")
    x, y = _transformers_projection(ckpt, list(range(3, 60)))
    probe._layers.cache_clear()
    ours = probe.check_probe(ckpt, x, y, torch.float32)
    assert not ours["ok"], f"transformers now matches absmax / 127: {ours}"
    monkeypatch.setattr(ref_backend, "quantize_per_token_int8", _absmax_over_127_5)
    probe._layers.cache_clear()
    theirs = probe.check_probe(ckpt, x, y, torch.float32)
    probe._layers.cache_clear()
    assert theirs["ok"], f"transformers' W8A8 differs from ours by more than the convention: {theirs}"
