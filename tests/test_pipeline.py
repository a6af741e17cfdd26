"""quantize() -> checkpoint -> load_quantized() on tiny random models, every format.

The loaded model must compute what the fake-quantized float model computes (same codes and
scales, dequantized in fp32): tolerance 1e-3 on logits in fp32 (dense tensors are stored in
fp16, which bounds the difference).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantspec
from quantspec.errors import QuantspecError
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.quant.recipe import Recipe
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def fake_quant(dense, scheme_for):
    fq = copy.deepcopy(dense)
    for name, mod in fq.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            mod.weight.data = rtn(mod.weight.data, scheme_for(mod)).dequantize()
    # the checkpoint stores dense tensors in fp16
    for name, p in fq.named_parameters():
        if not any(name.startswith(n) for n, m in fq.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"):
            p.data = p.data.half().float()
    return fq


CASES = [
    ("gptq", QuantScheme(bits=4, group_size=32, symmetric=True)),
    ("gptq", QuantScheme(bits=4, group_size=32, symmetric=False)),
    ("gptq", QuantScheme(bits=8, group_size=-1, symmetric=True)),
    ("gptq", QuantScheme(bits=3, group_size=32, symmetric=False)),
    ("gptq", QuantScheme(bits=2, group_size=32, symmetric=False)),
    ("awq", QuantScheme(bits=4, group_size=32, symmetric=False)),
    ("compressed-tensors", QuantScheme(bits=4, group_size=32, symmetric=True)),
    ("compressed-tensors", QuantScheme(bits=4, group_size=-1, symmetric=False)),
    ("compressed-tensors", QuantScheme(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")),
]


@pytest.mark.parametrize("fmt,scheme", CASES, ids=lambda v: v if isinstance(v, str) else v.short_name)
def test_quantize_save_load_matches_fake_quant(tiny, tmp_path, fmt, scheme):
    recipe = Recipe(name="t", method="rtn", format=fmt, scheme=scheme)
    out = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False).out
    model = quantspec.load_quantized(out, backend="reference")
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert n_quant == 14  # 2 blocks x 7 Linears; lm_head stays dense
    dense = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ref = fake_quant(dense, lambda m: scheme)
    ids = torch.randint(0, 200, (2, 12))
    with torch.no_grad():
        y = model(ids).logits
        if scheme.activations:
            from quantspec.kernels.reference import quantize_per_token_int8  # noqa: F401
        yr = ref(ids).logits
    tol = 5e-2 if scheme.activations else 1e-3  # W8A8 also quantizes activations at run time
    assert (y - yr).abs().max().item() < tol * max(1.0, yr.abs().max().item())
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "recipe.yaml", "quant_report.json"} <= files
    assert "model.safetensors" in files or "model.safetensors.index.json" in files
    assert Recipe.from_yaml(out / "recipe.yaml") == recipe
    report = json.loads((out / "quant_report.json").read_text())
    assert report["layers"]["lm_head"]["status"].startswith("dense")


def test_regroup_rule_records_per_layer_group_size(tiny, tmp_path):
    """hidden=64 is not divisible by 128: those layers become g64 and the config says so."""
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(bits=4, group_size=128))
    outcome = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False)
    assert outcome.report["regrouped_layers"], "expected regrouped layers"
    model = quantspec.load_quantized(outcome.out)
    groups = {m.scheme.group_size for m in model.modules() if isinstance(m, QuantLinear)}
    assert 64 in groups
    cfg = json.loads((outcome.out / "config.json").read_text())["quantization_config"]
    assert any(k.startswith("+:") for k in cfg["dynamic"])
    dense = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    ref = fake_quant(
        dense, lambda m: QuantScheme(bits=4, group_size=128 if m.in_features % 128 == 0 else 64)
    )
    ids = torch.randint(0, 200, (1, 10))
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() < 1e-3 * 50


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_default_gptq_recipe_regroups_with_static_act_order(tiny, tmp_path, fmt):
    """The default recipe (GPTQ, static act-order) regroups K=64 layers like RTN does: no layer
    but lm_head is left dense, and the checkpoint loads and matches the reference backend."""
    from quantspec.quant.recipe import CalibrationConfig

    recipe = Recipe(name="t", format=fmt, calibration=CalibrationConfig(data="pydoc", samples=4, seqlen=32))
    assert recipe.scheme.act_order and recipe.scheme.static_groups
    outcome = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False)
    assert list(outcome.report["dense_layers"]) == ["lm_head"]
    assert outcome.report["regrouped_layers"]
    fast = quantspec.load_quantized(outcome.out)
    ref = quantspec.load_quantized(outcome.out, backend="reference")
    groups = {m.scheme.group_size for m in ref.modules() if isinstance(m, QuantLinear)}
    assert 64 in groups
    ids = torch.randint(0, 200, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits, rtol=0, atol=2e-2)


def test_existing_output_refused_before_work(tiny, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    recipe = Recipe(name="t", method="rtn", format="gptq")
    with pytest.raises(QuantspecError, match="already exists"):
        quantspec.quantize(str(tiny), recipe, out, progress=False)
    assert (out / "keep.txt").read_text() == "user data"


@pytest.mark.parametrize("streaming", [True, False])
def test_failure_mid_write_leaves_no_folder(tiny, tmp_path, monkeypatch, streaming):
    import quantspec.checkpoint.checksums as checksums

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checksums, "write_manifest", boom)
    recipe = Recipe(name="t", method="rtn", format="gptq")
    with pytest.raises(QuantspecError, match="disk is full"):
        quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False, streaming=streaming)
    assert not (tmp_path / "ckpt").exists()
    assert not list(tmp_path.glob(".ckpt.tmp-*"))


def test_generate_works_on_loaded_model(tiny, tmp_path):
    recipe = Recipe(name="t", method="rtn", format="compressed-tensors", scheme=QuantScheme(group_size=32))
    out = quantspec.quantize(str(tiny), recipe, tmp_path / "ckpt", progress=False).out
    model = quantspec.load_quantized(out)
    ids = torch.tensor([[1, 5, 9, 13]])
    gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert gen.shape == (1, 9)
