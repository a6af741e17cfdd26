"""Quantized KV cache: fake quantization, calibration of k/v scales (keys after RoPE), the
checkpoint's kv_cache_scheme and k_scale / v_scale tensors, eval with each KV setting, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import quantspec
from helpers import make_tiny_model
from quantspec.errors import QuantspecError
from quantspec.formats.overrides import read_with_overrides
from quantspec.quant.kv_calibrate import error_bases, kv_scales, observe_errors, observe_kv
from quantspec.core.kv_config import KVCacheConfig, kv_cache_scheme, parse_kv_cache_scheme, scale_tensors, scales_from_tensors
from quantspec.quant.recipe import Recipe
from quantspec.runtime.kv import cache_kwarg
from quantspec.runtime.kv_quant import KVSetting, QuantKVCache, fake_quant, scale_errors, scale_multipliers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(0))


def test_fake_quant_grids():
    x = torch.tensor([[[[0.1, -0.26, 1000.0, 3.3]]]])
    assert fake_quant(x, torch.tensor(0.5), "int8").flatten().tolist() == [0.0, -0.5, 63.5, 3.5]
    y = fake_quant(x, torch.tensor(1.0), "fp8").flatten()
    assert y.tolist() == [0.1015625, -0.25, 448.0, 3.25]  # E4M3 values, saturating at 448
    per_head = fake_quant(torch.ones(1, 2, 1, 1) * 3, torch.tensor([1.0, 2.0]), "int8").flatten()
    assert per_head.tolist() == [3.0, 4.0]  # head 1: 3/2 = 1.5 -> 2 (ties to even) * 2


def _outputs(model, module, ids) -> torch.Tensor:
    """``module``'s outputs over the samples ``ids`` (one forward each), concatenated."""
    seen = []
    hook = module.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    with torch.no_grad():
        for j in range(ids.shape[0]):
            model(input_ids=ids[j : j + 1])
    hook.remove()
    return torch.cat(seen, 1)


def test_observer_sees_keys_after_rope(tiny, ids):
    """The observed key maxima are those of the keys the attention reads (after RoPE), not of
    k_proj's output: the two differ on a model with RoPE."""
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    amax = observe_kv(model, ids)
    assert sorted(amax) == list(range(model.config.num_hidden_layers))
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    pre_amax = _outputs(model, model.model.layers[0].self_attn.k_proj, ids).reshape(-1, heads, dim).abs().amax(dim=(0, 2))
    k0 = amax[0][0]
    assert k0.shape == (heads,) and not torch.allclose(k0, pre_amax)
    # a value is not rotated: the value maxima are v_proj's
    v_amax = _outputs(model, model.model.layers[0].self_attn.v_proj, ids).reshape(-1, heads, dim).abs().amax(dim=(0, 2))
    assert torch.equal(amax[0][1], v_amax)


def test_quant_cache_changes_attention_only_as_much_as_its_grid(tiny, ids):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cfg = KVCacheConfig("fp8", "tensor", scale_rule="amax")
    scales = {i: (k.reshape(-1), v.reshape(-1)) for i, (k, v) in kv_scales(observe_kv(model, ids), cfg).items()}
    kw = cache_kwarg(model)
    with torch.no_grad():
        plain = model(input_ids=ids[:1]).logits
        fp8 = model(input_ids=ids[:1], use_cache=True, **{kw: QuantKVCache(KVSetting("fp8"), scales)}).logits
        tiny_scale = {i: (torch.tensor([1e-6]), torch.tensor([1e-6])) for i in scales}
        wrecked = model(input_ids=ids[:1], use_cache=True, **{kw: QuantKVCache(KVSetting("fp8"), tiny_scale)}).logits
    err = (fp8 - plain).abs().max() / plain.abs().max()
    # E4M3 moves each K and V element by at most 2^-4 of itself (3 mantissa bits, round to
    # nearest), so the logits move by a fraction of that order of their scale, and not zero
    assert 0 < err < 2**-4
    assert (wrecked - plain).abs().max() / plain.abs().max() > 10 * err  # the scale is really used


def test_scales_round_trip_and_config():
    amax = {0: (torch.tensor([2.0, 4.0]), torch.tensor([1.0, 8.0])), 1: (torch.tensor([0.0, 1.0]), torch.ones(2))}
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    t = scale_tensors(kv_scales(amax, KVCacheConfig("fp8", "tensor", scale_rule="amax")), names)
    assert torch.equal(t["model.layers.0.self_attn.k_scale"], torch.tensor([4.0]) / 448) and t["model.layers.0.self_attn.k_scale"].shape == (1,)
    head = scale_tensors(kv_scales(amax, KVCacheConfig("int8", "head", scale_rule="amax")), names)
    assert head["model.layers.0.self_attn.v_scale"].shape == (2, 1, 1)
    assert torch.equal(head["model.layers.1.self_attn.k_scale"].flatten(), torch.tensor([127.0, 1.0]) / 127)  # zero amax: 1
    assert (KVCacheConfig("fp8").rule, KVCacheConfig("int8").rule, KVCacheConfig("fp8", scale_rule="amax").rule) == ("mse", "amax", "amax")
    assert torch.equal(kv_scales(amax, KVCacheConfig("int8", "head"))[1][0], head["model.layers.1.self_attn.k_scale"])  # auto: amax
    back = scales_from_tensors(head)
    assert torch.equal(back[0][1], torch.tensor([1.0, 8.0]) / 127)
    for cfg in (KVCacheConfig("fp8", "tensor"), KVCacheConfig("int8", "head")):
        assert parse_kv_cache_scheme(kv_cache_scheme(cfg)) == KVCacheConfig(cfg.kind, cfg.strategy)
    with pytest.raises(QuantspecError, match="kv_cache_scheme"):
        parse_kv_cache_scheme({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True})
    with pytest.raises(QuantspecError, match="cover every layer"):
        scales_from_tensors({"model.layers.1.self_attn.k_scale": torch.ones(1), "model.layers.1.self_attn.v_scale": torch.ones(1)})


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_scale_errors_are_each_candidates_rounding_error(kind):
    """``scale_errors`` (all candidates at once, in chunks) equals rounding with ``fake_quant``
    under each candidate scale, head by head."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, 17, 8, generator=g) * torch.tensor([1.0, 40.0, 0.01]).reshape(1, 3, 1, 1)
    base = x.abs().amax(dim=(0, 2, 3))
    mults = scale_multipliers()
    assert mults.numel() == 129 and mults[64] == 1 and mults[0] == 0.5 and mults[-1] == 2
    got = scale_errors(x, base, kind, mults, chunk=7)
    for m in (0, 37, 64, 128):
        s = base * mults[m] / (448 if kind == "fp8" else 127)
        want = ((fake_quant(x, s, kind) - x) ** 2).sum(dim=(0, 2, 3))
        torch.testing.assert_close(got[m], want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_extension_scale_errors_have_the_references_terms(kind):
    """The extension's ``kv_scale_errors`` against ``scale_errors_reference``: each head holds
    one nonzero value among 1024 (the vectorized path), so each sum is a single term and must be
    bit-equal (values across E4M3's subnormal, normal and saturating ranges, random scales);
    on dense data the sums (fp64 here, fp32 in torch) agree within 1e-5."""
    from quantspec.kernels.cpu_ext import load_cpu_ext
    from quantspec.runtime.kv_quant import scale_errors_reference, scales_from_amax

    if load_cpu_ext() is None:
        pytest.skip("no C++ compiler / the extension failed to build")
    g = torch.Generator().manual_seed(2)
    edges = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e9, 2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 1.5 * 2.0**-9,
                          0.0009765625, 240.0, 0.1015625, 3.3, 127.5, 126.5, -0.5, -2.5,
                          1.0625, 1.1875, 17.0, 19.0, 248.0, 432.0, 2.5 * 2.0**-9])  # ties: either neighbour, the same error
    spread = torch.randn(487, generator=g) * torch.exp2(torch.randint(-16, 12, (487,), generator=g).float())
    values = torch.cat([edges, -edges, spread])  # one per head
    heads = values.numel()
    x = torch.zeros(1, heads, 16, 64)
    x[0, torch.arange(heads), torch.randint(0, 16, (heads,), generator=g), torch.randint(0, 64, (heads,), generator=g)] = values
    scales = torch.cat([torch.ones(1, heads), torch.rand(2, heads, generator=g) * 3 + 0.01])
    op = torch.ops.quantspec_cpu.kv_scale_errors.default
    got = op(x.transpose(0, 1).reshape(heads, -1), scales, 0 if kind == "fp8" else 1)
    assert torch.equal(got, scale_errors_reference(x, scales, kind))
    dense = torch.randn(2, 3, 100, 64, generator=g) * torch.tensor([1.0, 40.0, 0.01]).reshape(1, 3, 1, 1)
    base = dense.abs().amax(dim=(0, 2, 3))
    want = scale_errors_reference(dense, scales_from_amax(base[None, :] * scale_multipliers()[:, None], kind), kind)
    torch.testing.assert_close(scale_errors(dense, base, kind, scale_multipliers()), want, rtol=1e-5, atol=0)


def test_mse_rule_picks_the_scale_of_least_error():
    """Keys of two magnitudes, 10 (the max) and 7: the amax scale puts 10 on the top code and 7
    between E4M3 codes; the rule picks a multiple that rounds both closer, per tensor and per head."""
    x = torch.tensor([10.0, 7.0, -7.0, 3.3]).reshape(1, 1, 4, 1).expand(1, 2, 4, 1).contiguous()
    x[:, 1] *= 0.25
    amax = {0: (x.abs().amax(dim=(0, 2, 3)), torch.ones(2))}
    for strategy in ("tensor", "head"):
        cfg = KVCacheConfig("fp8", strategy)
        base = error_bases(amax, strategy)
        errors = {0: tuple(scale_errors(t, b, "fp8", scale_multipliers()) for t, b in zip((x, torch.ones(1, 2, 4, 1)), base[0]))}
        mse = kv_scales(amax, cfg, errors)[0][0].reshape(-1)
        plain = kv_scales(amax, KVCacheConfig("fp8", strategy, scale_rule="amax"), errors)[0][0].reshape(-1)  # errors unused
        err = [float(((fake_quant(x, s, "fp8") - x) ** 2).sum()) for s in (mse, plain)]
        assert err[0] < 0.5 * err[1], (strategy, mse, plain, err)
        assert torch.equal(kv_scales(amax, cfg, errors)[0][1], kv_scales(amax, KVCacheConfig("fp8", strategy, scale_rule="amax"))[0][1])  # values of one level: a tie keeps amax
        with pytest.raises(QuantspecError, match="mse KV scale rule needs"):
            kv_scales(amax, cfg)


def test_observed_errors_cover_every_layer_and_candidate(tiny, ids):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    amax = observe_kv(model, ids[:2])
    errors = observe_errors(model, ids[:2], amax, "fp8")
    heads = model.config.num_key_value_heads
    assert sorted(errors) == sorted(amax) and errors[0][0].shape == (129, heads)
    # the amax scale's error is what fake_quant under it leaves on those keys
    scales = kv_scales(amax, KVCacheConfig("fp8", "head", scale_rule="amax"))
    seen = []
    kw = cache_kwarg(model)
    cache = QuantKVCache(KVSetting("fp8"), {i: (k.reshape(-1), v.reshape(-1)) for i, (k, v) in scales.items()})
    from quantspec.runtime.kv_quant import KVObserver

    class Keys(KVObserver):
        def update(self, k, v, i, *a, **kw2):
            if i == 0:
                seen.append(k)
            return super().update(k, v, i, *a, **kw2)
    with torch.no_grad():
        for j in range(2):
            model(input_ids=ids[j : j + 1], use_cache=True, **{kw: Keys(config=model.config)})
    want = sum(((cache.quantizer(k, 0, 0) - k) ** 2).sum(dim=(0, 2, 3)) for k in seen)
    torch.testing.assert_close(errors[0][0][64], want, rtol=1e-5, atol=1e-12)


def test_search_samples_limit_the_error_pass(tiny, tmp_path, monkeypatch):
    """kv_cache.search_samples: the maxima come from every sample, the mse rule's errors from the
    first search_samples only (and never more than samples)."""
    from dataclasses import replace

    from quantspec.quant import kv_calibrate

    assert KVCacheConfig(samples=32).searched == 8  # the default, docs/decisions/kv-scale-rule.md
    assert KVCacheConfig(samples=32, search_samples=None).searched == 32
    assert KVCacheConfig(samples=4, search_samples=8).searched == 4
    with pytest.raises(QuantspecError, match="search_samples"):
        KVCacheConfig(search_samples=0)
    seen = {}
    real_keeping, real_kept, real_errors = kv_calibrate.observe_kv_keeping, kv_calibrate.errors_of_kept, kv_calibrate.observe_errors

    def keeping(model, ids, keep, *a, **k):
        seen["maxima"], seen["keep"] = ids.shape[0], keep
        return real_keeping(model, ids, keep, *a, **k)
    monkeypatch.setattr(kv_calibrate, "observe_kv_keeping", keeping)
    monkeypatch.setattr(kv_calibrate, "errors_of_kept", lambda kept, *a: seen.setdefault("kept", len(kept)) and real_kept(kept, *a))
    monkeypatch.setattr(kv_calibrate, "observe_errors", lambda model, ids, *a: seen.setdefault("forward", ids.shape[0])
                        and real_errors(model, ids, *a))
    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors",
                    kv_cache=KVCacheConfig("fp8", "tensor", samples=4, search_samples=2))
    recipe = replace(recipe, calibration=replace(recipe.calibration, data="pydoc", samples=8, seqlen=64))
    quantspec.quantize(str(tiny), recipe, tmp_path / "kv", progress=False)
    assert seen == {"maxima": 4, "keep": 2, "kept": 2}  # the errors of the kept samples: no second forward
    assert Recipe.from_yaml(tmp_path / "kv" / "recipe.yaml").kv_cache.search_samples == 2
    # where the kept keys and values would not fit, the errors come from a second forward over the same samples
    seen.clear()
    monkeypatch.setattr(kv_calibrate, "KEEP_SHARE", 0.0)
    monkeypatch.setattr(kv_calibrate, "KEEP_UNKNOWN_BYTES", 0)
    quantspec.quantize(str(tiny), recipe, tmp_path / "kv2", progress=False)
    assert seen == {"maxima": 4, "keep": 2, "forward": 2}
    assert (tmp_path / "kv" / "model-kv-scales.safetensors").read_bytes() == (tmp_path / "kv2" / "model-kv-scales.safetensors").read_bytes()


def test_kept_keys_and_values_give_the_second_forwards_errors(tiny, ids):
    """``errors_of_kept`` on the keys and values kept by the maxima pass equals ``observe_errors``'
    second forward exactly (the same tensors, sums in the same order), and the maxima are those of
    ``observe_kv``; a limit too small for them keeps nothing."""
    from quantspec.quant.kv_calibrate import errors_of_kept, observe_kv_keeping

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    amax, kept = observe_kv_keeping(model, ids, 2)
    assert len(kept) == 2 and sorted(kept[0]) == sorted(amax)
    assert all(torch.equal(a[i], b[i]) for a, b in zip(amax.values(), observe_kv(model, ids).values()) for i in (0, 1))
    for strategy in ("tensor", "head"):
        base = error_bases(amax, strategy)
        got, want = errors_of_kept(kept, base, "fp8"), observe_errors(model, ids[:2], base, "fp8")
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[i][w], want[i][w]) for i in want for w in (0, 1))
    assert observe_kv_keeping(model, ids, 2, limit_bytes=1)[1] is None
    assert observe_kv_keeping(model, ids, 0)[1] is None


def test_compressed_tensors_accepts_the_kv_scheme():
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs.model_validate(kv_cache_scheme(KVCacheConfig("fp8", "head")))
    assert str(args.strategy) in ("attn_head", "QuantizationStrategy.ATTN_HEAD") and str(args.type) in ("float", "QuantizationType.FLOAT") and not args.dynamic


def test_quantize_with_kv_cache_writes_loads_and_evaluates(tiny, tmp_path):
    out = tmp_path / "kv"
    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors", kv_cache=KVCacheConfig("fp8", "tensor", samples=4))
    from dataclasses import replace

    recipe = replace(recipe, calibration=replace(recipe.calibration, data="pydoc", samples=8, seqlen=64))
    quantspec.quantize(str(tiny), recipe, out, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.k_scale"] == "model-kv-scales.safetensors"
    assert read_with_overrides(cfg["quantization_config"])[1].extra["kv_cache"] == KVCacheConfig("fp8", "tensor")
    report = json.loads((out / "quant_report.json").read_text())
    assert report["kv_cache"]["samples"] == 4 and report["kv_cache"]["max_k_scale"] > 0
    assert report["kv_cache"]["scale_rule"] == "mse" and report["kv_cache"]["search_samples"] == 4
    model = quantspec.load_quantized(out, backend="reference")
    kv_cfg, scales = model.quantspec_kv_cache
    assert kv_cfg.kind == "fp8" and len(scales) == model.config.num_hidden_layers
    assert Recipe.from_yaml(out / "recipe.yaml") == recipe
    shown = subprocess.run([sys.executable, "-m", "quantspec", "inspect", str(out)], capture_output=True, text=True)
    assert shown.returncode == 0 and "KV cache: fp8, scales per tensor in 2 layers" in shown.stdout, shown.stdout

    from quantspec.eval.perplexity import perplexity
    from quantspec.models import load_tokenizer

    tok = load_tokenizer(str(tiny))
    runs = {(kind, sc): perplexity(model, tok, "pydoc", seqlen=64, windows=3, progress=False, kv_cache=kind, kv_scales=sc)
            for kind, sc in (("off", "calibrated"), ("checkpoint", "calibrated"), ("int8", "unit"))}
    assert runs[("off", "calibrated")]["kv_cache"] is None
    assert runs[("checkpoint", "calibrated")]["kv_cache"] == {"kind": "fp8", "scales": "calibrated"}
    ppl = {k: r["ppl"] for k, r in runs.items()}
    assert ppl[("checkpoint", "calibrated")] != ppl[("off", "calibrated")]
    # int8 at scale 1.0 rounds this model's small keys and values (|x| << 1) to zero
    assert abs(ppl[("int8", "unit")] - ppl[("off", "calibrated")]) > abs(ppl[("checkpoint", "calibrated")] - ppl[("off", "calibrated")])


def test_cli_integer_scheme_with_kv_cache_and_eval_on_it(tiny, tmp_path):
    """``--kv-cache`` applies to the integer schemes (``--bits``), and ``quantspec eval --ppl`` runs on the
    checkpoint's KV cache unless told otherwise."""
    from quantspec.cli.main import main

    out = tmp_path / "w4-kv"

    def cli(*argv):  # in this process: the CLI's own entry point, without a new interpreter per call
        assert main(list(argv)) == 0

    cli("quantize", str(tiny), "--method", "rtn", "--bits", "4", "--group-size", "32", "--format", "compressed-tensors",
        "--kv-cache", "int8", "--kv-cache-strategy", "head", "--calib", "pydoc", "--calib-samples", "4",
        "--calib-seqlen", "64", "--out", str(out), "--no-progress")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"]["type"] == "int" and qc["kv_cache_scheme"]["strategy"] == "attn_head"
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    heads = json.loads((tiny / "config.json").read_text())["num_key_value_heads"]
    kv = quantspec.load_quantized(out, backend="reference").quantspec_kv_cache
    assert kv[0] == KVCacheConfig("int8", "head") and all(k.numel() == v.numel() == heads for k, v in kv[1].values())
    runs = {}
    for setting in ("checkpoint", "off"):
        cli("eval", str(out), "--ppl", "pydoc", "--seqlen", "64", "--windows", "3", "--kv-cache", setting,
            "--no-progress", "--json", str(tmp_path / f"{setting}.json"))
        runs[setting] = json.loads((tmp_path / f"{setting}.json").read_text())
    assert runs["checkpoint"]["kv_cache"] == {"kind": "int8", "scales": "calibrated"}
    assert runs["off"]["kv_cache"] is None
    assert runs["checkpoint"]["ppl"]["pydoc"] != runs["off"]["ppl"]["pydoc"]


@pytest.mark.parametrize("extra,expect", [
    (["--kv-cache", "fp8", "--format", "gptq"], "kv_cache_scheme, not the"),
    (["--kv-cache-strategy", "head"], "--kv-cache"),
    (["--kv-scale-rule", "amax"], "--kv-scale-rule needs --kv-cache"),
    (["--kv-search-samples", "8"], "--kv-search-samples needs --kv-cache"),
])
def test_cli_refuses_kv_before_work(tmp_path, extra, expect):
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(tmp_path / "no-model"), *extra,
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and expect in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_eval_refuses_calibrated_scales_the_checkpoint_lacks(tiny):
    from quantspec.runtime.kv_quant import resolve_kv

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert resolve_kv(model) is None
    with pytest.raises(QuantspecError, match="calibrated KV scales"):
        resolve_kv(model, "fp8", "calibrated")
    assert resolve_kv(model, "fp8", "dynamic")[0] == KVSetting("fp8", "dynamic")
    model.quantspec_kv_cache = (KVCacheConfig("fp8"), {0: (torch.tensor([1.0]), torch.tensor([2.0]))})
    setting, scales = resolve_kv(model, "int8", "calibrated")  # same maxima, int8's top code
    assert setting == KVSetting("int8") and torch.equal(scales[0][1], torch.tensor([2.0 * 448 / 127]))
    assert resolve_kv(model)[1][0][0].item() == 1.0


def test_decoders_write_the_checkpoints_kv_cache(tiny, tmp_path):
    """Generation through the KV decoders (speculative loop, speed bench) writes the quantized
    cache a checkpoint with KV scales declares, and a plain one otherwise."""
    from dataclasses import replace

    from quantspec.runtime.kv import PlainDecoder
    from quantspec.runtime.kv_quant import new_cache

    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors", kv_cache=KVCacheConfig("int8", samples=2))
    recipe = replace(recipe, calibration=replace(recipe.calibration, data="pydoc", samples=4, seqlen=32))
    out = quantspec.quantize(str(tiny), recipe, tmp_path / "kv", progress=False).out
    model = quantspec.load_quantized(out, backend="reference")
    cache = new_cache(model)
    assert isinstance(cache, QuantKVCache) and cache.quantizer.setting == KVSetting("int8", "calibrated")
    dense = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert type(new_cache(dense)).__name__ == "DynamicCache"
    dec = PlainDecoder(model)
    dec.reset()
    assert isinstance(dec.cache, QuantKVCache)


# families whose attention is not a ``self_attn`` with k_proj / v_proj: Phi-3's fused qkv_proj
# (declared), and undeclared families found by structure, each under its own module name
OTHER_ATTENTION = {"phi3": "self_attn", "gpt2": "attn", "falcon": "self_attention", "gpt_neox": "attention",
                   "bloom": "self_attention", "gptj": "attn"}


@pytest.mark.parametrize("arch", sorted(OTHER_ATTENTION))
def test_kv_scales_of_fused_and_undeclared_attention(arch, tmp_path):
    """The scales are named after the module each block hands its cache to, cover every layer,
    and round what the loaded model writes into its cache onto the FP8 grid of that layer's
    scale (so each scale reaches its own layer)."""
    from dataclasses import replace

    from quantspec.core.floatcodes import round_fp8
    from quantspec.runtime.kv_quant import new_cache

    folder = make_tiny_model(tmp_path, arch=arch)
    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors",
                    kv_cache=KVCacheConfig("fp8", "head", samples=2, scale_rule="amax"))
    recipe = replace(recipe, calibration=replace(recipe.calibration, data="pydoc", samples=2, seqlen=32))
    quantspec.quantize(str(folder), recipe, tmp_path / "kv", progress=False)
    model = quantspec.load_quantized(tmp_path / "kv", backend="reference")
    index = json.loads((tmp_path / "kv" / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in index if n.endswith((".k_scale", ".v_scale"))]
    modules = {n.rsplit(".", 1)[0] for n in names}
    assert len(modules) == model.config.num_hidden_layers and len(names) == 2 * len(modules)
    assert {m.rsplit(".", 1)[1] for m in modules} == {OTHER_ATTENTION[arch]}, names
    _, scales = model.quantspec_kv_cache
    cache = new_cache(model)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    for layer, (k_scale, v_scale) in scales.items():
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        for x, s in ((keys, k_scale), (values, v_scale)):
            units = x.float() / s.reshape(1, -1, 1, 1)
            # on the grid up to the fp32 rounding of x / s (a code off the grid is >= 6% away)
            assert torch.allclose(round_fp8(units), units, rtol=1e-5, atol=0) and units.abs().max() > 1, (arch, layer)


def test_kv_cache_refuses_latent_attention_before_work(tmp_path):
    folder = make_tiny_model(tmp_path, arch="deepseek_v3")
    r = subprocess.run([sys.executable, "-m", "quantspec", "quantize", str(folder), "--kv-cache", "fp8",
                        "--calib", "pydoc", "--out", str(tmp_path / "o")], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "multi-head latent attention" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_kv_calibration_refuses_caches_it_cannot_describe(tiny, ids, tmp_path):
    """Looped models (HRM writes more cache layers than it has attention modules; Dory's loops fail
    on a cache of transformers' own kind) crashed with an IndexError / RuntimeError after the
    weights were quantized. Each is now a one-line QuantspecError naming the fix."""
    from quantspec.quant.kv_calibrate import calibrate_checkpoint_kv, observe_kv

    out = quantspec.quantize(str(tiny), Recipe(name="w", method="rtn", format="compressed-tensors"), tmp_path / "q",
                             progress=False).out
    with pytest.raises(QuantspecError, match="wrote 2 KV-cache layers for 1 attention modules") as err:
        calibrate_checkpoint_kv(out, ids, KVCacheConfig("fp8", samples=2), ["model.layers.0.self_attn"])
    assert "drop --kv-cache" in str(err.value) and "\n" not in str(err.value)

    class Looped(torch.nn.Module):  # a forward that rejects the observer's cache, as Dory's loops do
        def __init__(self):
            super().__init__()
            self.w, self.config = torch.nn.Parameter(torch.zeros(1)), None

        def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=None):
            raise RuntimeError("The size of tensor a (127) must match the size of tensor b (64)")

    with pytest.raises(QuantspecError, match="Looped's forward failed on the KV-cache observer"):
        observe_kv(Looped(), ids)
