"""Mixture-of-experts models (issue 29): every routed and shared expert is calibrated, quantized,
exported one tensor group per expert under the names on disk, and loaded back; routers stay
dense; experts quantspec cannot export are reported, never skipped silently.

Tiny random models of each family, built with transformers' own classes (tests/helpers.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

import quantspec
from helpers import MOE_ARCHS, calib_text, checkpoint_tensors, make_tiny_model, make_tiny_tokenizer, tiny_model
from quantspec.errors import QuantspecError
from quantspec.models.experts import (
    LinearExperts,
    experts_modules,
    fused_experts_left,
    linearize_experts,
    set_calibration,
)
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.recipe import CalibrationConfig, Recipe
from quantspec.core.scheme import QuantScheme
from quantspec.quant.smoothing import fold_scales, resolve_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
W4 = QuantScheme(4, 32, False)


def _calib(tmp_path, samples=4, seqlen=32, **kw) -> CalibrationConfig:
    return CalibrationConfig(data=str(calib_text(tmp_path)), samples=samples, seqlen=seqlen, **kw)


def _ids(n=2, length=16, seed=1) -> torch.Tensor:
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_linearized_experts_compute_the_fused_output(arch):
    """One Linear per expert, same logits as transformers' fused experts in every mode: routed
    inference, route-all calibration (block outputs stay the model's own) and routed calibration."""
    model = tiny_model(arch)
    ids = _ids()
    with torch.no_grad():
        for m in model.modules():  # GPT-OSS initializes its expert biases to zero: make them count
            for b in ("gate_up_proj_bias", "down_proj_bias"):
                if hasattr(m, b):
                    getattr(m, b).normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        ref = model(ids).logits
        fused = {n: {k: t.detach().clone() for k, t in m.named_parameters()}
                 for n, m in model.named_modules() if hasattr(m, "gate_up_proj")}
        names = linearize_experts(model)
        assert names == list(fused) and names
        assert not any(p.dim() == 3 for p in model.parameters())  # no fused copy left behind
        for name, params in fused.items():
            experts = model.get_submodule(name)
            assert isinstance(experts, LinearExperts) and len(experts) == params["gate_up_proj"].shape[0]
            for e, mlp in enumerate(experts):
                for lin, (weight, bias) in zip(mlp.linears(), _expert_slices(params, e, arch)):
                    assert torch.equal(lin.weight, weight)
                    assert (lin.bias is None and bias is None) or torch.equal(lin.bias, bias)
        for mode in (None, "all", "routed"):
            set_calibration(model, mode)
            out = model(ids).logits
            assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), mode


def _expert_slices(params: dict, e: int, arch: str) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of expert e's gate, up and down as the fused tensors hold them."""
    gu, down = params["gate_up_proj"][e], params["down_proj"][e]
    if arch == "gpt_oss":  # [H, 2I] with gate/up columns interleaved, biases
        b = params["gate_up_proj_bias"][e]
        return [(gu[:, 0::2].t(), b[0::2]), (gu[:, 1::2].t(), b[1::2]), (down.t(), params["down_proj_bias"][e])]
    inter = gu.shape[0] // 2
    return [(gu[:inter], None), (gu[inter:], None), (down, None)]


def test_experts_not_linearized_are_reported_dense_with_the_reason(monkeypatch):
    """A family declared unsupported keeps its fused experts dense, and the report says why
    (never a silent skip)."""
    from dataclasses import replace

    from quantspec.models import experts as experts_mod

    why = "a layout this test declares unsupported"
    monkeypatch.setitem(experts_mod.LAYOUTS, "qwen3_moe", replace(experts_mod.LAYOUTS["qwen3_moe"], unsupported=why))
    model = tiny_model("qwen3_moe")
    assert linearize_experts(model) == []
    left = fused_experts_left(model)
    assert len(left) == 2 and all(r.endswith(why) for r in left.values())
    recipe = Recipe(name="t", method="rtn", scheme=W4, format="compressed-tensors")
    _, report = quantspec.quantize_model(model, recipe, backend="reference")
    for name, reason in left.items():
        assert report["dense"][name] == reason


CASES = [(a, "gptq", "gptq") for a in MOE_ARCHS] + [
    ("qwen3_moe", "awq", "awq"), ("mixtral", "awq", "compressed-tensors"), ("deepseek_v3", "awq", "gptq"),
    ("qwen2_moe", "rtn", "compressed-tensors"), ("mixtral", "gptq", "compressed-tensors"),
    ("gpt_oss", "awq", "compressed-tensors"),
]


@pytest.mark.parametrize("arch,method,fmt", CASES)
def test_every_expert_is_quantized_exported_and_loaded(arch, method, fmt, tmp_path):
    """Every routed and shared expert is quantized (counted in the checkpoint, under the names
    checkpoints on disk use), routers stay dense and are reported, each expert's routed token
    count is in the report, and ``load_quantized`` runs the experts: its logits equal
    transformers' own fused-experts model holding the dequantized weights."""
    folder = make_tiny_model(tmp_path, arch)
    recipe = Recipe(name="t", method=method, scheme=W4, format=fmt, calibration=_calib(tmp_path))
    outcome = quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False)
    tensors = checkpoint_tensors(outcome.out)
    dense_model = tiny_model(arch)
    qkey = "weight_packed" if fmt == "compressed-tensors" else "qweight"
    on_disk = {k.rpartition(".")[0] for k in tensors if k.endswith(qkey)}
    disk_names = {k.rpartition(".")[0] for k in load_file(str(folder / "model.safetensors")) if k.endswith(".weight")}
    n_fused = sum(m.gate_up_proj.shape[0] for m in dense_model.modules() if hasattr(m, "gate_up_proj"))
    experts = [n for n in disk_names if ".experts." in n]
    if arch in ("gpt_oss", "granitemoe"):  # fused on disk too: vLLM's loaders take {experts}.{e}.gate_proj
        experts = [f"{m}.{e}.{p}" for m in experts_modules_of(dense_model) for e in range(8)
                   for p in ("gate_proj", "up_proj", "down_proj")]
    assert len(experts) == 3 * n_fused
    assert set(experts) <= on_disk  # every routed expert, named as the original checkpoint names it
    shared = [n for n in disk_names if "shared_expert." in n or "shared_experts." in n]
    assert set(shared) <= on_disk
    routers = [n for n in outcome.report["dense_layers"] if "router" in outcome.report["dense_layers"][n]]
    written = set(tensors) | {k.replace("block_sparse_moe", "mlp") for k in tensors}  # Mixtral's disk name
    assert routers and all(f"{r}.weight" in written for r in routers)
    layers = outcome.report["layers"]
    routed = [e.get("routed_tokens") for n, e in layers.items() if ".experts." in n]
    if method != "rtn":  # calibrated: the router's choices counted per expert
        tokens = 4 * 32 * 2  # samples x seqlen x top-k, per MoE block
        assert len(routed) == 3 * n_fused and sum(routed) == 3 * tokens * len(experts_modules_of(dense_model))

    from quantspec.checkpoint.inspect import inspect_checkpoint

    info = inspect_checkpoint(outcome.out)
    assert all(v["quantized"] == v["experts"] and not v["dense_experts"] for v in info["experts"].values())
    assert info["experts"]

    loaded = quantspec.load_quantized(outcome.out, backend="reference", dtype="float32")
    ref = _fake_quant_fused(tiny_model(arch), loaded)
    ids = _ids()
    with torch.no_grad():
        out, want = loaded(ids).logits, ref(ids).logits
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()


def experts_modules_of(fused_model) -> list[str]:
    return [n for n, m in fused_model.named_modules() if hasattr(m, "gate_up_proj")]


def _fake_quant_fused(model, loaded):
    """``model`` (transformers' fused experts) holding ``loaded``'s weights: its dense tensors
    (stored in fp16) and, for every Linear stored quantized, the dequantized value (experts
    re-fused from the per-expert Linears)."""
    from quantspec.kernels.quant_linear import QuantLinear

    deq = {n: m.quant_result().dequantize(torch.float32) for n, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    stored = dict(loaded.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in stored and stored[name].shape == p.shape:
                p.copy_(stored[name])
        for name, mod in model.named_modules():
            if hasattr(mod, "gate_up_proj"):
                experts = loaded.get_submodule(name)
                for e, mlp in enumerate(experts):
                    g, u, d = (deq[f"{name}.{e}.{n}"] for n in mlp.names)
                    if hasattr(mod, "gate_up_proj_bias"):  # GPT-OSS: [H, 2I] interleaved, biases
                        mod.gate_up_proj[e][:, 0::2].copy_(g.t())
                        mod.gate_up_proj[e][:, 1::2].copy_(u.t())
                        mod.down_proj[e].copy_(d.t())
                        gl, ul, dl = mlp.linears()
                        mod.gate_up_proj_bias[e][0::2].copy_(gl.bias)
                        mod.gate_up_proj_bias[e][1::2].copy_(ul.bias)
                        mod.down_proj_bias[e].copy_(dl.bias)
                    else:
                        mod.gate_up_proj[e].copy_(torch.cat([g, u]))
                        mod.down_proj[e].copy_(d)
            elif isinstance(mod, torch.nn.Linear) and name in deq:
                mod.weight.copy_(deq[name])
    return model.eval()


def test_mixtral_exports_use_the_on_disk_names_engines_load(tmp_path):
    """Mixtral's checkpoints name the MoE block ``block_sparse_moe`` and its experts w1/w3/w2
    (vLLM's loader reads those): the export uses them, config ignore lists included."""
    folder = make_tiny_model(tmp_path, "mixtral")
    recipe = Recipe(name="t", method="rtn", scheme=W4, format="compressed-tensors")
    out = quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False).out
    keys = set(checkpoint_tensors(out))
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight_packed" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in k for k in keys)
    import json

    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.block_sparse_moe.gate" in ignore


GRANITE_TF = ("transformers 5.25 maps only Granite-MoE's fused input_linear / output_linear: the per-expert "
              "tensors of the export are unexpected keys and the experts stay randomly initialized")


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("granitemoe", marks=pytest.mark.xfail(
    strict=True, reason=GRANITE_TF, raises=AssertionError))])
def test_transformers_loads_a_compressed_tensors_moe_export(arch, tmp_path):
    """transformers (with the compressed-tensors package) loads our MoE export and its logits
    match ours."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is an optional extra")
    folder = make_tiny_model(tmp_path, arch)
    recipe = Recipe(name="t", method="rtn", scheme=QuantScheme(4, 32, True), format="compressed-tensors")
    out = quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False).out
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = quantspec.load_quantized(out, backend="reference", dtype="float32")
    ids = _ids()
    with torch.no_grad():
        a, b = theirs(ids).logits, ours(ids).logits
    assert (a - b).abs().max() <= 1e-3 * b.abs().max()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss", "granitemoe"])
def test_moe_smoothing_folds_are_exact_and_leave_routers_unchanged(arch):
    """The declared pairs fold exactly: the post-attention norm into the router (a follower),
    every expert's gate/up and the shared experts; each expert's up into its down (not in
    GPT-OSS, whose clamped SwiGLU is not linear in up)."""
    model = tiny_model(arch)
    linearize_experts(model)
    arch_spec = get_arch(model)
    block_index = len(arch_spec.block_list(model)) - 1  # a MoE block in every family
    block = arch_spec.block_list(model)[block_index]
    pairs, _ = resolve_pairs(block, arch_spec)
    norm_pair = next(p for p in pairs if p.prev_name == "post_attention_layernorm")
    n_experts = len(next(iter(experts_modules(block).values())))
    assert sum(".experts." in n for n in norm_pair.linear_names) == 2 * n_experts
    assert len(norm_pair.followers) >= 1
    mlp = "block_sparse_moe" if arch == "granitemoe" else "mlp"
    assert sum(p.prev_name.startswith(f"{mlp}.experts.") for p in pairs) == (0 if arch == "gpt_oss" else n_experts)
    ids = _ids()
    router_out = {}
    router = block.get_submodule({"gpt_oss": "mlp.router", "granitemoe": "block_sparse_moe.router"}.get(arch, "mlp.gate"))
    handle = router.register_forward_hook(lambda m, a, o: router_out.setdefault(len(router_out), o))
    with torch.no_grad():
        ref = model(ids).logits
        gen = torch.Generator().manual_seed(0)
        for p in pairs:
            fold_scales(p, torch.empty(p.channels).uniform_(0.5, 2.0, generator=gen))
        out = model(ids).logits
    handle.remove()
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    first, second = router_out[0], router_out[1]
    a, b = (first[0], second[0]) if isinstance(first, tuple) else (first, second)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # router logits unchanged


def _starved_router(model, starved=(6, 7)):
    """Make every router of ``model`` pick among the other experts only (a model whose router
    never sends a calibration token to ``starved``)."""
    def hook(mod, args, out):
        logits, scores, idx = out
        masked = logits.clone()
        masked[:, list(starved)] = float("-inf")
        probs = torch.softmax(masked, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, mod.top_k, dim=-1)
        return logits, (top / top.sum(-1, keepdim=True)).to(logits.dtype), idx

    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter"):
            mod.register_forward_hook(hook)
    return model


def test_experts_without_routed_tokens_are_calibrated_under_route_all(tmp_path):
    """Experts the router never picks: under route-all (default) they get GPTQ with a full
    Hessian (reported with 0 routed tokens); under routed calibration they get the stated
    round-to-nearest fallback, reported per Linear."""
    recipe = Recipe(name="t", method="gptq", scheme=W4, format="gptq", calibration=_calib(tmp_path))
    model, report = quantspec.quantize_model(_starved_router(tiny_model("qwen3_moe")), recipe,
                                             tokenizer=make_tiny_tokenizer(), backend="reference")
    starved = {n: e for n, e in report["layers"].items() if ".experts.6." in n or ".experts.7." in n}
    assert len(starved) == 12 and all(e["routed_tokens"] == 0 for e in starved.values())
    assert all("fallback" not in e and e["rel_mse"] is not None for e in starved.values())
    assert all(e["rel_mse"] < 0.5 for e in starved.values())

    routed = Recipe(name="t", method="gptq", scheme=W4, format="gptq",
                    calibration=_calib(tmp_path, experts="routed"))
    _, report = quantspec.quantize_model(_starved_router(tiny_model("qwen3_moe")), routed,
                                         tokenizer=make_tiny_tokenizer(), backend="reference")
    for name, entry in report["layers"].items():
        if ".experts.6." in name or ".experts.7." in name:
            assert entry["fallback"].startswith("round-to-nearest: 0 calibration rows"), name
        elif ".experts." in name:
            assert "fallback" not in entry
    assert all(isinstance(m, LinearExperts) and m.calibration is None for m in experts_modules(model).values())


def test_routed_calibration_is_refused_for_smoothing_methods(tmp_path):
    folder = make_tiny_model(tmp_path, "qwen3_moe")
    recipe = Recipe(name="t", method="awq", scheme=W4, format="awq", calibration=_calib(tmp_path, experts="routed"))
    with pytest.raises(QuantspecError, match="experts=routed"):
        quantspec.quantize(str(folder), recipe, tmp_path / "q", progress=False)
    with pytest.raises(QuantspecError, match="experts"):
        CalibrationConfig(experts="some")


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("rows", [1, 5])
def test_one_token_and_batched_routing_equal_the_fused_experts(arch, rows):
    """The decode path (one token: its k experts summed directly) and the grouped path, called
    as transformers calls the experts module, against the fused module on the same routing."""
    from quantspec.models.experts import layout_of, linearize

    model = tiny_model(arch)
    fused = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for b in ("gate_up_proj_bias", "down_proj_bias"):
            if hasattr(fused, b):
                getattr(fused, b).normal_(0, 0.05, generator=gen)
        x = torch.randn(rows, fused.gate_up_proj.shape[1 if arch == "gpt_oss" else 2], generator=gen)
        idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(rows)])
        w = torch.softmax(torch.randn(rows, 2, generator=gen), dim=-1)
        want = fused(x, idx, w)
        got = linearize(fused, layout_of(model))(x, idx, w)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_undeclared_moe_family_finds_its_decoder_blocks_not_an_experts_list():
    """Structure inference on a MoE model (transformers' Qwen3-MoE read as an undeclared family):
    the per-expert ModuleList (8 experts) is longer than the block list (2 blocks) but lies
    inside it, so the blocks are model.layers (the longest list alone picked the experts)."""
    from quantspec.quant.arch_infer import infer_arch

    model = tiny_model("qwen3_moe")
    linearize_experts(model)
    assert len(model.model.layers) < len(model.model.layers[0].mlp.experts)
    assert infer_arch(model).blocks == "model.layers"
