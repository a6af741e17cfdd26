"""Run one checkpoint in vLLM (its own venv) and write what it computed as JSON.

    <vllm-venv>/bin/python engine_vllm.py JOB.json RESULT.json

JOB: {"model": DIR, "dtype": "bfloat16", "prompts": [[token ids], ...], "max_new_tokens": 16,
      "top_k": 20, "max_model_len": 512, "probe": {"path": FILE, "tokens": [ids]} (optional),
      "kv_cache_dtype": "fp8" (optional; default "auto"), "kv_scales": true (optional: report
      every attention layer's k/v scales as loaded and its cache dtype, RESULT["kv_scales"])}
RESULT: {"ok": true, "prompt_logprobs": [[{id: logprob} per prompt position], ...],
         "greedy": [[ids], ...], "generated_logprobs": [[{id: logprob} per generated token], ...],
         "texts": [...], "quantization": ..., "seconds": {...},
         "probe": {"ok": ..., "path": FILE}: block 0's q/k/v input and output, see probe.py}
or {"ok": false, "error": "..."}.

prompt_logprobs[p][t] is the engine's top-K distribution of the token after position t
(t = 0 .. T-1); the last one comes from the first generated token's logprobs. Importable
only under ``if __name__ == "__main__"``: vLLM starts its engine in child processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def run_probe(llm, probe: dict, TokensPrompt, SamplingParams) -> dict:
    """Save block 0's q/k/v input and output for ``probe["tokens"]`` to ``probe["path"]``
    (vllm_site/quantspec_probe.py); the outcome, never raising."""
    import functools

    try:
        from quantspec_probe import install

        hooked = llm.apply_model(functools.partial(install, path=probe["path"], rows=len(probe["tokens"])))
        llm.generate([TokensPrompt(prompt_token_ids=probe["tokens"])], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": os.path.isfile(probe["path"]), "module": hooked, "path": probe["path"]}


def main(job_path: str, out_path: str) -> int:
    job = json.load(open(job_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if job.get("probe") or job.get("kv_scales"):  # LLM.apply_model ships functions to the workers by pickle
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # every vLLM process (engine core, workers) starts with vllm_site/ on its path, whose
    # sitecustomize installs the torch W4A16 fallback on hosts without AVX-512
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_site")
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, site)
    import sitecustomize  # noqa: F401  (this process started before PYTHONPATH was set)
    result: dict = {"ok": False}
    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        import vllm

        result["vllm_version"] = vllm.__version__
        import torch
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        result["wna16_kernel"] = ("vllm native" if hasattr(torch.ops._C, "cpu_gemm_wna16") else
                                  "torch-dequant fallback (vllm_site/sitecustomize.py: no AVX-512)")
        k = int(job.get("top_k", 20))
        llm = LLM(
            model=job["model"],
            dtype=job.get("dtype", "bfloat16"),
            enforce_eager=True,
            max_model_len=int(job.get("max_model_len", 512)),
            max_logprobs=k,
            seed=0,
            kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
        )
        t_load = time.perf_counter() - t0
        try:  # which quantization method vLLM picked (gptq_marlin, compressed-tensors, ...)
            result["quantization"] = llm.llm_engine.model_config.quantization
        except Exception:  # noqa: BLE001
            result["quantization"] = None
        sp = SamplingParams(temperature=0.0, max_tokens=int(job.get("max_new_tokens", 16)),
                            logprobs=k, prompt_logprobs=k, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        t_gen = time.perf_counter() - t1
        plps, greedy, texts, gen_lps = [], [], [], []
        for o in outs:
            # every generated step's top-K (the decode steps, which read the KV cache)
            gen_lps.append([{str(tid): float(lp.logprob) for tid, lp in step.items()}
                            for step in (o.outputs[0].logprobs or [])])
            pos = []
            for entry in (o.prompt_logprobs or [])[1:]:  # entry t = P(token t | < t)
                pos.append({str(tid): float(lp.logprob) for tid, lp in entry.items()} if entry else None)
            first = o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None
            pos.append({str(tid): float(lp.logprob) for tid, lp in first.items()} if first else None)
            plps.append(pos)
            greedy.append([int(t) for t in o.outputs[0].token_ids])
            texts.append(o.outputs[0].text)
        result.update(ok=True, prompt_logprobs=plps, greedy=greedy, texts=texts, generated_logprobs=gen_lps,
                      seconds={"load": round(t_load, 1), "generate": round(t_gen, 1)})
        if job.get("probe"):
            result["probe"] = run_probe(llm, job["probe"], TokensPrompt, SamplingParams)
        if job.get("kv_scales"):
            from quantspec_probe import kv_scales

            result["kv_scales"] = llm.apply_model(kv_scales)[0]
    except BaseException as exc:  # noqa: BLE001 - report every failure to the caller
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    json.dump(result, open(out_path, "w"))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(rc)  # skip vLLM's slow/hanging interpreter teardown
