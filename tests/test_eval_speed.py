"""Speed bench and profiler on tiny models: the numbers exist, agree with each other, and the
quantized folder is measured against its dense source in the same run."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import make_tiny_model

from quantspec.eval.profile import ProfileConfig, bound, classify, gemm_cost, profile_model
from quantspec.eval.speed import SpeedConfig, dense_source, speed_report
from quantspec.models.load import load_model

TINY_SPEED = SpeedConfig(prompt_lengths=(8, 16), batch_sizes=(1, 2), decode_prompt_length=8,
                         new_tokens=4, repeats=2, warmup=1)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("speed"), "llama", seed=1)


@pytest.fixture(scope="module")
def quant_dir(dense_dir, tmp_path_factory):
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import Recipe
    from quantspec.core.scheme import QuantScheme

    out = tmp_path_factory.mktemp("q") / "rtn"
    recipe = Recipe(name="rtn-w4g32", method="rtn", format="gptq", scheme=QuantScheme(bits=4, group_size=32))
    quantize(str(dense_dir), recipe=recipe, out=out, device="cpu", progress=False)
    return out


def test_speed_report_dense_numbers(dense_dir):
    rep = speed_report(str(dense_dir), config=TINY_SPEED, device="cpu")
    m = rep["model"]
    assert rep["dense"] is None and rep["speedup"] is None and m["kind"] == "dense"
    assert set(m["prefill"]) == {"8", "16"} and set(m["decode"]) == {"1", "2"}
    for length, p in m["prefill"].items():
        assert p["tokens_per_s"] == pytest.approx(int(length) / p["seconds"], rel=1e-2)
    d1 = m["decode"]["1"]
    assert 0 < d1["tpot_ms_p50"] <= d1["tpot_ms_p95"]
    assert d1["ttft_ms"] > 0
    params = sum(p.numel() for p in load_model(str(dense_dir))[0].parameters())
    assert m["weights_mb"] == pytest.approx(params * 4 / 2**20, rel=0.05)
    assert m["memory"]["peak_mb"] >= m["memory"]["before_mb"] > 0
    assert rep["machine"]["cpu"] and rep["machine"]["versions"]["torch"] == torch.__version__
    json.dumps(rep)


def test_speed_report_quantized_against_its_dense_source(quant_dir, dense_dir):
    assert dense_source(quant_dir) is not None
    rep = speed_report(str(quant_dir), config=TINY_SPEED, device="cpu")
    assert rep["model"]["kind"] == "quantized" and rep["dense"]["kind"] == "dense"
    assert rep["model"]["backend"]
    assert rep["model"]["disk_mb"] > 0
    sp = rep["speedup"]["decode"]["1"]
    assert sp == pytest.approx(rep["model"]["decode"]["1"]["tokens_per_s"] / rep["dense"]["decode"]["1"]["tokens_per_s"], rel=1e-2)
    assert rep["speedup"]["weights"] > 1.0  # int4 layers weigh less than fp32 ones


def test_speed_report_compiled_decode_next_to_eager(quant_dir):
    """--compile: decode is timed again under torch.compile (aot_eager here: quick to compile),
    each quantized linear as one custom op; both tables are in the report and its Markdown."""
    from dataclasses import replace

    from quantspec.eval.speed import speed_markdown

    cfg = replace(TINY_SPEED, prompt_lengths=(8,), batch_sizes=(1,), compile="aot_eager")
    rep = speed_report(str(quant_dir), config=cfg, device="cpu", measure_baseline=False)
    m = rep["model"]
    assert set(m["decode_compiled"]) == {"1"} and m["decode_compiled"]["1"]["tokens_per_s"] > 0
    assert m["compile"]["backend"] == "aot_eager" and m["compile"]["wall_s"] > 0
    assert "compiled decode b1 tok/s" in speed_markdown(rep)
    with pytest.raises(Exception, match="torch.compile backend"):
        SpeedConfig(compile="no-such-backend")


def test_classify_and_gemm_cost():
    assert classify("aten::addmm") == "GEMM"
    assert classify("aten::mm", ("quantspec::quant_linear", "aten::linear")) == "dequant-GEMM"
    assert classify("aten::_weight_int4pack_mm_for_cpu") == "dequant-GEMM"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify("aten::argmax", ("quantspec::sampling",)) == "sampling"
    assert classify("aten::mul") == "norms+elementwise"
    assert classify("quantspec::decode_step") == "other"
    flops, nbytes = gemm_cost("aten::addmm", [[32], [8, 64], [64, 32], [], []], ["float"] * 3 + ["Scalar"] * 2)
    assert flops == 2 * 8 * 64 * 32 and nbytes == 4 * (32 + 8 * 64 + 64 * 32 + 8 * 32)
    flops, nbytes = gemm_cost("aten::_weight_int8pack_mm", [[4, 64], [32, 64], [32]], ["float", "signed char", "float"])
    assert flops == 2 * 4 * 64 * 32 and nbytes == 4 * 4 * 64 + 32 * 64 + 4 * 32 + 4 * 4 * 32
    peak = {"bandwidth_gbs": 10.0, "flops": 100e9}
    b = bound(2e6, 1e6, 1e-3, peak)  # intensity 2 < ridge 10
    assert b["bound"] == "memory" and b["gb_per_s"] == 1.0 and b["pct_of_peak"] == 10.0


def test_profile_dense_and_quantized(dense_dir, quant_dir, tmp_path):
    peak = {"bandwidth_gbs": 10.0, "flops": 1e11, "source": "test"}
    cfg = ProfileConfig(prompt_length=8, decode_steps=2)
    dense, _, _ = load_model(str(dense_dir))
    s = profile_model(dense, cfg, "cpu", tmp_path / "trace.json", peak)
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    total = sum(c["ms"] for c in s["by_class"].values())
    assert total == pytest.approx(s["total_ms"], rel=1e-2)
    assert s["by_class"]["GEMM"]["ms"] > 0 and s["by_class"]["dequant-GEMM"]["ms"] == 0
    assert s["by_class"]["sampling"]["ms"] > 0
    mm = [r for r in s["gemms"] if r["op"] in ("aten::mm", "aten::addmm")]
    assert mm and all(r["bound"] in ("memory", "compute") for r in mm)
    assert s["serving"]["tpot_ms"] > 0
    quant, _, _ = load_model(str(quant_dir))
    q = profile_model(quant, cfg, "cpu", None, peak)
    assert q["quant_linears"] == 14 and q["by_class"]["dequant-GEMM"]["ms"] > 0


def test_speed_report_static_decoder_next_to_transformers(quant_dir, dense_dir):
    """--static: decode is timed again through the StaticDecoder for both models; the ratios
    of the same mode on both sides and of ours (static) vs dense (transformers) are reported,
    and the static greedy tokens are the ones transformers' forward picks (fp32)."""
    from dataclasses import replace

    from quantspec.eval.speed import decode_run, random_prompt, speed_markdown
    from quantspec.runtime.decoder import StaticDecoder

    cfg = replace(TINY_SPEED, prompt_lengths=(8,), batch_sizes=(1, 2), static=True)
    rep = speed_report(str(quant_dir), baseline=str(dense_dir), config=cfg, device="cpu")
    for side in ("model", "dense"):
        table = rep[side]["decode_static"]
        assert set(table) == {"1", "2"} and all(v["tokens_per_s"] > 0 for v in table.values())
    sp = rep["speedup"]
    want = rep["model"]["decode_static"]["2"]["tokens_per_s"] / rep["dense"]["decode"]["2"]["tokens_per_s"]
    assert sp["decode_static_vs_dense_eager"]["2"] == pytest.approx(want, rel=1e-2)
    assert set(sp["decode_static"]) == {"1", "2"}
    text = speed_markdown(rep)
    assert "static decode b2 tok/s" in text and "static decoder vs dense through transformers" in text

    model = load_model(str(dense_dir))[0]
    ids = random_prompt(model.config.vocab_size, 2, 8, 0, "cpu")
    dec = StaticDecoder(model)
    with torch.inference_mode():
        ttft, steps = decode_run(dec, ids, 5)
        assert ttft > 0 and len(steps) == 4 and dec.lengths == [8 + 4, 8 + 4]
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5)
        assert torch.equal(_greedy(dec, ids, 5), want[:, 8:])


def _greedy(dec, ids: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` tokens ``decode_run`` picks through ``dec`` (the same calls), [B, n]."""
    dec.reset()
    nxt = dec.step(ids, keep=1)[:, -1].argmax(-1, keepdim=True)
    got = [nxt]
    for _ in range(n - 1):
        nxt = dec.step(nxt, keep=1)[:, -1].argmax(-1, keepdim=True)
        got.append(nxt)
    return torch.cat(got, 1)


def test_plain_decoder_is_transformers_own_loop(dense_dir):
    """The bench's transformers decode (``PlainDecoder``, a ``Decoder``): greedy tokens are
    generate's; ``drop_last`` crops every row alike and refuses uneven counts."""
    from quantspec.eval.speed import decode_run, random_prompt
    from quantspec.runtime.decoder import StaticDecoder
    from quantspec.runtime.kv import KVDecoder, PlainDecoder
    from quantspec.runtime.protocol import Decoder

    model = load_model(str(dense_dir))[0]
    ids = random_prompt(model.config.vocab_size, 2, 8, 0, "cpu")
    dec = PlainDecoder(model)
    assert all(isinstance(d, Decoder) for d in (dec, KVDecoder(model), StaticDecoder(model)))
    with torch.inference_mode():
        ttft, steps = decode_run(dec, ids, 5)
        assert ttft > 0 and len(steps) == 4 and dec.lengths == [8 + 4, 8 + 4]
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5)
        assert torch.equal(_greedy(dec, ids, 5), want[:, 8:])
        dec.reset()
        full = dec.forward(list(want))
        dec.drop_last([3, 3])
        assert dec.lengths == [10, 10]
        torch.testing.assert_close(dec.forward(list(want[:, 10:])), full[:, 10:], rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="together"):
            dec.drop_last([1, 0])


def test_speed_report_static_decoder_names_an_undeclared_family(tmp_path):
    from dataclasses import replace

    from quantspec.eval.speed import speed_markdown

    folder = make_tiny_model(tmp_path, "phi3", seed=1)
    cfg = replace(TINY_SPEED, prompt_lengths=(8,), batch_sizes=(1,), static=True)
    rep = speed_report(str(folder), config=cfg, device="cpu")
    assert "phi3" in rep["model"]["decode_static"]["error"]
    assert "n/a" in speed_markdown(rep)
