"""Decoding a quantized model under torch.compile gives the eager model's logits (CPU here).

Each QuantLinear is one ``quantspec::quant_linear`` custom op inside the compiled graph.

Both on a 1-layer tiny Llama (tracing the model is most of the cost; a second block adds none
of the checked behaviour).

- aot_eager (prefill and decode compiled): fp32 arithmetic kept, only op order may differ:
  1e-4 relative.
- inductor (what ``quantspec bench --compile`` uses; it generates and compiles C++, a minute
  cold on 2 cores): kept cheap for the default run, prefill and the first decode step run eager (the cache is then contiguous, as in every later step), then 3 decode
  steps compiled as one graph (``fullgraph``, dynamic cache length). Inductor fuses the ops
  around the custom op and may reorder fp32 sums: the same 1e-4 relative bound, on the reference
  backend and on the cpu backend (the default one on CPU, its own C++ op in the graph).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import quantspec
from quantspec.kernels.cpu_ext import compiler_available
from quantspec.quant.recipe import Recipe
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model, missing_asset


def _quantized(tmp_path, backend: str, **overrides):
    tiny = make_tiny_model(tmp_path, "llama", **overrides)
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32))
    out = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False).out
    return quantspec.load_quantized(out, backend=backend)


def decode_steps(model, cache, tok, steps):
    """Greedy: ``steps`` one-token forwards from ``tok`` [B, 1]; the last-position logits [B, steps, V]."""
    logits = []
    for _ in range(steps):
        out = model(tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def decode(model, ids, steps):
    cache = DynamicCache()
    out = model(ids, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    return torch.cat([out.logits[:, -1:], decode_steps(model, cache, tok, steps)], 1)


def _assert_close(got, want):
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= 1e-4 * scale, f"max |logit diff| {err:.3g} > 1e-4 x {scale:.3g}"


def test_compiled_decode_matches_eager(tmp_path):
    model = _quantized(tmp_path, "reference", num_hidden_layers=1)
    ids = torch.tensor([[3, 17, 42, 7, 99]])
    with torch.inference_mode():
        eager = decode(model, ids, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    with torch.inference_mode():
        comp = decode(compiled, ids, 4)
    _assert_close(comp, eager)


def _primed(model, ids):
    """A cache after eager prefill of ``ids`` and one eager decode step, and the next token."""
    cache = DynamicCache()
    tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return cache, model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_inductor_decode_matches_eager(tmp_path, backend):
    if not compiler_available():
        missing_asset("inductor on CPU needs a C++ compiler")
    from torch._dynamo.utils import counters

    model = _quantized(tmp_path, backend, num_hidden_layers=1)
    assert {m.backend_name for m in model.modules() if hasattr(m, "backend_name")} == {backend}
    with torch.inference_mode():
        ids = torch.tensor([[3, 17, 42, 7, 99]])
        cache, tok = _primed(model, ids)
        eager = decode_steps(model, cache, tok, 3)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend="inductor", dynamic=True, fullgraph=True)
        cache, tok = _primed(model, ids)
        comp = decode_steps(compiled, cache, tok, 3)
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    torch._dynamo.reset()
    _assert_close(comp, eager)
    assert torch.equal(comp.argmax(-1), eager.argmax(-1))
