"""The reverse direction: checkpoints written by GPTQModel (GPTQ v1) and llm-compressor
(compressed-tensors pack-quantized) load in ``quantspec.load_quantized`` and compute what their
own loaders compute (GPTQModel's torch kernel; transformers + compressed-tensors), both in fp32.

The peers quantize SmolLM2-135M at W4 g64 (64 divides every K of the model, which
llm-compressor requires) on 8 calibration samples of 128 tokens: the point is the format, not
the quality. fp32 on both sides, so the bound is tight: a wrong nibble order, zero-point
convention or group mapping moves log-probabilities by whole units.
"""

from __future__ import annotations

import pytest

from interop import engines, exports

pytestmark = pytest.mark.interop

MAX_DIFF = 0.05
MIN_TOP1 = 0.98

PEERS = {  # engine -> quantize job fields
    "gptqmodel": {"sym": True, "desc_act": False},
    "llmcompressor": {"sym": True, "method": "gptq"},
}


@pytest.mark.parametrize("engine", sorted(PEERS))
def test_peer_checkpoint_loads_in_quantspec(engine, smollm2_dir, smollm2_prompts, engine_python, tmp_path):
    from quantspec.data import calibration_samples
    from quantspec.models import load_tokenizer

    engine_python(engine)
    samples = calibration_samples(load_tokenizer(smollm2_dir), "pydoc", 8, 128, seed=0).tolist()
    out = tmp_path / f"{engine}-w4g64"
    made = engines.run_engine(engine, {"action": "quantize", "model": str(smollm2_dir), "out": str(out),
                                       "bits": 4, "group_size": 64, "samples": samples, **PEERS[engine]})
    assert made["ok"], f"{engine} could not quantize: {made.get('error')}\n{made.get('log', '')[-3000:]}"
    theirs = engines.run_engine(engine, {"action": "load", "model": str(out), "dtype": "float32",
                                         "prompts": smollm2_prompts, "max_new_tokens": exports.MAX_NEW_TOKENS,
                                         "top_k": exports.TOP_K})
    assert theirs["ok"], f"{engine} could not load its own checkpoint: {theirs.get('error')}"
    ours = exports.quantspec_reference(out, smollm2_prompts, "float32")
    cmp = exports.compare(ours, theirs)
    print(f"{engine} checkpoint in quantspec: {cmp}")
    assert cmp["top1_agree"] >= MIN_TOP1, cmp
    assert cmp["max_abs_diff"] <= MAX_DIFF, cmp
