"""FP8 / NVFP4 / MXFP4 weights: element codes, scales, GPTQ on the non-uniform grid, the
compressed-tensors layouts (cross-checked with compressed-tensors' own compressors), the
reference kernel, bad input. Engines: test_interop_transformers.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from helpers import checkpoint_tensors, make_tiny_model
from quantspec.errors import QuantspecError
from quantspec.formats import get_format, read_quantization_config
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.awq.clip import fake_quantize
from quantspec.core.floatcodes import (
    code_values,
    decode_scales,
    e2m1_codes,
    e4m3fn_to_fnuz,
    fp8_codes,
    quantize_per_token_fp8,
)
from quantspec.quant.floatgrid import group_scales, mx_exponents
from quantspec.quant.gptq import gptq_quantize
from quantspec.quant.recipe import Recipe
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import MX_SCALE_RULE, MX_SCALE_RULES, SCHEME_PRESETS, QuantResult, QuantScheme

PRESETS = list(SCHEME_PRESETS)
CT = get_format("compressed-tensors")


def _rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantResult:
    """RTN, with an input scale where the scheme needs a calibrated one (the engine's job)."""
    r = rtn(w, scheme)
    return replace(r, input_scale=torch.tensor([0.005])) if scheme.static_activations else r
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _weight(n=48, k=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-ish tails and per-row spread, as real weights have
    return torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * (1 + 3 * torch.rand(n, k, generator=g) ** 8)


# --------------------------------------------------------------------------- element codes


def test_fp8_table_is_torch_e4m3fn_and_codes_round_trip():
    table = code_values("fp8")
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)]
    ref = torch.tensor(finite, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(table[finite], ref)
    # every finite byte re-encodes to itself, but -0 (0x80) to +0: one code per value
    assert torch.equal(fp8_codes(ref), torch.tensor([0 if b == 0x80 else b for b in finite], dtype=torch.uint8))
    assert e2m1_codes(torch.tensor([-0.0, -0.1, 0.1])).tolist() == [0, 0, 0]
    # saturation, not NaN: beyond 448 the largest finite byte
    assert fp8_codes(torch.tensor([1e4, -1e4])).tolist() == [0x7E, 0xFE]


def test_e2m1_nearest_ties_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -5.0, 0.26, 4.9])
    vals = code_values("nvfp4")[e2m1_codes(x).long()]
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -4.0, 0.5, 4.0]
    # off the midpoints: the nearest grid value (brute force)
    r = torch.empty(10000).uniform_(-7, 7, generator=torch.Generator().manual_seed(1))
    grid = torch.tensor(E2M1 + [-v for v in E2M1])
    nearest = grid[(r[:, None] - grid[None, :]).abs().argmin(dim=1)]
    assert torch.equal(code_values("nvfp4")[e2m1_codes(r).long()].abs(), nearest.abs())
    assert torch.equal(code_values("nvfp4")[e2m1_codes(r).long()] != 0, nearest != 0)


def test_e2m1_round_by_search_equals_the_comparisons():
    from quantspec.core.floatcodes import e2m1_round, e2m1_search_table

    table = e2m1_search_table()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    mids = torch.cat([mids, -mids])
    inf = torch.tensor(float("inf"))
    x = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),  # each tie and its neighbours
                   torch.tensor([0.0, -0.0, 6.0, -6.0, 1e9, -1e9, float("inf"), -float("inf"), float("nan")]),
                   torch.empty(20000).uniform_(-8, 8, generator=torch.Generator().manual_seed(3))])
    codes, values = e2m1_round(x, table)
    assert codes.dtype == torch.uint8 and torch.equal(codes, e2m1_codes(x))
    assert torch.equal(values, code_values("nvfp4")[e2m1_codes(x).long()])


def test_fnuz_conversion_exact_for_every_byte():
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)[None, :]
    scales = torch.tensor([[0.37]])
    fn = codes.view(torch.float8_e4m3fn).float() * scales
    c2, s2 = e4m3fn_to_fnuz(codes, scales)
    fnuz = c2.view(torch.float8_e4m3fnuz).float() * s2
    assert torch.isfinite(fnuz).all()
    assert torch.equal(fnuz, fn)
    assert fnuz.abs().max() == (448 * scales).max() and c2.view(torch.float8_e4m3fnuz).float().abs().max() == 224


# --------------------------------------------------------------------------- scales and RTN


@pytest.mark.parametrize("preset", PRESETS)
def test_rtn_result_shapes_and_error(preset):
    scheme = SCHEME_PRESETS[preset]
    w = _weight()
    r = _rtn(w, scheme)
    r.validate()
    rel = ((r.dequantize() - w).pow(2).sum() / w.pow(2).sum()).item()
    # FP8 keeps ~3 mantissa bits (rel. MSE ~1e-3); FP4 in groups of 16/32 ~1e-2
    assert rel < (2e-3 if scheme.weights == "fp8" else 3e-2), rel
    assert torch.equal(fake_quantize(w, scheme), r.dequantize())  # AWQ's fake quant is the same grid


def test_nvfp4_scales_fill_fp8_range_and_mxfp4_keeps_the_better_exponent():
    w = _weight()
    r = rtn(w, SCHEME_PRESETS["nvfp4"])
    # the largest group scale lands on E4M3's top (448): global = 448 * 6 / amax
    assert r.scales.float().max().item() == 448.0
    assert torch.allclose(r.global_scale, torch.tensor([448 * 6 / w.abs().max().item()]))
    # MXFP4 as GPTQ asks (the default rule "auto" is mse there): each group's exponent is at least
    # as good as both the OCP rule and the one above; data-free rounding takes round's exponents
    mx = SCHEME_PRESETS["mxfp4"]
    groups = w.reshape(-1, 32)
    e = group_scales(groups, mx, calibrated=True).float() - 127
    assert torch.equal(group_scales(groups, mx), group_scales(groups, _mx("round")))
    def err(exp):
        s = torch.exp2(exp)[:, None]
        return (code_values("mxfp4")[e2m1_codes(groups / s).long()] * s - groups).pow(2).sum(1)
    ocp = torch.floor(torch.log2(groups.abs().amax(1))) - 2
    assert (err(e) <= err(ocp)).all() and (err(e) <= err(ocp + 1)).all()
    assert (e != ocp).any() and (e == ocp).any()  # both choices occur on this weight


def _mx(rule: str) -> QuantScheme:
    return replace(SCHEME_PRESETS["mxfp4"], scale_rule=rule)


def _group(*head: float) -> list[float]:
    return list(head) + [0.0] * (32 - len(head))


# hand-made groups of 32 -> their unbiased exponent under auto (data-free: round), ocp, ceil, mse, round,
# hmse (no importance: mse)
MX_GROUPS = [
    (_group(7.5), (1, 0, 1, 1, 1, 1)),  # ocp clips 7.5 to 6 (err 2.25); at 2**1 it is 8 (err 0.25); 7.5 >= 1.75 * 4
    ([6.5] + [1.5] * 31, (0, 0, 1, 0, 0, 0)),  # ocp clips 6.5 (err 0.25), but the next exponent costs each 1.5 0.25
    ([7.2] + [1.5] * 31, (1, 0, 1, 0, 1, 0)),  # 7.2 = 1.8 * 4 rounds up, though the 1.5s then cost more than its clip
    (_group(4.0, -2.0, 1.0, 0.5), (0, 0, 0, 0, 0, 0)),  # amax a power of two: exact at 2**0, never clipped
    (_group(-(2.0**-10)), (-12, -12, -12, -12, -12, -12)),
    (_group(6.0, 1.0), (0, 0, 0, 0, 0, 0)),  # amax exactly 6 * 2**e: ocp does not clip it
    (_group(), (-2, -2, -2, -2, -2, -2)),  # all zero
]


@pytest.mark.parametrize("rule", MX_SCALE_RULES)
def test_mxfp4_scale_rules_on_hand_made_groups(rule):
    groups = torch.tensor([g for g, _ in MX_GROUPS])
    want = [e[MX_SCALE_RULES.index(rule)] for _, e in MX_GROUPS]
    assert mx_exponents(groups, rule).tolist() == want
    assert (group_scales(groups, _mx(rule)).long() - 127).tolist() == want


def _main_mxfp4_exponents(groups: torch.Tensor) -> torch.Tensor:
    """The one MXFP4 rule before ``scale_rule`` existed, written out: ``floor(log2 amax) - 2`` or
    one more, whichever puts the group (each value on its nearest E2M1 value, by brute force) at
    the smaller squared error; the lower one on a tie; -2 for a zero group."""
    grid = torch.tensor(E2M1 + [-v for v in E2M1])
    amax = groups.abs().amax(1)
    low = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2

    def err(e):
        s = torch.exp2(e)[:, None]
        near = grid[((groups / s)[..., None] - grid).abs().argmin(-1)]
        return (near * s - groups).pow(2).sum(1)

    return torch.where(err(low + 1) < err(low), low + 1, low)


def test_mxfp4_hmse_weights_the_error_by_importance():
    """[7.2] + [1.5] x 31: mse keeps the OCP exponent (clipping 7.2 costs 1.44, the next exponent
    0.25 on each 1.5); with column 0 a hundred times as important the next exponent wins."""
    group = torch.tensor([[7.2] + [1.5] * 31])
    imp = torch.ones(32)
    assert mx_exponents(group, "hmse", imp).tolist() == mx_exponents(group, "mse").tolist() == [0.0]
    imp[0] = 100.0
    assert mx_exponents(group, "hmse", imp).tolist() == [1.0]


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_hmse_reads_the_hessian_diagonal_of_each_group(act_order):
    """GPTQ's first group gets the exponents ``hmse`` gives it with the Hessian's diagonal of its own
    columns (act-order: MXFP4 takes static groups, computed on the natural order before the columns
    are permuted), and they differ from mse's."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g)
    w[:, ::5] *= 3.3  # groups with outliers: the two exponents compete
    x = torch.randn(512, 128, generator=g) * torch.linspace(0.05, 4.0, 128).flip(0)[torch.randperm(128, generator=g)]
    H = x.t() @ x
    scheme = _mx("hmse") if not act_order else replace(_mx("hmse"), act_order=True, static_groups=True)
    res, _ = gptq_quantize(w, H, scheme)
    want = mx_exponents(w[:, :32], "hmse", torch.diagonal(H)[:32]) + 127
    assert torch.equal(res.scales[:, 0].float(), want)
    mse, _ = gptq_quantize(w, H, replace(scheme, scale_rule="mse"))
    assert not torch.equal(res.scales, mse.scales)


def test_mxfp4_default_rule_is_round_for_rtn_and_mse_for_gptq():
    """The default "auto" (chosen per kind of method on the validation split): RTN writes round's
    exponents, GPTQ mse's; the mse rule keeps the codes and scales of the one rule before
    ``scale_rule`` existed (``_main_mxfp4_exponents``)."""
    w = _weight(n=64, k=512, seed=7)
    w[3, :32] = 0  # a zero group
    assert SCHEME_PRESETS["mxfp4"].scale_rule == MX_SCALE_RULE == "auto"
    r, rr = rtn(w, SCHEME_PRESETS["mxfp4"]), rtn(w, _mx("round"))
    assert torch.equal(r.scales, rr.scales) and torch.equal(r.qweight, rr.qweight)
    m = rtn(w, _mx("mse"))
    assert not torch.equal(r.scales, m.scales)
    e = _main_mxfp4_exponents(w.reshape(-1, 32))
    assert torch.equal(m.scales, (e + 127).to(torch.uint8).reshape(64, 16))
    codes = e2m1_codes(w.reshape(-1, 32) / torch.exp2(e)[:, None]).reshape(64, 512)
    assert torch.equal(m.qweight, codes)
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    g_auto, _ = gptq_quantize(w, x.t() @ x, SCHEME_PRESETS["mxfp4"])
    g_mse, _ = gptq_quantize(w, x.t() @ x, _mx("mse"))
    assert torch.equal(g_auto.scales, g_mse.scales) and torch.equal(g_auto.qweight, g_mse.qweight)


def test_mxfp4_rules_differ_and_each_keeps_its_bound():
    w = _weight(n=64, k=512, seed=8)
    groups, amax = w.reshape(-1, 32), w.reshape(-1, 32).abs().amax(1)
    e = {rule: rtn(w, _mx(rule)).scales.reshape(-1).long() - 127 for rule in MX_SCALE_RULES}
    assert ((e["ceil"] != e["ocp"]).any() and (e["mse"] != e["ocp"]).any() and (e["mse"] != e["ceil"]).any())
    assert (amax <= 6 * torch.exp2(e["ceil"].float())).all()  # ceil never clips ...
    assert (amax > 6 * torch.exp2(e["ceil"].float() - 1)).all()  # ... at the smallest such exponent
    for rule in ("mse", "round"):  # one of the two candidates
        assert ((e[rule] == e["ocp"]) | (e[rule] == e["ocp"] + 1)).all()
    assert (e["round"] != e["mse"]).any() and torch.equal(e["hmse"], e["mse"])  # RTN has no Hessian
    err = {rule: (rtn(w, _mx(rule)).dequantize() - w).pow(2).reshape(-1, 32).sum(1) for rule in MX_SCALE_RULES}
    assert (err["mse"] <= err["ocp"]).all() and (err["mse"] <= err["ceil"]).all()
    assert e["ocp"].float().equal(torch.floor(torch.log2(groups.abs().amax(1))) - 2)


def test_mxfp4_scale_rule_is_recorded_and_round_trips_the_checkpoint(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import quantspec
    from quantspec.core.floatcodes import pack_fp4_pairs

    tiny = make_tiny_model(tmp_path, arch="llama")
    dense = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    name = "model.layers.0.mlp.down_proj"
    w = dense.get_submodule(name).weight.detach()
    stored = {}
    for rule in ("ocp", "mse"):
        recipe = Recipe(name="t", method="rtn", format="compressed-tensors", scheme=_mx(rule))
        out = quantspec.quantize(str(tiny), recipe, tmp_path / rule, progress=False).out
        assert Recipe.from_yaml(out / "recipe.yaml") == recipe  # the rule is in the checkpoint's recipe
        tensors = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        stored[rule] = tensors[f"{name}.weight_scale"]
        r = rtn(w, _mx(rule))
        assert torch.equal(tensors[f"{name}.weight_packed"], pack_fp4_pairs(r.qweight))
        assert torch.equal(stored[rule], r.scales)
        back = CT.unpack({k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(name + ".")},
                         _mx(rule), *r.shape)
        assert back.equal(r)
    assert not torch.equal(stored["ocp"], stored["mse"])  # the rules differ on this layer


def test_mxfp4_scale_rule_serialises_for_mxfp4_only():
    assert "scale_rule" not in QuantScheme().to_dict() and "scale_rule" not in SCHEME_PRESETS["nvfp4"].to_dict()
    assert SCHEME_PRESETS["mxfp4"].to_dict()["scale_rule"] == MX_SCALE_RULE
    assert QuantScheme.from_dict(_mx("ocp").to_dict()) == _mx("ocp") != SCHEME_PRESETS["mxfp4"]
    assert [_mx(r).short_name for r in ("ocp", "ceil", MX_SCALE_RULE)] == ["mxfp4-ocp", "mxfp4-ceil", "mxfp4"]


def test_scale_rule_flag_reaches_the_recipe():
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    parse = build_parser().parse_args
    r = recipe_from_args(parse(["quantize", "--method", "gptq", "--scheme", "mxfp4", "--scale-rule", "ceil"]))
    assert r.scheme == _mx("ceil") and r.name == "gptq-mxfp4-ceil"
    assert recipe_from_args(parse(["quantize", "--method", "rtn", "--scheme", "mxfp4"])).scheme.scale_rule == MX_SCALE_RULE
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse(["quantize", "--scheme", "mxfp4", "--scale-rule", "nearest"])


def test_bad_mxfp4_scale_rule_fails_at_once():
    with pytest.raises(QuantspecError, match=r"scale_rule='floor' is not a scale rule of mxfp4 weights.*ocp.*ceil.*mse"):
        _mx("floor")
    with pytest.raises(QuantspecError, match=r"not a scale rule of nvfp4 weights.*amax.*mse"):
        replace(SCHEME_PRESETS["nvfp4"], scale_rule="ocp")
    with pytest.raises(QuantspecError, match="only applies to mxfp4 and nvfp4"):
        replace(SCHEME_PRESETS["fp8-weight"], scale_rule="mse")
    with pytest.raises(QuantspecError, match="scale rule"):
        Recipe.from_dict({"method": "rtn", "format": "compressed-tensors",
                          "scheme": {**SCHEME_PRESETS["mxfp4"].to_dict(), "scale_rule": "OCP"}})
    with pytest.raises(ValueError, match="unknown MXFP4 scale rule 'max'"):
        mx_exponents(torch.ones(2, 32), "max")


def _nv(rule: str) -> QuantScheme:
    return replace(SCHEME_PRESETS["nvfp4"], scale_rule=rule)


def test_nvfp4_mse_rule_picks_the_best_of_the_nearest_codes():
    from quantspec.quant.floatgrid import global_scale, nv_group_scales

    w = _weight(n=64, k=512, seed=9)
    res = {rule: rtn(w, _nv(rule)) for rule in ("auto", "amax", "mse")}
    assert torch.equal(res["auto"].scales.view(torch.uint8), res["amax"].scales.view(torch.uint8))  # the default
    assert torch.equal(res["auto"].qweight, res["amax"].qweight)
    err = {r: (res[r].dequantize() - w).pow(2).reshape(-1, 16).sum(1) for r in ("amax", "mse")}
    assert (err["mse"] <= err["amax"]).all() and err["mse"].sum() < 0.9 * err["amax"].sum()
    step = res["mse"].scales.view(torch.uint8).long() - res["amax"].scales.view(torch.uint8).long()
    assert set(step.unique().tolist()) <= {-2, -1, 0, 1} and (step != 0).any()
    # the choice is the arg-min over the candidates, ties to the nearest code (a group of equal values)
    flat = torch.full((1, 16), 0.37)
    g = global_scale(flat)
    assert torch.equal(nv_group_scales(flat, flat.abs().amax(1), g, "mse").view(torch.uint8),
                       nv_group_scales(flat, flat.abs().amax(1), g, "amax").view(torch.uint8))
    with pytest.raises(ValueError, match="unknown NVFP4 scale rule 'round'"):
        nv_group_scales(flat, flat.abs().amax(1), g, "round")


def test_nvfp4_scale_rule_serialises_when_not_the_default():
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    assert "scale_rule" not in _nv("auto").to_dict() and _nv("mse").to_dict()["scale_rule"] == "mse"
    assert QuantScheme.from_dict(_nv("mse").to_dict()) == _nv("mse")
    assert [_nv(r).short_name for r in ("auto", "mse")] == ["nvfp4", "nvfp4-mse"]
    r = recipe_from_args(build_parser().parse_args(["quantize", "--method", "gptq", "--scheme", "nvfp4",
                                                    "--scale-rule", "mse"]))
    assert r.scheme == _nv("mse") and r.name == "gptq-nvfp4-mse"


# --------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("preset", ["fp8-weight", "nvfp4", "mxfp4"])
def test_gptq_on_float_grid_beats_rtn_on_correlated_inputs(preset):
    scheme = SCHEME_PRESETS[preset]
    g = torch.Generator().manual_seed(3)
    k = 256
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(4096, k, generator=g) @ mix  # correlated inputs, as activations are
    H = 2 * x.T @ x / x.shape[0]
    w = _weight(k=k)
    out_err = lambda r: ((x @ (r.dequantize() - w).T).pow(2).mean() / (x @ w.T).pow(2).mean()).item()  # noqa: E731
    res, info = gptq_quantize(w, H, scheme)
    res.validate()
    assert res.scheme == scheme and (res.global_scale is not None) == (scheme.weights == "nvfp4")
    # the error feedback must pay: at least 15% less output error than rounding to nearest
    assert out_err(res) < 0.85 * out_err(rtn(w, scheme)), (out_err(res), out_err(rtn(w, scheme)))
    ordered = QuantScheme(**{**scheme.to_dict(), "act_order": True, "static_groups": True})
    res2, _ = gptq_quantize(w, H, ordered)
    assert res2.g_idx is None and out_err(res2) < out_err(rtn(w, scheme))


# --------------------------------------------------------------------------- the format


def _random_float_result(scheme: QuantScheme, n=32, k=128, seed=0) -> QuantResult:
    g = torch.Generator().manual_seed(seed)
    if scheme.weights == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int64)
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)  # no NaN bytes
        inp = torch.rand(1, generator=g) if scheme.static_activations else None
        if scheme.is_block:  # one scale per 128x128 block, held on each of its rows
            scales = (torch.rand(-(-n // 128), k // 128, generator=g) + 0.01).repeat_interleave(128, dim=0)[:n]
        else:
            scales = torch.rand(n, 1, generator=g) + 0.01
        return QuantResult(codes, scales, None, None, scheme, input_scale=inp)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64).to(torch.uint8)
    gsz = scheme.group_size
    if scheme.weights == "nvfp4":
        scales = (torch.rand(n, k // gsz, generator=g) * 440 + 1).to(torch.float8_e4m3fn)
        return QuantResult(codes, scales, None, None, scheme, global_scale=torch.tensor([123.5]))
    scales = torch.randint(100, 140, (n, k // gsz), generator=g, dtype=torch.int64).to(torch.uint8)
    return QuantResult(codes, scales, None, None, scheme)


@pytest.mark.parametrize("preset", PRESETS)
def test_pack_unpack_exact(preset):
    scheme = SCHEME_PRESETS[preset]
    for r in (_random_float_result(scheme), _rtn(_weight(k=128), scheme)):
        t = CT.pack(r)
        specs = CT.tensor_specs(scheme, *r.shape)
        assert {n: (tuple(v.shape), v.dtype) for n, v in t.items()} == specs
        assert CT.unpack(t, scheme, *r.shape).equal(r)
        fmt, parsed = read_quantization_config(CT.quantization_config(scheme, ["lm_head"]))
        assert parsed.scheme == scheme and parsed.ignore == ["lm_head"]


def test_fp4_nibble_order_by_hand():
    scheme = SCHEME_PRESETS["mxfp4"]
    codes = torch.arange(32, dtype=torch.uint8).remainder(16)[None, :]
    r = QuantResult(codes, torch.tensor([[127]], dtype=torch.uint8), None, None, scheme)
    packed = CT.pack(r)["weight_packed"]
    assert packed[0, :3].tolist() == [0x10, 0x32, 0x54]  # column 2j low nibble, 2j+1 high


def test_integer_schemes_serialise_as_before():
    # recipes, reports, resume and AWQ scales-file fingerprints of integer schemes are unchanged
    assert "weights" not in QuantScheme().to_dict()
    assert "weights" not in Recipe().to_dict()["scheme"]
    assert SCHEME_PRESETS["nvfp4"].to_dict()["weights"] == "nvfp4"
    assert QuantScheme.from_dict(SCHEME_PRESETS["mxfp4"].to_dict()) == SCHEME_PRESETS["mxfp4"]


def _ct_compress(result: QuantResult) -> dict[str, torch.Tensor]:
    """compressed-tensors' own ModelCompressor on ``result.dequantize()`` with our scales."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    n, k = result.shape
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    apply_quantization_config(model, QuantizationConfig.model_validate(CT.quantization_config(result.scheme, [])))
    lin = model[0]
    with torch.no_grad():
        lin.weight.copy_(result.dequantize())
        if result.scheme.weights == "mxfp4":
            lin.weight_scale.copy_(torch.exp2(result.scales.float() - 127))
        elif result.scheme.is_block:  # their [ceil(N/128), K/128]: the first row of each block
            lin.weight_scale.copy_(result.scales[::128].float())
        else:
            lin.weight_scale.copy_(result.scales.float())
        if result.global_scale is not None:
            lin.weight_global_scale.copy_(result.global_scale)
        if result.input_scale is not None:
            lin.input_scale.copy_(result.input_scale)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    return {name.split(".", 1)[1]: t for name, t in model.state_dict().items()}


@pytest.mark.parametrize("preset", PRESETS)
def test_cross_check_compressed_tensors_compress(preset):
    pytest.importorskip("compressed_tensors")
    scheme = SCHEME_PRESETS[preset]
    r = _rtn(_weight(k=128), scheme)
    ours, theirs = CT.pack(r), _ct_compress(r)
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        a, b = t, theirs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype.itemsize == 1 and a.dtype.is_floating_point:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name


def _ct_fp4_arithmetic(r, stored_global: torch.Tensor | None) -> torch.Tensor:
    """Our FP4 codes and scales put through compressed-tensors' dequantization arithmetic
    (``NVFP4PackedCompressor.decompress`` / ``_dequantize``): element values and scales in bf16
    (both exact there), ``scale / global_scale`` with the global scale as the checkpoint stores
    it (our value, its shape and dtype), the product in that dtype, the result in bf16."""
    n, k = r.qweight.shape
    g = r.scheme.group_len(k)
    values = code_values(r.scheme.weights)[r.qweight.long()].to(torch.bfloat16).view(n, k // g, g)
    scale = decode_scales(r.scales, "mxfp4") if r.scheme.weights == "mxfp4" else r.scales
    scale = scale.to(torch.bfloat16).unsqueeze(-1)
    if r.global_scale is not None:
        scale = scale / r.global_scale.to(stored_global.dtype).reshape(stored_global.shape)
    return (values.to(scale.dtype) * scale).to(torch.bfloat16).view(n, k)


@pytest.mark.parametrize("preset", PRESETS)
def test_cross_check_compressed_tensors_decompress(preset):
    """compressed-tensors' decompressors read our tensors as we do, bit for bit: FP8 equals
    our dequantized weight; FP4, which they dequantize in bf16, equals our codes and scales put
    through their arithmetic (``_ct_fp4_arithmetic``), and our fp32 weight to its bf16
    roundings (2 * 2^-8 relative)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = SCHEME_PRESETS[preset]
    r = _rtn(_weight(k=128), scheme)
    cfg = CT.quantization_config(scheme, [])
    group = cfg["config_groups"]["group_0"]
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    packed = CT.pack(r)
    out = compressor.decompress(dict(packed), QuantizationScheme.model_validate(group))
    w = out["weight"]
    ref = r.dequantize()
    if scheme.weights == "fp8":
        assert torch.equal(w.float(), ref)
    else:
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, _ct_fp4_arithmetic(r, packed.get("weight_global_scale")))
        assert torch.allclose(w.float(), ref, rtol=2 * 2**-8, atol=0)


def test_config_reads_llm_compressor_presets():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme

    for preset, ours in (("FP8_DYNAMIC", "fp8-dynamic"), ("FP8_BLOCK", "fp8-block"), ("NVFP4A16", "nvfp4"),
                         ("MXFP4A16", "mxfp4")):
        group = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
        fmt = CT.quantization_config(SCHEME_PRESETS[ours], [])["format"]
        cfg = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
               "config_groups": {"group_0": {**group, "format": fmt}}}
        assert read_quantization_config(cfg)[1].scheme == SCHEME_PRESETS[ours], preset
    # FP8 static (per-tensor weights and activations) is not read yet: refused by name
    group = preset_name_to_scheme("FP8", ["Linear"]).model_dump(mode="json")
    cfg = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": group}}
    with pytest.raises(QuantspecError, match="strategy 'tensor'"):
        read_quantization_config(cfg)


# --------------------------------------------------------------------------- reference kernel


@pytest.mark.parametrize("preset", PRESETS)
def test_reference_backend(preset):
    scheme = SCHEME_PRESETS[preset]
    r = _rtn(_weight(n=40, k=128), scheme)
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(40)
    be = ReferenceBackend()
    y = be.linear(x, be.prepare(r, torch.float32), scheme, 40, 128, bias)
    w = r.dequantize()
    if scheme.static_activations:  # one calibrated scale for every token; beyond it, 448
        q = (x.reshape(-1, 128) / r.input_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        expect = (q @ w.T) * r.input_scale + bias
        assert q.abs().max() == 448 and not torch.allclose(expect, x.reshape(-1, 128) @ w.T + bias, rtol=1e-2)
    elif scheme.activations:
        q, s = quantize_per_token_fp8(x.reshape(-1, 128))
        assert q.abs().max() == 448  # each token's largest entry maps to E4M3's top
        expect = (q @ w.T) * s + bias
        assert not torch.allclose(expect, x.reshape(-1, 128) @ w.T + bias, rtol=1e-4, atol=0)
    else:
        expect = x.reshape(-1, 128) @ w.T + bias
    assert torch.allclose(y.reshape(-1, 40), expect, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bad input


def test_bad_schemes_fail_at_once():
    with pytest.raises(QuantspecError, match="group_size"):
        QuantScheme(bits=4, group_size=32, weights="nvfp4")
    with pytest.raises(QuantspecError, match="symmetric"):
        QuantScheme(bits=8, group_size=-1, weights="fp8", symmetric=False)
    with pytest.raises(QuantspecError, match="fp8 weights"):
        QuantScheme(bits=8, group_size=-1, activations="fp8-token-dynamic")
    with pytest.raises(QuantspecError, match="compressed-tensors"):
        Recipe(method="rtn", format="gptq", scheme=SCHEME_PRESETS["nvfp4"])
    with pytest.raises(QuantspecError, match="compressed-tensors"):
        Recipe(method="awq", format="awq", scheme=SCHEME_PRESETS["mxfp4"])
    with pytest.raises(QuantspecError, match="int8 activation"):
        Recipe(method="smoothquant", format="compressed-tensors", scheme=SCHEME_PRESETS["fp8-dynamic"])
    assert "integer codes" in get_format("gptq").cannot_hold(SCHEME_PRESETS["fp8-weight"], 64, 64)


@pytest.mark.parametrize("extra,expect", [
    (["--scheme", "nvfp4", "--format", "gptq"], "compressed-tensors"),
    (["--scheme", "mxfp4", "--bits", "4"], "--bits"),
    (["--scheme", "fp8-dynamic", "--method", "smoothquant"], "int8 activation"),
    (["--bits", "4", "--scale-rule", "ocp"], "only applies to mxfp4"),
])
def test_cli_refuses_before_work(tmp_path, extra, expect):
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(tmp_path / "no-model"), *extra,
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra", [["--scheme", "fp8-dynamic"], ["--scheme", "nvfp4"], ["--bits", "4", "--kv-cache", "fp8"]])
def test_cli_refuses_float_without_torch_float8(tmp_path, monkeypatch, capsys, extra):
    """A torch without float8 dtypes (before 2.1, or a custom build) gets one line naming the fix, before
    the model is even looked for (the path does not exist), and no output folder."""
    from quantspec.cli.main import main

    monkeypatch.setattr("quantspec.core.floatcodes.HAS_FLOAT8", False)
    code = main(["quantize", str(tmp_path / "no-model"), *extra, "--format", "compressed-tensors",
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "float8 dtypes" in err and "install torch >= 2.4" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_loading_a_float_checkpoint_without_torch_float8(tmp_path, monkeypatch):
    import quantspec

    out = quantspec.quantize(str(make_tiny_model(tmp_path, arch="llama")),
                             Recipe(name="f", method="rtn", format="compressed-tensors", scheme=SCHEME_PRESETS["mxfp4"]),
                             tmp_path / "q", progress=False).out
    monkeypatch.setattr("quantspec.core.floatcodes.HAS_FLOAT8", False)
    with pytest.raises(QuantspecError, match="float8 dtypes"):
        quantspec.load_quantized(out)


def test_cli_quantizes_and_loads_nvfp4_gptq(tmp_path):
    import quantspec

    model = make_tiny_model(tmp_path, arch="llama")
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(model), "--method", "gptq",
                        "--scheme", "nvfp4", "--calib", "pydoc", "--calib-samples", "8", "--calib-seqlen", "64",
                        "--out", str(out), "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "nvfp4" in r.stdout and "compressed-tensors" in r.stdout
    qm = quantspec.load_quantized(out, dtype=torch.float32)
    lin = qm.get_submodule("model.layers.0.mlp.down_proj")
    from quantspec.kernels.cpu_ext import load_cpu_ext

    # the cpu backend's float kernel where the extension builds, else the reference
    assert lin.scheme == SCHEME_PRESETS["nvfp4"]
    assert lin.backend_name == ("cpu" if load_cpu_ext() is not None else "reference")
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = qm(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    shown = subprocess.run([sys.executable, "-m", "quantspec", "inspect", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0 and "nvfp4" in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp4", "fp8-static"])  # fp8-static: FP8 weights and input scales
def test_cli_awq_scales_before_float_rounding(tmp_path, preset):
    """AWQ's scale search on the FP4 and FP8 grids, end to end: every Linear of the blocks is quantized
    to the float scheme, each one that can take AWQ's scales with them (its block loss never above
    RTN's on the same grid, and below it somewhere: the scales found do something; the others
    reported with the reason), the export loads, and its weights are not RTN's (the scales were
    folded in)."""
    import quantspec

    model = make_tiny_model(tmp_path, arch="llama", hidden_size=128, intermediate_size=256)
    outs = {"awq": tmp_path / "awq", "rtn": tmp_path / "rtn"}
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(model), "--method", "awq",
                        "--scheme", preset, "--calib", "pydoc", "--calib-samples", "8", "--calib-seqlen", "64",
                        "--out", str(outs["awq"]), "--no-progress"], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    quantspec.quantize(str(model), Recipe(name="rtn", method="rtn", format="compressed-tensors",
                                          scheme=SCHEME_PRESETS[preset]), outs["rtn"], progress=False)
    report = json.loads((outs["awq"] / "quant_report.json").read_text())
    assert set(report["dense_layers"]) <= {"lm_head"}
    layers = report["layers"]
    quantized = {n: row for n, row in layers.items() if row["status"] == "quantized"}
    assert len(quantized) == 14 and all(row["scheme"] == preset for row in quantized.values())
    scaled = {n: row for n, row in quantized.items() if "awq_loss" in row}
    # o_proj has no scale to take (GQA: v_proj's 64 outputs feed 128 inputs), and says so
    assert set(quantized) - set(scaled) == {f"model.layers.{i}.self_attn.o_proj" for i in (0, 1)}
    assert all("v_proj has 64 outputs" in quantized[n]["smoothing_skipped"][0] for n in set(quantized) - set(scaled))
    assert all(row["awq_loss"] <= row["awq_loss_rtn"] for row in scaled.values())
    better = [n for n, row in scaled.items() if row["awq_loss"] < row["awq_loss_rtn"]]
    assert better
    qm = quantspec.load_quantized(outs["awq"], dtype=torch.float32)
    assert all(qm.get_submodule(n).scheme == SCHEME_PRESETS[preset] for n in quantized)
    awq_t, rtn_t = checkpoint_tensors(outs["awq"]), checkpoint_tensors(outs["rtn"])
    for n in better:  # a layer whose scales beat RTN holds other codes than RTN's
        key = f"{n}.weight_packed" if preset.endswith("fp4") else f"{n}.weight"
        a, b = awq_t[key], rtn_t[key]
        assert a.shape == b.shape and not torch.equal(a, b), n
        if preset == "fp8-static":  # observed on the smoothed inputs the deployed layer reads, not the model's
            assert not torch.equal(awq_t[f"{n}.input_scale"], rtn_t[f"{n}.input_scale"]), n
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(qm(input_ids=ids).logits).all()


def test_resume_journal_keeps_float_scales():
    """The resume journal stores every tensor of a result (NVFP4's global scale, the static
    input scale): without them a resumed block could not be packed."""
    from quantspec.quant.resume import result_tensors, results_from_tensors

    results = {f"l.{p}": _rtn(_weight(k=128), SCHEME_PRESETS[p]) for p in PRESETS}
    back = results_from_tensors(result_tensors(results, "x."), {n: r.scheme.to_dict() for n, r in results.items()}, "x.")
    assert all(back[n].equal(r) for n, r in results.items())


def test_engine_calibrates_static_input_scales():
    """fp8-static: each Linear's input scale is max |input| / 448 over the calibration samples,
    with the block's quantized weights in place (what the deployed layer sees)."""
    from transformers import AutoModelForCausalLM

    from quantspec.quant.arch_infer import get_arch
    from quantspec.quant.calibrate import run_blockwise
    from quantspec.quant.plan import make_plan
    from quantspec.quant.registry import build_method

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        model = AutoModelForCausalLM.from_pretrained(make_tiny_model(Path(tmp), arch="llama"), dtype=torch.float32)
    recipe = Recipe(method="rtn", format="compressed-tensors", scheme=SCHEME_PRESETS["fp8-static"])
    plan = make_plan(model, recipe.scheme, CT, recipe.targets, recipe.ignore).quantize
    ids = torch.randint(3, 300, (3, 16), generator=torch.Generator().manual_seed(5))
    results = run_blockwise(model, get_arch(model), ids, build_method(recipe), plan, progress=False)
    seen: dict[str, float] = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), a[0].abs().max().item()))) for n in plan]
    with torch.no_grad():  # the model now holds the dequantized weights
        for j in range(ids.shape[0]):
            model(input_ids=ids[j : j + 1])
    for h in hooks:
        h.remove()
    assert set(results) == set(plan)
    for n, r in results.items():
        assert r.input_scale is not None
        assert torch.allclose(r.input_scale, torch.tensor([seen[n] / 448]), rtol=1e-6), n


# --------------------------------------------------------------------------- cpu kernel


def _needs_ext():
    from quantspec.kernels.cpu_ext import load_cpu_ext

    if load_cpu_ext() is None:
        pytest.skip("no C++ compiler / the cpu extension did not build")


@pytest.mark.parametrize("preset", ["fp8-weight", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 3, 6])
def test_cpu_float_kernel_matches_reference(preset, m):
    """csrc/cpu_fgemv.cpp against the reference: fp32 activations on both sides, products exact,
    sums in another order: max |y - y_ref| <= 1e-5 x max |y_ref|. The cpu backend computes the
    declared scheme here, so eval's ``exact`` choice takes it."""
    _needs_ext()
    from quantspec.kernels.backend import choose_backend
    from quantspec.kernels.cpu import CpuBackend

    scheme = SCHEME_PRESETS[preset]
    n, k = 70, 256
    w = _weight(n=n, k=k, seed=m)
    w[:3] *= 1e-3  # small rows: FP8 subnormal codes, tiny FP4 scales
    r = rtn(w, scheme)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16)
    cpu, ref = CpuBackend(), ReferenceBackend()
    y = cpu.linear(x, cpu.prepare(r, x.dtype), scheme, n, k, b).float()
    y_ref = ref.linear(x.float(), ref.prepare(r, torch.float32), scheme, n, k, b.float())
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max() + 2**-8 * y_ref.abs().max()  # bf16 output rounding
    y32 = cpu.linear(x.float(), cpu.prepare(r, torch.float32), scheme, n, k, None)
    y32_ref = ref.linear(x.float(), ref.prepare(r, torch.float32), scheme, n, k, None)
    assert (y32 - y32_ref).abs().max() <= 1e-5 * y32_ref.abs().max()
    assert choose_backend(scheme, n, k, torch.device("cpu"), torch.float32, "exact")[0].name == "cpu"


@pytest.mark.parametrize("preset", ["fp8-weight", "nvfp4", "mxfp4"])
def test_cpu_float_dense_regime_is_the_reference(preset, monkeypatch):
    """From FLOAT_DENSE_FROM_M rows (a perplexity window, a KV calibration sample) the cpu backend
    dequantizes DENSE_TILE_N weight rows at a time (float_weight_rows: the reference's values,
    bit-equal) and multiplies in fp32: with fp32 x, max |y - y_ref| <= 1e-6 x max |y_ref| (the
    same products, matmul's summation); bf16 x widened; N spanning several tiles (2 + a partial)."""
    _needs_ext()
    from quantspec.kernels import cpu

    monkeypatch.setattr(cpu, "DENSE_TILE_N", 32)
    calls = []
    dense = cpu._dense_float
    monkeypatch.setattr(cpu, "_dense_float", lambda *a: calls.append(a[0].shape[0]) or dense(*a))
    scheme = SCHEME_PRESETS[preset]
    n, k = 70, 256
    w = _weight(n=n, k=k, seed=5)
    w[:3] *= 1e-3
    r = rtn(w, scheme)
    prepared = cpu.CpuBackend().prepare(r, torch.float32)
    assert torch.equal(cpu.float_weight_rows(prepared, scheme.weights, scheme.group_len(k), 0, n), r.dequantize())
    m = cpu.FLOAT_DENSE_FROM_M
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    b = torch.randn(n)
    ref = ReferenceBackend()
    y_ref = ref.linear(x, ref.prepare(r, torch.float32), scheme, n, k, b)
    y = cpu.CpuBackend().linear(x, prepared, scheme, n, k, b)
    assert (y - y_ref).abs().max() <= 1e-6 * y_ref.abs().max()
    yb = cpu.CpuBackend().linear(x.to(torch.bfloat16), prepared, scheme, n, k, None)
    yb_ref = ref.linear(x.to(torch.bfloat16).float(), ref.prepare(r, torch.float32), scheme, n, k, None)
    assert yb.dtype == torch.bfloat16 and (yb.float() - yb_ref).abs().max() <= 2**-8 * yb_ref.abs().max()
    cpu.CpuBackend().linear(x[: m - 1], prepared, scheme, n, k, b)  # below the threshold: fgemm
    assert calls == [m, m]


def _fgemm(x, prepared, scheme, k):
    return torch.ops.quantspec_cpu.fgemm(x, prepared["fcodes"], prepared["fscales"], prepared["gscale"],
                                         int(prepared["fkind"]), scheme.group_len(k))


@pytest.mark.parametrize("preset", ["fp8-weight", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(70, 256), (9, 576), (33, 224)])
def test_cpu_float_kernel_bf16_activations(preset, n, k):
    """bf16 x takes the AVX-512 BF16 path where the CPU has it (has_bf16_gemv; K a multiple of 64
    for FP4, 32 for FP8, else the fp32 path): the same exact products summed in another order, so
    against the fp32 path on the widened x, max |diff| <= 1e-5 x max |y|, for M = 1..6 (every
    tile shape: 4 rows of x, 2, 1, and a 3 split into 2 + 1) and N not a multiple of 4."""
    _needs_ext()
    from quantspec.kernels.cpu import CpuBackend

    scheme = SCHEME_PRESETS[preset]
    w = _weight(n=n, k=k, seed=k)
    w[:3] *= 1e-3
    prepared = CpuBackend().prepare(rtn(w, scheme), torch.bfloat16)
    for m in range(1, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y, y32 = _fgemm(x, prepared, scheme, k), _fgemm(x.float(), prepared, scheme, k)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert (y - y32).abs().max() <= 1e-5 * y32.abs().max(), (m, (y - y32).abs().max())


@pytest.mark.parametrize("preset", ["fp8-weight", "nvfp4", "mxfp4"])
def test_cpu_float_kernel_reads_every_weight_back_from_bf16_one_hot(preset):
    """One-hot bf16 activations read single weights back, bit-equal to the fp32 path; FP8 and
    MXFP4 (power-of-two scales) also bit-equal to dequantize: every code, with the sign, at
    every position of a 64-column chunk (the FP4 path reads x in a split order)."""
    _needs_ext()
    from quantspec.kernels.cpu import CpuBackend

    scheme = SCHEME_PRESETS[preset]
    k = 256
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 256 if preset == "fp8-weight" else 16, (6, k), generator=g, dtype=torch.uint8)
    if preset == "fp8-weight":
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN bytes are never written
        codes[0] = torch.arange(k, dtype=torch.uint8)
        codes[0, 127] = codes[0, 255] = 1
        scales = torch.rand(6, 1, generator=g) + 0.5
        r = QuantResult(codes, scales, None, None, scheme)
    else:
        r = rtn(_weight(n=6, k=k, seed=3), scheme)
        r = replace(r, qweight=codes.to(r.qweight.dtype))
    prepared = CpuBackend().prepare(r, torch.bfloat16)
    eye = torch.eye(k)
    y, y32 = _fgemm(eye.to(torch.bfloat16), prepared, scheme, k), _fgemm(eye, prepared, scheme, k)
    assert torch.equal(y, y32)
    if preset != "nvfp4":  # NVFP4's dequantize divides by the global scale, the kernel multiplies
        assert torch.equal(y.T, r.dequantize())


def test_cpu_fp8_kernel_decodes_every_byte():
    """One-hot activations read single weights back: every E4M3FN byte (subnormals included)."""
    _needs_ext()
    from quantspec.kernels.cpu import CpuBackend

    scheme = SCHEME_PRESETS["fp8-weight"]
    codes = torch.tensor([b for b in range(256) if (b & 0x7F) != 0x7F] + [0, 0], dtype=torch.uint8)  # K = 256
    r = QuantResult(codes[None, :].repeat(2, 1), torch.tensor([[1.0], [0.5]]), None, None, scheme)
    cpu = CpuBackend()
    y = cpu.linear(torch.eye(256), cpu.prepare(r, torch.float32), scheme, 2, 256, None)
    assert torch.equal(y.T, r.dequantize())


@pytest.mark.parametrize("preset,rule", [("mxfp4", r) for r in ("mse", "round", "ocp", "ceil", "hmse")]
                         + [("nvfp4", r) for r in ("amax", "mse")])
def test_static_scales_of_all_groups_at_once_equal_the_per_group_ones(preset, rule):
    """GPTQ's static group scales come from one call over every whole group; they must be the
    scales the per-group call gives, bit for bit (checkpoints stay byte-identical)."""
    from quantspec.quant.floatgrid import tensor_global_scale
    from quantspec.quant.gptq import _params, _static_params

    scheme = replace(SCHEME_PRESETS[preset], scale_rule=rule, act_order=True, static_groups=True)
    gen = torch.Generator().manual_seed(3)
    for n, k in ((64, 256), (40, 96), (7, 1536)):
        W = torch.randn(n, k, generator=gen) * torch.rand(1, k, generator=gen).mul(4).exp()  # uneven columns
        hdiag = torch.rand(k, generator=gen) + 0.01
        glen = scheme.group_len(k)
        gscale = tensor_global_scale(W, scheme)
        got = _static_params(W, scheme, glen, torch.float16, gscale, hdiag)
        want = [_params(W[:, s : s + glen], scheme, torch.float16, gscale, hdiag[s : s + glen]) for s in range(0, k, glen)]
        assert len(got) == len(want) == k // glen
        for (gs, gz), (ws, wz) in zip(got, want):
            assert gz is None and wz is None
            assert gs.dtype == ws.dtype and gs.view(torch.uint8).equal(ws.view(torch.uint8))
