"""FP8 block weights (DeepSeek-V3 / compressed-tensors FP8_BLOCK): one fp32 scale per 128x128
block of the weight, activations FP8 per token per 128 input columns (``fp8-group-dynamic``).

Every expectation is computed independently of the code under test (blocks cut by hand,
torch's own float8 cast, fp64 sums). The presets also run through the parametrized float tests
of test_float_schemes.py (compressed-tensors' own compressor and decompressor on our tensors).
"""

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
from quantspec.kernels.backend import choose_backend, computes_declared_scheme
from quantspec.kernels.reference import ReferenceBackend
from quantspec.quant.awq.clip import fake_quantize
from quantspec.quant.gptq import gptq_quantize
from quantspec.quant.recipe import Recipe
from quantspec.quant.rtn import rtn
from quantspec.core.scheme import SCHEME_PRESETS, QuantResult, QuantScheme

BLOCK = SCHEME_PRESETS["fp8-block"]
WEIGHT_ONLY = SCHEME_PRESETS["fp8-block-weight"]
CT = get_format("compressed-tensors")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows and blocks of very different magnitudes, heavy tails: block scales matter."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (1 + 3 * torch.rand(n, k, generator=g) ** 8)
    return w * torch.logspace(-2, 1, n)[torch.randperm(n, generator=g)][:, None]


def _blocks(n: int, k: int):
    """(row slice, column slice, column block index) of every 128x128 block, cut by hand."""
    for r0 in range(0, n, 128):
        for c0 in range(0, k, 128):
            yield slice(r0, min(r0 + 128, n)), slice(c0, c0 + 128), c0 // 128


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to E4M3FN by torch's own cast (saturating at 448), fp32."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


# --------------------------------------------------------------------------- the scheme


def test_scheme_contract_and_refusals():
    assert BLOCK.is_block and WEIGHT_ONLY.is_block and not SCHEME_PRESETS["fp8-weight"].is_block
    assert (BLOCK.weights, BLOCK.bits, BLOCK.group_size, BLOCK.activations) == ("fp8", 8, 128, "fp8-group-dynamic")
    assert (BLOCK.short_name, WEIGHT_ONLY.short_name) == ("fp8-block", "fp8-block-weight")
    assert QuantScheme.from_dict(BLOCK.to_dict()) == BLOCK
    with pytest.raises(QuantspecError, match="fp8-group-dynamic"):  # group activations need block weights
        QuantScheme(bits=8, group_size=-1, weights="fp8", activations="fp8-group-dynamic")
    with pytest.raises(QuantspecError, match="do not go with"):  # per-token activations: per-channel fp8
        QuantScheme(bits=8, group_size=128, weights="fp8", activations="fp8-token-dynamic")
    with pytest.raises(QuantspecError, match="group_size"):
        QuantScheme(bits=8, group_size=64, weights="fp8")
    with pytest.raises(QuantspecError, match="fp8 weights"):
        QuantScheme(bits=8, group_size=-1, activations="fp8-group-dynamic")


def test_awq_clip_refused_with_the_fix():
    from quantspec.quant.options import AWQOptions

    for method in ("awq", "awq+gptq"):
        with pytest.raises(QuantspecError, match="block") as err:
            Recipe(method=method, format="compressed-tensors", scheme=WEIGHT_ONLY, awq=AWQOptions(clip=True))
        assert "awq.clip: false" in str(err.value) and "\n" not in str(err.value)
    Recipe(method="awq", format="compressed-tensors", scheme=WEIGHT_ONLY)  # clip off by default at 8 bits


# --------------------------------------------------------------------------- RTN


@pytest.mark.parametrize("n,k", [(256, 256), (200, 384), (130, 128), (5, 256)])
def test_rtn_block_scales_match_a_computation_by_hand(n, k):
    """N need not be a multiple of 128 (the last block of rows is shorter)."""
    w = _weight(n, k, seed=n)
    w[:, :128][: min(n, 128)] = 0.0  # an all-zero block: scale 1
    r = rtn(w, BLOCK)
    r.validate()
    assert r.scales.dtype == torch.float32 and r.scales.shape == (n, k // 128)
    expect = torch.empty(n, k)
    for rows, cols, g in _blocks(n, k):
        amax = w[rows, cols].abs().max()
        s = amax / 448 if amax > 0 else torch.tensor(1.0)
        assert (r.scales[rows, g] == s).all(), (rows, g)  # every row of the block holds its scale
        expect[rows, cols] = _fp8(w[rows, cols] / s) * s
    assert r.scales[0, 0] == 1.0
    assert torch.equal(r.dequantize(), expect)
    assert torch.equal(fake_quantize(w, BLOCK), expect)  # AWQ's fake quant: the same blocks


def test_rtn_error_bounded():
    """E4M3 keeps 3 mantissa bits: each weight is within half a step, |w| * 2^-4 for normal
    values, plus 2^-10 * scale (half the subnormal step) near zero."""
    w = _weight(300, 512, seed=1)
    r = rtn(w, WEIGHT_ONLY)
    err = (r.dequantize() - w).abs()
    scale = r.scales.repeat_interleave(128, dim=1)
    assert (err <= w.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()
    rel = ((r.dequantize() - w).pow(2).sum() / w.pow(2).sum()).item()
    assert rel < 2e-3, rel


def test_rtn_refuses_k_not_a_multiple_of_128():
    with pytest.raises(ValueError, match="128"):
        rtn(torch.randn(8, 192), BLOCK)


# --------------------------------------------------------------------------- the format


def _random_block_result(n: int, k: int, scheme: QuantScheme = BLOCK, seed: int = 0) -> QuantResult:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int64)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes).to(torch.uint8)  # no NaN bytes
    blocks = torch.rand(-(-n // 128), k // 128, generator=g) + 0.01
    return QuantResult(codes, blocks.repeat_interleave(128, dim=0)[:n], None, None, scheme)


@pytest.mark.parametrize("n,k", [(1, 128), (129, 256), (256, 384), (200, 128)])
@pytest.mark.parametrize("preset", ["fp8-block", "fp8-block-weight"])
def test_pack_unpack_exact(preset, n, k):
    scheme = SCHEME_PRESETS[preset]
    for r in (_random_block_result(n, k, scheme), rtn(_weight(n, k), scheme)):
        t = CT.pack(r)
        assert {name: (tuple(v.shape), v.dtype) for name, v in t.items()} == CT.tensor_specs(scheme, n, k)
        assert t["weight_scale"].shape == (-(-n // 128), k // 128)
        assert torch.equal(t["weight_scale"], r.scales[::128])  # one row per block of rows
        assert torch.equal(t["weight"].view(torch.uint8), r.qweight)
        assert CT.unpack(t, scheme, n, k).equal(r)


def test_pack_refuses_rows_of_a_block_that_disagree():
    r = _random_block_result(200, 256)
    r.scales[130, 1] *= 2  # row 130 is in the second block of rows
    with pytest.raises(ValueError, match="within a block"):
        CT.pack(r)


@pytest.mark.parametrize("preset", ["fp8-block", "fp8-block-weight"])
def test_config_round_trip(preset):
    scheme = SCHEME_PRESETS[preset]
    cfg = CT.quantization_config(scheme, ["lm_head"])
    group = cfg["config_groups"]["group_0"]
    assert group["weights"] == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                                "block_structure": [128, 128], "group_size": None, "dynamic": False}
    if scheme.activations:
        assert cfg["format"] == "float-quantized"
        assert group["input_activations"] == {"num_bits": 8, "type": "float", "symmetric": True,
                                              "strategy": "group", "group_size": 128, "dynamic": True}
    else:  # compressed-tensors infers naive-quantized for weight-only FP8, as for per-channel FP8
        assert cfg["format"] == "naive-quantized" and group["input_activations"] is None
    fmt, parsed = read_quantization_config(json.loads(json.dumps(cfg)))
    assert fmt.name == "compressed-tensors" and parsed.scheme == scheme and parsed.ignore == ["lm_head"]


def test_config_is_compressed_tensors_fp8_block_preset():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme

    theirs = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).model_dump(mode="json")
    ours = CT.quantization_config(BLOCK, [])["config_groups"]["group_0"]
    assert ours["weights"] == theirs["weights"]
    assert ours["input_activations"] == theirs["input_activations"]


def test_config_refuses_other_blocks_and_groups():
    cfg = CT.quantization_config(BLOCK, [])
    bad_block = json.loads(json.dumps(cfg))
    bad_block["config_groups"]["group_0"]["weights"]["block_structure"] = [64, 64]
    with pytest.raises(QuantspecError, match="block_structure"):
        read_quantization_config(bad_block)
    bad_group = json.loads(json.dumps(cfg))
    bad_group["config_groups"]["group_0"]["input_activations"]["group_size"] = 64
    with pytest.raises(QuantspecError, match="input_activations"):
        read_quantization_config(bad_group)


def test_format_cannot_hold_k_not_a_multiple_of_128():
    assert "not a multiple of 128" in CT.cannot_hold(BLOCK, 256, 192)
    assert CT.cannot_hold(BLOCK, 200, 256) is None  # N: the last block of rows may be short


def test_plan_leaves_such_a_layer_dense_with_the_reason():
    from quantspec.quant.plan import make_plan

    model = torch.nn.ModuleDict({"a": torch.nn.Linear(256, 200), "b": torch.nn.Linear(192, 128)})
    plan = make_plan(model, BLOCK, CT, ignore=())
    assert plan.quantize == {"a": BLOCK} and not plan.regrouped
    assert "not a multiple of 128" in plan.dense["b"]


# --------------------------------------------------------------------------- kernels


def test_reference_group_dynamic_activations_match_a_computation_by_hand():
    """y = sum over 128-column groups g of (q_g @ w_g^T) * s_g, q_g = E4M3(x_g / s_g), s_g = absmax
    of the token's group / 448, computed here in fp64 with torch's float8 cast. The reference
    runs fp32 (dequantized activations times the dequantized weight): max |y - y_ref| <= 1e-5 x
    max |y_ref|."""
    n, k, m = 200, 384, 7
    g = torch.Generator().manual_seed(4)
    r = rtn(_weight(n, k), BLOCK)
    x = torch.randn(m, k, generator=g) * torch.tensor([0.01, 1.0, 30.0]).repeat_interleave(128)  # groups apart
    x[2, 128:256] = 0.0  # an all-zero group of one token
    bias = torch.randn(n, generator=g)
    be = ReferenceBackend()
    y = be.linear(x.reshape(1, m, k), be.prepare(r, torch.float32), BLOCK, n, k, bias).reshape(m, n)
    w = r.dequantize().double()
    expect = bias.double().expand(m, n).clone()
    for c0 in range(0, k, 128):
        xg = x[:, c0 : c0 + 128]
        s = (xg.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        expect += (_fp8(xg / s).double() @ w[:, c0 : c0 + 128].T) * s.double()
    assert (y.double() - expect).abs().max() <= 1e-5 * expect.abs().max()
    # the per-group scales matter: per-token scales (fp8-dynamic's) or no rounding give other outputs
    s_tok = x.abs().amax(dim=1, keepdim=True) / 448
    per_token = (_fp8(x / s_tok) * s_tok).double() @ w.T + bias.double()
    unrounded = x.double() @ w.T + bias.double()
    for other in (per_token, unrounded):
        assert (other - expect).abs().max() > 1e-3 * expect.abs().max()


def test_backends_fall_back_to_the_reference_with_the_reason():
    """The cpu backend's fp8 kernel takes one scale per channel: never chosen for block scales."""
    cpu = torch.device("cpu")
    for scheme in (BLOCK, WEIGHT_ONLY):
        for requested in ("auto", "exact"):
            backend, why = choose_backend(scheme, 256, 256, cpu, torch.float32, requested)
            assert backend.name == "reference", (scheme.short_name, requested, why)
            assert computes_declared_scheme(backend.name, scheme)
    _, why = choose_backend(WEIGHT_ONLY, 256, 256, cpu, torch.float32)
    assert "cpu: fp8 block scales" in why
    _, why = choose_backend(BLOCK, 256, 256, cpu, torch.float32)
    assert "cpu: fp8-block (FP8 activations)" in why


# --------------------------------------------------------------------------- GPTQ


def test_gptq_blocks_beat_rtn_on_the_gptq_objective():
    """Correlated calibration-like inputs; the objective is the output error on them,
    tr((W - Q) H (W - Q)^T) with H = 2 X^T X / T. Block scales come from the current weights
    of each column group: the first group's (and, with static groups, every group's) equal RTN's."""
    n, k = 200, 384
    g = torch.Generator().manual_seed(3)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(2048, k, generator=g) @ mix * torch.rand(k, generator=g).add(0.1)
    H = 2 * x.T @ x / x.shape[0]
    w = _weight(n, k, seed=5)

    def objective(r: QuantResult) -> float:
        d = (r.dequantize() - w).double()
        return float(torch.einsum("nk,kj,nj->", d, H.double(), d))

    base = rtn(w, WEIGHT_ONLY)
    for scheme in (WEIGHT_ONLY, BLOCK, replace(WEIGHT_ONLY, act_order=True, static_groups=True)):
        res, info = gptq_quantize(w, H, scheme)
        res.validate()
        assert res.scheme == scheme and res.scales.shape == (n, 3)
        CT.pack(res)  # every row of a block holds the block's scale (pack raises otherwise)
        assert torch.equal(res.scales[:, 0], base.scales[:, 0])  # nothing updated before group 0
        if scheme.static_groups:
            assert torch.equal(res.scales, base.scales)
        else:  # later groups: scales of the error-updated weights, not of the original ones
            assert not torch.equal(res.scales[:, 1:], base.scales[:, 1:])
        assert objective(res) < 0.85 * objective(base), (scheme.short_name, objective(res), objective(base))


# --------------------------------------------------------------------------- end to end


SPREAD = torch.tensor([0.1, 10.0]).repeat_interleave(128)  # two column groups far apart: per-group scales show


def _group_fp8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp64 x @ w^T with x quantized per token per 128 columns (E4M3, absmax / 448), by hand."""
    y = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for c0 in range(0, x.shape[1], 128):
        xg = x[:, c0 : c0 + 128]
        s = (xg.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        y += (_fp8(xg / s).double() @ w[:, c0 : c0 + 128].double().T) * s.double()
    return y


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """``quantspec quantize --method gptq --scheme fp8-block`` on a tiny Llama with hidden 256
    (q/k/v/o, gate/up: K = 256, two column blocks; k/v: N = 128) and intermediate 192
    (gate/up: N = 192, a short last block of rows; down_proj: K = 192, which FP8 blocks cannot
    hold)."""
    tmp = tmp_path_factory.mktemp("fp8block")
    model = make_tiny_model(tmp, arch="llama", hidden_size=256, intermediate_size=192)
    out = tmp / "q"
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(model), "--method", "gptq",
                        "--scheme", "fp8-block", "--calib", "pydoc", "--calib-samples", "8", "--calib-seqlen", "64",
                        "--out", str(out), "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def test_cli_writes_fp8_block_and_reports_the_dense_layer(quantized):
    out, stdout = quantized
    assert "fp8-block" in stdout and "compressed-tensors" in stdout
    report = json.loads((out / "quant_report.json").read_text())
    down = {n: why for n, why in report["dense_layers"].items() if n.endswith("mlp.down_proj")}
    assert len(down) == 2 and all("in_features=192 is not a multiple of 128" in why for why in down.values())
    assert not report["regrouped_layers"]
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert set(qcfg["ignore"]) >= set(down)
    assert len(qcfg["config_groups"]) == 1
    assert qcfg["config_groups"]["group_0"]["weights"]["strategy"] == "block"
    tensors = checkpoint_tensors(out)
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale"].shape == (2, 2)  # N = 192: two blocks of rows
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].shape == (1, 2)  # N = 128
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16  # left dense (saved in fp16)
    assert "model.layers.0.mlp.down_proj.weight_scale" not in tensors


def test_load_runs_the_declared_scheme(quantized):
    """load_quantized with the auto backend: every layer on a backend that computes the declared
    scheme (here the reference, the fast kernels saying why not), and a layer's output equals
    the checkpoint's tensors dequantized by hand with per-token per-group FP8 activations
    (fp32 against fp64: max |y - y_ref| <= 1e-5 x max |y_ref|)."""
    import quantspec
    from quantspec.kernels.quant_linear import QuantLinear

    out, _ = quantized
    qm = quantspec.load_quantized(out, dtype=torch.float32)
    layers = {n: m for n, m in qm.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 12  # 2 blocks x (q, k, v, o, gate, up)
    for name, lin in layers.items():
        assert lin.scheme == BLOCK
        with torch.no_grad():
            lin(torch.zeros(1, lin.in_features))  # prepares with auto
        assert computes_declared_scheme(lin.backend_name, lin.scheme), name
        assert lin.backend_name == "reference" and "cpu: fp8-block (FP8 activations)" in lin.backend_reason
    t = checkpoint_tensors(out)
    lin = layers["model.layers.1.mlp.gate_proj"]
    w = t["model.layers.1.mlp.gate_proj.weight"].float()
    scale = t["model.layers.1.mlp.gate_proj.weight_scale"].repeat_interleave(128, dim=0)[:192]
    w = w * scale.repeat_interleave(128, dim=1)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)) * SPREAD
    expect = _group_fp8_matmul(x, w)
    with torch.no_grad():
        y = lin(x)
    assert (y.double() - expect).abs().max() <= 1e-5 * expect.abs().max()
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(qm(input_ids=ids).logits).all()
    shown = subprocess.run([sys.executable, "-m", "quantspec", "inspect", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0 and "fp8-block" in shown.stdout, shown.stdout + shown.stderr


def test_transformers_computes_what_we_compute(quantized):
    """transformers + compressed-tensors load the export (FP8_BLOCK weights, FP8 activations per
    token per 128 columns at run time). One layer on identical inputs: the same activation codes
    on both sides, fp32 products in another order: max |diff| <= 1e-5 x max |y|. End to end, a
    product order that differs by one rounding can flip an activation's FP8 code (a 2^-4 step) in
    the next layer, so logits get the W8A8 bound of test_interop_transformers.py, 2e-2 x max."""
    pytest.importorskip("compressed_tensors")
    import quantspec
    from transformers import AutoModelForCausalLM

    out, _ = quantized
    ours = quantspec.load_quantized(out, dtype=torch.float32, backend="reference")
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # (their layers decompress their weights in the model's first forward)
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()
    name = "model.layers.0.self_attn.q_proj"
    scheme = theirs.get_submodule(name).quantization_scheme
    assert scheme.weights.block_structure == [128, 128] and scheme.input_activations.group_size == 128
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * SPREAD
    with torch.no_grad():
        a, b = ours.get_submodule(name)(x), theirs.get_submodule(name)(x)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_transformers_loads_the_weight_only_block_export(tmp_path):
    """fp8-block-weight (FP8 blocks, 16-bit activations) loads in transformers + compressed-tensors
    and computes what we compute: weight-only in fp32 on both sides, so the products differ only in
    their order (max |logit diff| <= 1e-3 x max |logit|, the weight-only bound of
    test_interop_transformers.py)."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    import quantspec
    from quantspec.core.scheme import SCHEME_PRESETS
    from quantspec.quant.recipe import Recipe

    model = make_tiny_model(tmp_path, arch="llama", hidden_size=256, intermediate_size=192)
    recipe = Recipe(name="b", method="rtn", format="compressed-tensors", scheme=SCHEME_PRESETS["fp8-block-weight"])
    out = quantspec.quantize(str(model), recipe, tmp_path / "q", progress=False).out
    ours = quantspec.load_quantized(out, dtype=torch.float32, backend="reference")
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    scheme = theirs.get_submodule("model.layers.0.self_attn.q_proj").quantization_scheme
    assert scheme.weights.block_structure == [128, 128] and scheme.input_activations is None
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert (a - b).abs().max() <= 1e-3 * a.abs().max()


def test_awq_runs_on_fp8_blocks(tmp_path):
    """AWQ's scale search fake-quantizes with block scales; its result packs as FP8 block."""
    import quantspec
    from quantspec.quant.options import AWQOptions, CalibrationConfig

    model = make_tiny_model(tmp_path, arch="llama", hidden_size=128, intermediate_size=256)
    recipe = Recipe(name="awq-fp8-block", method="awq", format="compressed-tensors", scheme=WEIGHT_ONLY,
                    calibration=CalibrationConfig(data="pydoc", samples=4, seqlen=64), awq=AWQOptions(grid=5))
    out = quantspec.quantize(str(model), recipe, tmp_path / "q", progress=False).out
    report = json.loads((out / "quant_report.json").read_text())
    assert set(report["dense_layers"]) <= {"lm_head"}
    t = checkpoint_tensors(out)
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (1, 2)
    qm = quantspec.load_quantized(out, dtype=torch.float32)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(qm(input_ids=ids).logits).all()
