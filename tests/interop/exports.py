"""The exports the interop suite judges, and the reference side of every comparison.

Runs in the project venv. Each export is a quantspec Recipe written to a folder; the
reference is ``quantspec.load_quantized(dir, backend="reference")``: log-probabilities of
every vocabulary entry at every prompt position, and its own greedy continuation.

Engines run in their own venvs (``venvs.py``) and return, per prompt, for every prompt
position the top-K log-probabilities (token id -> logprob) and the greedy continuation.
``compare`` then measures, over every position and every token of the engine's top-K:

* ``max_abs_diff``  max |engine logprob - reference logprob| for the same token id
* ``top1_agree``    fraction of positions whose engine top-1 token is the reference argmax
* ``gen_agree``     fraction of greedy tokens equal to the reference's greedy tokens, counted
                    up to the first divergence (after it the contexts differ)
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine_common import greedy_continuation

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Quantization reduces the memory footprint of large language models by",
    "Once upon a time, in a small village by the sea, there lived",
]
MAX_NEW_TOKENS = 16
TOP_K = 20  # engine logprobs per position compared (vLLM's default max_logprobs)

# name -> (recipe kwargs, scheme kwargs); method "gptq" runs on small calibration data.
EXPORTS: dict[str, tuple[dict, dict]] = {
    "gptq-w4g128-sym": (dict(method="rtn", format="gptq"), dict(bits=4, group_size=128, symmetric=True)),
    "gptq-w4g128-asym": (dict(method="rtn", format="gptq"), dict(bits=4, group_size=128, symmetric=False)),
    "gptq-w4g128-sym-actorder": (dict(method="gptq", format="gptq"),
                                 dict(bits=4, group_size=128, symmetric=True, act_order=True)),
    "gptq-w4g128-asym-actorder": (dict(method="gptq", format="gptq"),
                                  dict(bits=4, group_size=128, symmetric=False, act_order=True)),
    "gptq-w8g128-sym": (dict(method="rtn", format="gptq"), dict(bits=8, group_size=128, symmetric=True)),
    # g64 divides every K: one group size for all layers, no per-module "dynamic" override
    # (plain transformers + optimum reads only the global group_size)
    "gptq-w4g64-sym": (dict(method="rtn", format="gptq"), dict(bits=4, group_size=64, symmetric=True)),
    "awq-w4g128": (dict(method="rtn", format="awq"), dict(bits=4, group_size=128, symmetric=False)),
    # g64 divides every K of SmolLM2 (576, 1536): no layer left dense (GPTQModel needs that)
    "awq-w4g64": (dict(method="rtn", format="awq"), dict(bits=4, group_size=64, symmetric=False)),
    "ct-w4g128-sym": (dict(method="rtn", format="compressed-tensors"),
                      dict(bits=4, group_size=128, symmetric=True)),
    "ct-w4g128-asym": (dict(method="rtn", format="compressed-tensors"),
                       dict(bits=4, group_size=128, symmetric=False)),
    "ct-w8a8": (dict(method="rtn", format="compressed-tensors"),
                dict(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")),
    "ct-w8a8-sq": (dict(method="smoothquant", format="compressed-tensors"),
                   dict(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")),
    # float schemes (issue 30): FP8 weight-only / dynamic / static activations, NVFP4, MXFP4
    "ct-fp8-weight": (dict(method="rtn", format="compressed-tensors"), dict(bits=8, group_size=-1, weights="fp8")),
    "ct-fp8-dynamic": (dict(method="rtn", format="compressed-tensors"),
                       dict(bits=8, group_size=-1, weights="fp8", activations="fp8-token-dynamic")),
    "ct-fp8-static": (dict(method="rtn", format="compressed-tensors"),
                      dict(bits=8, group_size=-1, weights="fp8", activations="fp8-tensor-static")),
    # FP8 block (compressed-tensors FP8_BLOCK: 128x128 weight blocks, activations per token per 128
    # columns). SmolLM2-135M's K=576 layers cannot hold 128-column blocks: only down_proj (K=1536)
    # is quantized, the rest stays dense (reported). Not run in an interop session yet.
    "ct-fp8-block": (dict(method="rtn", format="compressed-tensors"),
                     dict(bits=8, group_size=128, weights="fp8", activations="fp8-group-dynamic")),
    "ct-nvfp4": (dict(method="rtn", format="compressed-tensors"), dict(bits=4, group_size=16, weights="nvfp4")),
    "ct-mxfp4": (dict(method="rtn", format="compressed-tensors"), dict(bits=4, group_size=32, weights="mxfp4")),
}
FAST_SUBSET = ("ct-w4g128-sym", "gptq-w4g128-sym")  # the most used paths


# Noise model of the end-to-end comparison, fixed before any engine result is read: an engine
# computing ``dtype`` differs from our fp32 reference at most DRIFT_FACTOR times as much as our
# own reference in ``dtype`` differs from a more precise run of itself (fp32 vs bf16/fp16; fp64
# vs fp32), and its top-1 agreement is at most TOP1_SLACK below ours. Measured on SmolLM2-135M:
# weight-only W4 exports 0.43 in bf16 (top-1 0.98); W8A8 2.86 in bf16 and 1.17 in fp32, where
# int8 activation codes turn rounding into whole steps: end to end, a W8A8 export cannot tell a
# different activation-scale convention from noise, so W8A8 conventions are judged on one layer
# with identical inputs (probe.py), where they separate.
DRIFT_FACTOR = 2.0
TOP1_SLACK = 0.1
MORE_PRECISE = {"bfloat16": "float32", "float16": "float32", "float32": "float64"}


def bounds(ckpt: str | Path, ids, dtype: str = "bfloat16") -> tuple[float, float]:
    """(max |logprob diff|, min top-1 agreement) an engine running ``dtype`` must meet against
    our fp32 reference on ``ckpt``; from our own drift only (``own_drift``), never from the
    engine's result."""
    own = own_drift(ckpt, ids, dtype)
    print(f"{ckpt}: our own {dtype} vs {MORE_PRECISE[dtype]}: {own}")
    return DRIFT_FACTOR * own["max_abs_diff"], own["top1_agree"] - TOP1_SLACK


def quantizes_activations(name: str) -> bool:
    """True for exports that quantize activations at run time (W8A8)."""
    return bool(EXPORTS[name][1].get("activations"))


def method_available(method: str) -> str | None:
    """None when quantspec can run ``method``, else the reason it cannot."""
    from quantspec.quant.registry import METHODS

    if method not in METHODS:
        return f"quantspec method {method!r} is not available (registry: {sorted(METHODS)})"
    return None


def make_export(name: str, model_dir: str | Path, out: str | Path) -> Path:
    """Write export ``name`` of ``model_dir`` to ``out`` (reused when already complete)."""
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import CalibrationConfig, Recipe
    from quantspec.core.scheme import QuantScheme

    out = Path(out)
    if (out / "config.json").is_file() and (out / "quant_report.json").is_file():
        return out
    rk, sk = EXPORTS[name]
    calib = CalibrationConfig(data="pydoc", samples=8, seqlen=128, seed=0)
    recipe = Recipe(name=name, scheme=QuantScheme(**sk), calibration=calib, **rk)
    quantize(str(model_dir), recipe, out, progress=False, overwrite=True)
    return out


def prompt_ids(model_dir: str | Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=True)["input_ids"]
        out.append([int(i) for i in ids])
    return out


def _dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "float64": torch.float64}[name]


@dataclass
class Reference:
    logprobs: list[torch.Tensor]  # per prompt: fp32 [T, V] log-softmax at each prompt position
    greedy: list[list[int]]  # per prompt: MAX_NEW_TOKENS greedy tokens
    seconds: float


@torch.inference_mode()
def model_reference(model, ids: list[list[int]], max_new_tokens: int = MAX_NEW_TOKENS) -> Reference:
    t0 = time.perf_counter()
    lps, greedy = [], []
    for seq in ids:
        x = torch.tensor([seq])
        logits = model(input_ids=x).logits[0].float()
        lps.append(torch.log_softmax(logits, dim=-1))
        greedy.append(greedy_continuation(model, seq, max_new_tokens))
    return Reference(lps, greedy, time.perf_counter() - t0)


def quantspec_reference(ckpt: str | Path, ids, dtype: str = "float32", greedy: bool = True) -> Reference:
    """Our reference backend on ``ckpt``; computed once per process for the same checkpoint
    files, prompts and dtype (several engines are judged against it). ``greedy=False``: the
    log-probabilities only (the greedy lists are empty)."""
    files = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in Path(ckpt).iterdir() if p.is_file()))
    return _reference(str(Path(ckpt).resolve()), files, tuple(map(tuple, ids)), dtype, greedy)


@functools.lru_cache(maxsize=16)
def _reference(ckpt: str, files: tuple, ids: tuple, dtype: str, greedy: bool) -> Reference:
    import quantspec

    model = quantspec.load_quantized(ckpt, dtype=_dtype(dtype), backend="reference")
    return model_reference(model, [list(seq) for seq in ids], MAX_NEW_TOKENS if greedy else 0)


def as_engine_result(ref: Reference, top_k: int = TOP_K) -> dict:
    """``ref`` in an engine's result shape (top-K logprobs per position), for ``compare``."""
    plps = []
    for lp in ref.logprobs:
        vals, ids = lp.topk(top_k, dim=-1)
        plps.append([{int(i): float(v) for i, v in zip(ri, rv)} for ri, rv in zip(ids, vals)])
    return {"prompt_logprobs": plps, "greedy": ref.greedy}


def own_drift(ckpt: str | Path, ids, dtype: str) -> dict:
    """``compare`` of our reference in ``dtype`` against itself in the next more precise dtype
    (``MORE_PRECISE``): the noise floor of any engine computing ``dtype``."""
    precise = quantspec_reference(ckpt, ids, MORE_PRECISE[dtype], greedy=False)
    return compare(precise, as_engine_result(quantspec_reference(ckpt, ids, dtype, greedy=False)))


def probe_tokens(ids) -> list[int]:
    """The layer probe's prompt: every prompt joined (a sequence no engine has cached)."""
    return [t for seq in ids for t in seq]


def judge(ckpt: str | Path, ids, ref: "Reference", res: dict, dtype: str) -> dict:
    """An engine result ``res`` (computed in ``dtype``) against our fp32 reference ``ref``: the
    bounds (from our own drift, computed first), ``compare``'s figures, ``within`` (both bounds
    met) and, when ``res`` carries a layer probe, its verdict (probe.py; ``probe_ok``)."""
    from . import probe

    max_diff, min_top1 = bounds(ckpt, ids, dtype)
    out = {"bound_max_diff": round(max_diff, 5), "bound_min_top1": round(min_top1, 4), **compare(ref, res)}
    out["within"] = out["max_abs_diff"] <= max_diff and out["top1_agree"] >= min_top1
    cap = res.get("probe") or {}
    if cap.get("ok"):
        data = torch.load(cap["path"]) if "path" in cap else cap
        out["probe"] = {**probe.check_probe(ckpt, data["x"], data["y"], _dtype(dtype)), "layer": cap.get("module")}
    elif cap:
        out["probe"] = {"ok": False, "error": cap.get("error", "no capture")}
    return out


def compare(ref: Reference, engine: dict) -> dict:
    """Compare an engine's result (``engine_result`` JSON, see engine scripts) to ``ref``.

    The engine's ``prompt_logprobs[p][t]`` is {token_id: logprob} (the top-K of position t,
    i.e. the distribution of token t+1 given tokens <= t); position T-1 (the last prompt
    token) predicts the first generated token.
    """
    max_diff, n_pos, n_top1 = 0.0, 0, 0
    worst = None
    gen_match, gen_total = 0, 0
    for p, lp in enumerate(ref.logprobs):
        eng_pos = engine["prompt_logprobs"][p]
        for t, top in enumerate(eng_pos):
            if top is None:
                continue
            top = {int(k): float(v) for k, v in top.items()}
            ids = torch.tensor(list(top))
            vals = torch.tensor(list(top.values()))
            d = (vals - lp[t, ids]).abs()
            if float(d.max()) > max_diff:
                max_diff = float(d.max())
                worst = {"prompt": p, "pos": t, "token": int(ids[d.argmax()])}
            n_pos += 1
            n_top1 += int(max(top, key=top.get) == int(lp[t].argmax()))
        eng_gen = engine["greedy"][p]
        ref_gen = ref.greedy[p]
        k = 0
        while k < min(len(eng_gen), len(ref_gen)) and eng_gen[k] == ref_gen[k]:
            k += 1
        gen_match += k
        gen_total += len(ref_gen)
    return {
        "max_abs_diff": round(max_diff, 5),
        "worst": worst,
        "positions": n_pos,
        "top1_agree": round(n_top1 / max(n_pos, 1), 4),
        "gen_agree": round(gen_match / max(gen_total, 1), 4),
    }


def save_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1))
