"""NVFP4 layers an engine fuses (q/k/v, gate/up, each expert's gate/up) share one global scale.

vLLM keeps one NVFP4 global scale per fused Linear: ``weight_global_scale.max()`` of the shards
(compressed_tensors_w4a4_nvfp4.py), so shards written with their own scales are dequantized by
the wrong factor there. Every method writes the siblings' joint scale (quant/fused_scales.py)."""

from __future__ import annotations

import pytest
import torch

import quantspec
from helpers import calib_text, checkpoint_tensors, make_tiny_model, tiny_model
from quantspec.core.floatcodes import FP4_MAX, FP8_MAX
from quantspec.core.scheme import SCHEME_PRESETS
from quantspec.quant.fused_scales import fused_siblings
from quantspec.quant.options import CalibrationConfig
from quantspec.quant.recipe import Recipe

NV = SCHEME_PRESETS["nvfp4"]


def test_siblings_are_a_groups_linears_under_one_parent():
    group = ["m.l.0.self_attn.q_proj", "m.l.0.self_attn.k_proj", "m.l.0.self_attn.v_proj"]
    assert fused_siblings(group) == [group]
    experts = [f"m.l.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj")]
    assert fused_siblings(experts) == [experts[:2], experts[2:]]  # expert by expert
    assert fused_siblings(["m.l.0.mlp.shared_expert.gate_proj", "m.l.0.mlp.gate_proj"]) == [
        ["m.l.0.mlp.shared_expert.gate_proj"], ["m.l.0.mlp.gate_proj"]]


def _global_scales(out) -> dict[str, float]:
    return {k.rpartition(".")[0]: float(v) for k, v in checkpoint_tensors(out).items()
            if k.endswith("weight_global_scale")}


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_fused_siblings_share_the_global_scale(method, tmp_path):
    """q/k/v share one scale and gate/up another, o and down keep their own; RTN and GPTQ (which
    do not change the weights before rounding) write ``448 * 6 / max amax`` of the siblings."""
    folder = make_tiny_model(tmp_path, "llama")
    calib = CalibrationConfig(data=str(calib_text(tmp_path)), samples=4, seqlen=32)
    recipe = Recipe(name="t", method=method, scheme=NV, format="compressed-tensors", calibration=calib)
    gs = _global_scales(quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False).out)
    dense = tiny_model("llama")
    for b in range(dense.config.num_hidden_layers):
        p = f"model.layers.{b}"
        for names in ([f"{p}.self_attn.{x}_proj" for x in "qkv"], [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"]):
            assert len({gs[n] for n in names}) == 1, {n: gs[n] for n in names}
            if method != "awq":  # AWQ rounds its scaled weights
                amax = max(float(dense.get_submodule(n).weight.detach().abs().amax()) for n in names)
                assert gs[names[0]] == pytest.approx(FP8_MAX * FP4_MAX / amax, rel=1e-6)
        own = float(dense.get_submodule(f"{p}.self_attn.o_proj").weight.detach().abs().amax())
        if method != "awq":
            assert gs[f"{p}.self_attn.o_proj"] == pytest.approx(FP8_MAX * FP4_MAX / own, rel=1e-6)


def test_each_experts_gate_and_up_share_a_scale(tmp_path):
    """A Qwen3-MoE block: each expert's gate/up one scale (vLLM's w13), experts apart."""
    folder = make_tiny_model(tmp_path, "qwen3_moe")
    recipe = Recipe(name="t", method="rtn", scheme=NV, format="compressed-tensors")
    gs = _global_scales(quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False).out)
    pairs = {}
    for name, v in gs.items():
        if ".experts." in name and name.endswith(("gate_proj", "up_proj")):
            pairs.setdefault(name.rpartition(".")[0], set()).add(v)
    assert len(pairs) > 2 and all(len(v) == 1 for v in pairs.values())
    assert len({next(iter(v)) for v in pairs.values()}) > 1  # not one scale for every expert
