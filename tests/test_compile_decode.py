"""Decoding a quantized model under torch.compile gives the eager model's logits (CPU here).

Each QuantLinear is one ``quantspec::quant_linear`` custom op inside the compiled graph; the
tolerance is 1e-4 relative (aot_eager keeps fp32 arithmetic; only op order may differ).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

import quantspec
from quantspec.quant.recipe import Recipe
from quantspec.quant.scheme import QuantScheme

from helpers import make_tiny_model


def decode(model, ids, steps):
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def test_compiled_decode_matches_eager(tmp_path):
    tiny = make_tiny_model(tmp_path, "llama")
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32))
    out = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False).out
    model = quantspec.load_quantized(out, backend="reference")
    ids = torch.tensor([[3, 17, 42, 7, 99]])
    with torch.inference_mode():
        eager = decode(model, ids, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with torch.inference_mode():
        comp = decode(compiled, ids, 4)
    assert torch.allclose(comp, eager, rtol=1e-4, atol=1e-4 * eager.abs().max().item())
