"""Architecture declarations against tiny random models of every declared family."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from quantspec.errors import QuantspecError
from quantspec.quant.arch import ARCHS, block_linears, check_arch
from quantspec.quant.arch_infer import get_arch, infer_arch
from quantspec.quant.smoothing import fold_scales, resolve_pairs

from helpers import ARCHS as ARCH_NAMES, UNDECLARED, tiny_config

# the declared dense families, with a 96-wide MLP (not a multiple of 64) and 128 tokens
CONFIGS = {arch: (lambda arch=arch: tiny_config(arch, vocab_size=128, intermediate_size=96,
                                                max_position_embeddings=64)) for arch in ARCH_NAMES}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls on a shared CPU: more threads only add contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(CONFIGS[model_type]()).eval()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_declaration_fits_model(model_type):
    model = tiny(model_type)
    spec = get_arch(model)
    assert spec is ARCHS[model_type]
    assert check_arch(model, spec) == []
    assert len(spec.block_list(model)) == 2
    assert isinstance(model.get_submodule(spec.embed), nn.Embedding)
    assert isinstance(model.get_submodule(spec.lm_head), nn.Linear)
    # Every Linear of a block is declared exactly once.
    declared = spec.linear_names()
    assert len(set(declared)) == len(declared)
    block = spec.block_list(model)[0]
    actual = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(actual) == sorted(declared)
    for pair in spec.smooth:
        assert block.get_submodule(pair.prev) is not None
        for lin in pair.linears:
            assert isinstance(block.get_submodule(lin), nn.Linear)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_generic_fallback_matches_declaration(model_type):
    model = tiny(model_type)
    spec, found = ARCHS[model_type], infer_arch(model)
    assert found.blocks == spec.blocks
    assert found.embed == spec.embed
    assert found.final_norm == spec.final_norm
    assert found.lm_head == spec.lm_head
    assert found.sequential == spec.sequential


def test_gemma_norm_offset_and_mlp_norm():
    assert ARCHS["gemma2"].norm_offset == 1.0 and ARCHS["gemma3_text"].norm_offset == 1.0
    assert ARCHS["llama"].norm_offset == 0.0
    model = tiny("gemma2")
    norm = model.get_submodule("model.layers.0.input_layernorm")
    x = torch.randn(3, 64)
    with torch.no_grad():
        norm.weight.normal_()
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(norm(x), rms * (1.0 + norm.weight))
    mlp_pair = [p for p in ARCHS["gemma2"].smooth if "mlp.gate_proj" in p.linears][0]
    assert mlp_pair.prev == "pre_feedforward_layernorm"


def test_gqa_v_to_o_shapes_mismatch_is_declared():
    model = tiny("llama")
    block = ARCHS["llama"].block_list(model)[0]
    v, o = block.self_attn.v_proj, block.self_attn.o_proj
    assert v.out_features != o.in_features  # consumers must skip this pair


def test_phi3_fused_parts_fit():
    model = tiny("phi3")
    block = ARCHS["phi3"].block_list(model)[0]
    for pair in ARCHS["phi3"].smooth:
        prev = block.get_submodule(pair.prev)
        if pair.prev_parts > 1:
            lin = block.get_submodule(pair.linears[0])
            fits = prev.out_features == pair.prev_parts * lin.in_features
            # gate_up -> down always fits; qkv -> o only without GQA (4 vs 2 heads here).
            assert fits == (pair.prev == "mlp.gate_up_proj")


def test_unknown_model_type_uses_generic():
    model = tiny("llama")
    model.config.model_type = "not-a-family"
    spec = get_arch(model)
    assert spec.name == "generic" and spec.sequential == ARCHS["llama"].sequential
    assert len(block_linears(model, spec)) == 14


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"model_type": "weird"})()
        self.proj = nn.Linear(4, 4)


def test_no_blocks_is_a_user_error_naming_the_model_type():
    with pytest.raises(QuantspecError, match="weird"):
        get_arch(_NoBlocks())


# ---------------------------------------------------------------------------------------------
# Smoothing pairs found by structure (quantspec/quant/arch_infer.py)


@pytest.mark.parametrize("kv_heads", (2, 4), ids=("gqa", "mha"))
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_generic_fallback_finds_the_declared_pairs(model_type, kv_heads):
    """Without the declaration, the folding test finds exactly the declared pairs that fit
    (v -> o only without grouped-query attention), with Gemma's norm offset."""
    torch.manual_seed(0)
    config = CONFIGS[model_type]()
    config.num_key_value_heads = kv_heads
    model = AutoModelForCausalLM.from_config(config).eval()
    spec = ARCHS[model_type]
    fitting, _ = resolve_pairs(spec.block_list(model)[0], spec)
    found = infer_arch(model)
    assert {(p.prev, p.linears) for p in found.smooth} == {(p.prev_name, p.linear_names) for p in fitting}
    assert found.norm_offset == spec.norm_offset


def _undeclared():
    narrow = {"opt": {"ffn_dim": 96}, "gptj": {"n_inner": 96}, "gpt_neox": {"intermediate_size": 96},
              "phi": {"intermediate_size": 96}, "cohere": {"intermediate_size": 96}}
    return {f: (lambda f=f: tiny_config(f, vocab_size=128, **narrow.get(f, {}))) for f in UNDECLARED}


# pairs each undeclared family must yield (prev -> its Linears); others may be found too
EXPECTED = {
    "opt": {("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attn.v_proj", ("self_attn.out_proj",)), ("final_layer_norm", ("fc1",)),
            ("fc1", ("fc2",))},  # ReLU is positively homogeneous: fc1 -> fc2 folds exactly
    "gptj": {("ln_1", ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"))},  # parallel block
    "gpt_neox": {("input_layernorm", ("attention.query_key_value",)),
                 ("post_attention_layernorm", ("mlp.dense_h_to_4h",))},
    "falcon": {("ln_attn", ("self_attention.query_key_value",)), ("ln_mlp", ("mlp.dense_h_to_4h",))},
    "phi": {("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.fc1"))},
    "cohere": {("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                    "mlp.gate_proj", "mlp.up_proj")), ("mlp.up_proj", ("mlp.down_proj",))},
    "bloom": {("input_layernorm", ("self_attention.query_key_value",)),
              ("post_attention_layernorm", ("mlp.dense_h_to_4h",))},
}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_generic_pairs_of_undeclared_families_fold_exactly(family):
    """Families with no declaration: the expected pairs are found, and folding random scales
    into every found pair of every block leaves the logits unchanged (fp32, 1e-4 relative)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_undeclared()[family]()).eval()
    spec = get_arch(model)
    assert spec.name == "generic"
    assert EXPECTED[family] <= {(p.prev, p.linears) for p in spec.smooth}
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        g = torch.Generator().manual_seed(2)
        for block in spec.block_list(model):
            pairs, skipped = resolve_pairs(block, spec)
            assert len(pairs) == len(spec.smooth) and not skipped
            for pair in pairs:
                fold_scales(pair, torch.empty(pair.channels).uniform_(0.3, 3.0, generator=g))
        out = model(input_ids=ids).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-4


def test_smoothing_methods_refuse_a_model_without_pairs():
    from dataclasses import replace

    from quantspec.quant.job import check_smoothing
    from quantspec.quant.registry import build_method
    from quantspec.quant.recipe import Recipe
    from quantspec.core.scheme import QuantScheme

    model = tiny("llama")
    bare = replace(ARCHS["llama"], smooth=())
    for method in ("awq", "smoothquant", "awq+gptq"):
        scheme = QuantScheme(8, -1, True, activations="int8-token-dynamic") if method == "smoothquant" \
            else QuantScheme(4, 32, method == "awq+gptq")
        fmt = {"awq": "awq", "smoothquant": "compressed-tensors", "awq+gptq": "gptq"}[method]
        recipe = Recipe(name="t", method=method, format=fmt, scheme=scheme)
        with pytest.raises(QuantspecError, match="no|none were found") as err:
            check_smoothing(bare, build_method(recipe), model, method)
        assert "llama" in str(err.value) and "gptq" in str(err.value)
        check_smoothing(ARCHS["llama"], build_method(recipe), model, method)  # the declared pairs: accepted
    gptq = Recipe(name="t", method="gptq", format="gptq", scheme=QuantScheme(4, 32, True))
    check_smoothing(bare, build_method(gptq), model, "gptq")
