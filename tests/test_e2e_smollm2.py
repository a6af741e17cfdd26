"""End to end on the real SmolLM2-135M-Instruct: RTN W4 g128 quantize -> save -> load ->
perplexity within a stated bound of dense -> coherent greedy text.

Bound: with 4 windows of 512 wikitext2 tokens, RTN W4 (g128, regrouped to g64 where K=576) stays
within 1.8x of the dense perplexity (measured here: dense about 29-31, RTN W4 about 41-47).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import quantspec
from quantspec.eval.perplexity import perplexity
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.models import load_dense
from quantspec.quant.recipe import Recipe
from quantspec.core.scheme import QuantScheme


@pytest.fixture(scope="module")
def rtn_ckpt(smollm2_dir, tmp_path_factory):
    recipe = Recipe(name="rtn-w4g128", method="rtn", format="gptq", scheme=QuantScheme(4, 128))
    out = tmp_path_factory.mktemp("e2e") / "smol-rtn"
    return quantspec.quantize(str(smollm2_dir), recipe, out, progress=False)


def test_rtn_w4_checkpoint_quality_and_text(rtn_ckpt, smollm2_dir, data_dir, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_DATA", str(data_dir))
    rep = rtn_ckpt.report
    assert rep["layers"]["lm_head"]["status"].startswith("dense")
    assert len(rep["regrouped_layers"]) == 30 * 6  # K=576 layers: g128 -> g64
    model = quantspec.load_quantized(rtn_ckpt.out)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 30 * 7
    tok = AutoTokenizer.from_pretrained(rtn_ckpt.out)
    q = perplexity(model, tok, "wikitext2", seqlen=512, windows=4, progress=False)
    dense, _, _ = load_dense(str(smollm2_dir), dtype=torch.float32)
    d = perplexity(dense, tok, "wikitext2", seqlen=512, windows=4, progress=False)
    assert 15 < d["ppl"] < 45, d
    assert d["ppl"] < q["ppl"] < 1.8 * d["ppl"], (d["ppl"], q["ppl"])
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
