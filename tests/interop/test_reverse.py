"""The reverse direction: checkpoints written by GPTQModel (GPTQ v1) and llm-compressor
(compressed-tensors pack-quantized) load in ``quantspec.load_quantized`` and compute what their
own loaders compute: transformers + compressed-tensors in fp32 (bound 0.05, as tight as fp32
summation order allows), GPTQModel's torch kernel in bf16 (its CPU kernels take fp16/bf16 only:
the vLLM test's bf16 bound).

The peers quantize SmolLM2-135M at W4 g64 (64 divides every K of the model, which
llm-compressor requires) on 8 calibration samples of 128 tokens: the point is the format, not
the quality. A wrong nibble order, zero-point convention or group mapping moves log-probabilities by whole
units and drops top-1 agreement far below these bounds.
"""

from __future__ import annotations

import pytest

from interop import engines, exports

pytestmark = pytest.mark.interop

PEERS = {  # engine -> (quantize job fields, load job fields, max abs logprob diff, min top-1 agreement)
    "gptqmodel": ({"sym": True, "desc_act": False}, {"dtype": "bfloat16", "backend": "gptq_torch"}, 0.6, 0.9),
    "llmcompressor": ({"sym": True, "method": "gptq"}, {"dtype": "float32"}, 0.05, 0.98),
}


@pytest.mark.parametrize("engine", sorted(PEERS))
def test_peer_checkpoint_loads_in_quantspec(engine, smollm2_dir, smollm2_prompts, engine_python, tmp_path):
    from quantspec.data import calibration_samples
    from quantspec.models import load_tokenizer

    engine_python(engine)
    samples = calibration_samples(load_tokenizer(smollm2_dir), "pydoc", 8, 128, seed=0).tolist()
    out = tmp_path / f"{engine}-w4g64"
    quant_job, load_job, max_diff, min_top1 = PEERS[engine]
    made = engines.run_engine(engine, {"action": "quantize", "model": str(smollm2_dir), "out": str(out),
                                       "bits": 4, "group_size": 64, "samples": samples, **quant_job})
    assert made["ok"], f"{engine} could not quantize: {made.get('error')}\n{made.get('log', '')[-3000:]}"
    theirs = engines.run_engine(engine, {"action": "load", "model": str(out), "prompts": smollm2_prompts,
                                         "max_new_tokens": exports.MAX_NEW_TOKENS, "top_k": exports.TOP_K,
                                         **load_job})
    assert theirs["ok"], f"{engine} could not load its own checkpoint: {theirs.get('error')}"
    ours = exports.quantspec_reference(out, smollm2_prompts, "float32")
    cmp = exports.compare(ours, theirs)
    print(f"{engine} checkpoint in quantspec: {cmp}")
    assert cmp["top1_agree"] >= min_top1, cmp
    assert cmp["max_abs_diff"] <= max_diff, cmp


# llm-compressor's float presets (RTN, its own scale rules) and the dtype transformers runs them in
# (FP4 decompresses to bf16 only); bounds from our own drift in that dtype (exports.judge)
FLOAT_PRESETS = {"FP8_DYNAMIC": "float32", "NVFP4A16": "bfloat16", "MXFP4A16": "bfloat16"}


@pytest.mark.parametrize("preset", sorted(FLOAT_PRESETS))
def test_llmcompressor_float_checkpoint_loads_in_quantspec(preset, smollm2_dir, smollm2_prompts, engine_python,
                                                            tmp_path):
    engine_python("llmcompressor")
    out = tmp_path / preset
    made = engines.run_engine("llmcompressor", {"action": "quantize", "model": str(smollm2_dir), "out": str(out),
                                                "preset": preset})
    assert made["ok"], f"llm-compressor could not quantize {preset}: {made.get('error')}"
    dtype = FLOAT_PRESETS[preset]
    theirs = engines.run_engine("llmcompressor", {"action": "load", "model": str(out), "prompts": smollm2_prompts,
                                                  "max_new_tokens": exports.MAX_NEW_TOKENS, "top_k": exports.TOP_K,
                                                  "dtype": dtype})
    assert theirs["ok"], f"llm-compressor could not load its own {preset}: {theirs.get('error')}"
    ref = exports.quantspec_reference(out, smollm2_prompts, "float32")
    verdict = exports.judge(out, smollm2_prompts, ref, theirs, dtype)
    print(f"llm-compressor {preset} in quantspec: {verdict}")
    assert verdict["within"], verdict
