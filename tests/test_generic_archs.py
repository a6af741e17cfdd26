"""Families with no architecture declaration, end to end: quantize (calibrated methods through
the generic fallback), load with ``load_quantized``, and compare with the dense model.

Bloom passes ALiBi as a [batch * heads, 1, L] keyword argument (made for one sample), OPT has
LayerNorm biases and ReLU (fc1 -> fc2 smoothing), GPT-J a parallel attention/MLP block whose
one norm feeds both. Bound: mean squared logit error below 10% of the logits' mean square (the
bound tests/test_awq.py uses for 4-bit g32 on tiny random models; observed 0.002-0.1 here).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

import quantspec
from quantspec.errors import QuantspecError
from quantspec.quant.recipe import CalibrationConfig, Recipe
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model, tiny_model

RECIPES = {
    "gptq": lambda cal: Recipe(name="t", method="gptq", format="gptq",
                               scheme=QuantScheme(4, 32, True), calibration=cal),
    "awq": lambda cal: Recipe(name="t", method="awq", format="awq",
                              scheme=QuantScheme(4, 32, False), calibration=cal),
    "smoothquant": lambda cal: Recipe(name="t", method="smoothquant", format="compressed-tensors",
                                      scheme=QuantScheme(8, -1, True, activations="int8-token-dynamic"),
                                      calibration=cal),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _calib(tmp_path) -> CalibrationConfig:
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(["Quantization maps weights to a small grid of integers."] * 400))
    return CalibrationConfig(data=str(text), samples=4, seqlen=64)


def _save(tmp_path, family):
    return tiny_model(family), make_tiny_model(tmp_path, family), _calib(tmp_path)


def _save_config(tmp_path, name: str, config):
    """(a random model of a transformers ``config`` not in helpers' tiny families, its folder, the
    calibration) as ``_save`` gives them."""
    import transformers
    from helpers import make_tiny_tokenizer

    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(config).eval()
    dense.save_pretrained(tmp_path / name)
    make_tiny_tokenizer().save_pretrained(tmp_path / name)
    return dense, tmp_path / name, _calib(tmp_path)


def _rel(q, dense) -> float:
    """Mean squared logit error of ``q`` against ``dense`` over their mean square (2 x 24 tokens)."""
    ids = torch.randint(3, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = q(input_ids=ids).logits.float(), dense(input_ids=ids).logits
    return float((a - b).pow(2).mean() / b.pow(2).mean())


@pytest.mark.parametrize("family,method", [
    ("bloom", "gptq"), ("bloom", "awq"), ("opt", "smoothquant"), ("opt", "awq"), ("gptj", "awq"),
])
def test_undeclared_family_quantizes_and_loads(tmp_path, family, method):
    dense, folder, cal = _save(tmp_path, family)
    outcome = quantspec.quantize(str(folder), RECIPES[method](cal), tmp_path / "ckpt",
                                 progress=False, device="cpu")
    q = quantspec.load_quantized(outcome.out, backend="reference")
    rel = _rel(q, dense)
    assert rel < 0.1, rel


@pytest.mark.parametrize("method", ["gptq", "awq", "smoothquant"])
def test_gpt2_conv1d_quantizes_and_loads(tmp_path, method):
    """GPT-2's Conv1D projections ([in, out] weights) are quantized as Linears; a layer the
    recipe leaves dense is written back as Conv1D, so transformers reads the checkpoint."""
    dense, folder, cal = _save(tmp_path, "gpt2")
    recipe = dataclasses.replace(RECIPES[method](cal), ignore=("lm_head", "h.1.mlp.c_proj"))
    outcome = quantspec.quantize(str(folder), recipe, tmp_path / "ckpt", progress=False, device="cpu")
    q = quantspec.load_quantized(outcome.out, backend="reference")
    assert "transformer.h.0.attn.c_attn" in q.quantspec_backends
    assert "transformer.h.1.mlp.c_proj" not in q.quantspec_backends
    stored = {}
    for f in outcome.out.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            stored.update({k: fh.get_tensor(k) for k in fh.keys() if k.endswith("h.1.mlp.c_proj.weight")})
    # the dense layer is written as Conv1D [in, out], as GPT-2 stores it
    torch.testing.assert_close(stored["transformer.h.1.mlp.c_proj.weight"].float(),
                               dense.transformer.h[1].mlp.c_proj.weight, atol=1e-3, rtol=1e-3)
    assert _rel(q, dense) < 0.1


def test_conv1d_models_get_a_clear_error_where_unsupported():
    from quantspec.formats import get_format
    from quantspec.quant.plan import make_plan

    model = tiny_model("gpt2")
    with pytest.raises(QuantspecError, match="Conv1D") as err:
        make_plan(model, QuantScheme(4, 32, True), get_format("gptq"))
    assert "nn.Linear" in str(err.value)


def test_linear_subclass_with_its_own_forward_stays_dense(tmp_path):
    """DeepSeek-V4's grouped output projection subclasses nn.Linear but computes a block-diagonal bmm
    over its weight's row groups. A quantized Linear computes x @ W.T, so swapping one in broke the
    checkpoint (its forward fails on the grouped input). The layer stays dense, with the reason in
    the report, and every plain Linear of the model (routed experts included) is quantized."""
    import json

    dense, folder, _ = _save(tmp_path, "deepseek_v4")
    rtn = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, True))
    outcome = quantspec.quantize(str(folder), rtn, tmp_path / "ckpt", progress=False, device="cpu")
    report = json.loads((outcome.out / "quant_report.json").read_text())
    grouped = {n: why for n, why in report["dense_layers"].items() if n.endswith("o_a_proj")}
    assert len(grouped) == 2 and all("DeepseekV4GroupedLinear" in why and "not x @ W.T + b" in why
                                     for why in grouped.values()), report["dense_layers"]
    q = quantspec.load_quantized(outcome.out, backend="reference")
    assert any(".experts." in n for n in q.quantspec_backends) and not any(n in q.quantspec_backends for n in grouped)
    assert _rel(q, dense) < 0.1


def test_a_layer_loop_that_unpacks_block_outputs_calibrates(tmp_path):
    """CPM-Ant's model loop unpacks ``hidden, attn = layer(...)``; calibration's stand-in blocks
    returned the hidden states alone, so its capture failed with a bare ValueError. The stand-ins
    now return as many values as the loop unpacks, and GPTQ quantizes the model."""
    import transformers

    dense, folder, cal = _save_config(tmp_path, "cpmant", transformers.CpmAntConfig(
        vocab_size=320, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128, num_hidden_layers=2,
        prompt_length=4, segment_types=4))
    rel = {}
    for method, recipe in (("gptq", RECIPES["gptq"](cal)),
                           ("rtn", Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, True)))):
        out = quantspec.quantize(str(folder), recipe, tmp_path / method, progress=False, device="cpu").out
        q = quantspec.load_quantized(out, backend="reference")
        assert len(q.quantspec_backends) == 14
        rel[method] = _rel(q, dense)
    # this family's random init makes 4-bit g32 coarse (RTN ~0.5 here): calibration must beat it
    assert rel["gptq"] < 0.9 * rel["rtn"], rel


def test_block_that_checks_its_mask_batch_runs_sample_by_sample(tmp_path):
    """XGLM's attention raises ValueError when its mask (captured for one sample) meets a batch:
    GPTQ's one-batch pass took only a RuntimeError as "this block does not batch" and crashed.
    It now runs such a block sample by sample and quantizes the model."""
    import transformers

    dense, folder, cal = _save_config(tmp_path, "xglm", transformers.XGLMConfig(
        vocab_size=320, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    outcome = quantspec.quantize(str(folder), RECIPES["gptq"](cal), tmp_path / "ckpt", progress=False, device="cpu")
    q = quantspec.load_quantized(outcome.out, backend="reference")
    assert _rel(q, dense) < 0.1


def test_router_that_holds_its_linear_stays_dense(tmp_path):
    """HunYuan-MoE's router is a module (``mlp.gate``) holding a Linear ``wg``, and the model reads
    ``wg.weight.dtype`` in its forward. The router rule named only ``mlp.gate``, so ``wg`` was
    quantized where the format could hold it (NVFP4), and the checkpoint failed in its first forward
    (a quantized Linear has no ``weight``). Every Linear inside a router now stays dense, reported as
    the router."""
    import json

    import transformers

    from quantspec.core.scheme import SCHEME_PRESETS

    dense, folder, _ = _save_config(tmp_path, "hunyuan", transformers.HunYuanMoEV1Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, moe_topk=2, head_dim=16, max_position_embeddings=128))
    recipe = Recipe(name="t", method="rtn", format="compressed-tensors", scheme=SCHEME_PRESETS["nvfp4"])
    outcome = quantspec.quantize(str(folder), recipe, tmp_path / "ckpt", progress=False, device="cpu")
    report = json.loads((outcome.out / "quant_report.json").read_text())["dense_layers"]
    assert all("MoE router" in report[f"model.layers.{i}.mlp.gate.wg"] for i in (0, 1)), report
    q = quantspec.load_quantized(outcome.out, backend="reference")
    assert any(".experts." in n for n in q.quantspec_backends)
    assert _rel(q, dense) < 0.1


def test_model_code_reading_a_quantized_weight_dtype_runs(tmp_path):
    """HY-V4's sparse-attention indexer (as DeepSeek-V3.2's) runs ``weights_proj(x.to(
    weights_proj.weight.dtype))``: the loaded checkpoint failed in its first forward with
    "'QuantLinear' object has no attribute 'weight'". A quantized Linear's ``weight`` now reads as a
    stand-in of the layer's shape, compute dtype and device, and the model runs."""
    from transformers import CONFIG_MAPPING

    dense, folder, _ = _save_config(tmp_path, "hy", CONFIG_MAPPING["hy_v4"](
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, moe_intermediate_size=64,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))
    rtn = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, True))
    outcome = quantspec.quantize(str(folder), rtn, tmp_path / "ckpt", progress=False, device="cpu")
    q = quantspec.load_quantized(outcome.out, backend="reference")
    assert any(n.endswith("weights_proj") for n in q.quantspec_backends)
    assert _rel(q, dense) < 0.1


def test_linear_subclass_that_computes_a_linear_is_quantized():
    """Falcon's FalconLinear overrides forward with ``x @ W.T + b``: quantized like nn.Linear (the
    rule that keeps DeepSeek-V4's grouped projection dense looks at what a forward computes)."""
    from quantspec.formats import get_format
    from quantspec.quant.plan import make_plan

    model = tiny_model("falcon")
    plan = make_plan(model, QuantScheme(4, 32, True), get_format("gptq"))
    falcon = [n for n, m in model.named_modules() if type(m).__name__ == "FalconLinear"]
    assert falcon and all(n in plan.quantize for n in falcon), plan.dense


def test_linear_subclass_returning_a_pair_stays_dense():
    """Llama-4's and PhiMoE's routers subclass nn.Linear and return (scores, logits): the rule's probe
    crashed on the pair ('tuple' object has no attribute 'shape'); such a layer stays dense."""
    from torch import nn

    from quantspec.formats import get_format
    from quantspec.quant.plan import make_plan

    class PairRouter(nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits.softmax(-1), logits

    model = nn.ModuleDict({"router": PairRouter(64, 8), "proj": nn.Linear(64, 64)})
    plan = make_plan(model, QuantScheme(4, 32, True), get_format("gptq"))
    assert "PairRouter" in plan.dense["router"] and "proj" in plan.quantize


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_linear_its_block_never_calls_is_named(tmp_path, method):
    """TrOCR's decoder blocks hold cross-attention Linears that a text-only forward never calls:
    GPTQ named the layer and the fix, AWQ crashed (TypeError on its missing statistics). Both now
    refuse in one line naming the layer, with nothing written."""
    import transformers

    _, folder, cal = _save_config(tmp_path, "trocr", transformers.TrOCRConfig(
        vocab_size=320, d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with pytest.raises(QuantspecError, match=r"encoder_attn\.\w+_proj is never called by its block's forward") as err:
        quantspec.quantize(str(folder), RECIPES[method](cal), tmp_path / "ckpt", progress=False, device="cpu")
    assert "ignore list" in str(err.value) and not (tmp_path / "ckpt").exists()


def test_blocks_that_do_not_run_alone_get_no_smoothing_pairs(tmp_path):
    """XLM's repeated modules holding Linears are its attention modules, which do not run on the call
    captured for them: architecture inference crashed (RuntimeError) even for RTN. It now finds no
    smoothing pair there: RTN quantizes, AWQ refuses in one line."""
    import transformers

    dense, folder, cal = _save_config(tmp_path, "xlm", transformers.XLMConfig(
        vocab_size=320, emb_dim=64, n_layers=2, n_heads=4, max_position_embeddings=128, pad_index=0, bos_index=1,
        eos_index=2, is_decoder=True))
    rtn = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, True))
    q = quantspec.load_quantized(quantspec.quantize(str(folder), rtn, tmp_path / "ckpt", progress=False,
                                                    device="cpu").out, backend="reference")
    assert _rel(q, dense) < 0.1
    with pytest.raises(QuantspecError, match="awq needs smoothing pairs"):
        quantspec.quantize(str(folder), RECIPES["awq"](cal), tmp_path / "awq", progress=False, device="cpu")
