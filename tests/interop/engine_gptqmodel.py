"""Run GPTQModel (its own venv) on one checkpoint, or quantize a model with it.

    <gptqmodel-venv>/bin/python engine_gptqmodel.py JOB.json RESULT.json

JOB {"action": "load", "model": DIR, "dtype": "float32", "prompts": [[ids]], "max_new_tokens": 16,
     "top_k": 20, "backend": "torch"}  -> {"ok", "prompt_logprobs", "greedy", "kernels", ...}
    (prompt_logprobs[p][t] = top-K {id: logprob} of the token after position t, as engine_vllm)
JOB {"action": "hf_load", ...as load}  -> the same, through transformers' AutoModelForCausalLM
JOB {"action": "quantize", "model": DENSE_DIR, "out": DIR, "bits": 4, "group_size": 32,
     "sym": true, "desc_act": false, "samples": [[ids]]}  -> {"ok", "out"}
"""

from __future__ import annotations

import time

from engine_common import logprobs_and_greedy, run_main


def load(job: dict) -> dict:
    import torch
    from gptqmodel import BACKEND, GPTQModel

    dtype = getattr(torch, job.get("dtype", "float32"))
    backend = BACKEND(job.get("backend", "torch")) if job.get("backend") else BACKEND.AUTO
    t0 = time.perf_counter()
    m = GPTQModel.load(job["model"], device="cpu", backend=backend, dtype=dtype)
    t_load = time.perf_counter() - t0
    hf = m.model if hasattr(m, "model") else m
    hf.eval()
    kernels = sorted({type(mod).__name__ for mod in hf.modules() if "QuantLinear" in type(mod).__name__
                      or "Linear" in type(mod).__name__ and hasattr(mod, "qweight")})
    t1 = time.perf_counter()
    plps, greedy = logprobs_and_greedy(hf, job)
    return {"ok": True, "prompt_logprobs": plps, "greedy": greedy, "kernels": kernels,
            "seconds": {"load": round(t_load, 1), "generate": round(time.perf_counter() - t1, 1)}}


def hf_load(job: dict) -> dict:
    """Plain transformers ``from_pretrained`` (its GPTQ/AWQ quantizers run on gptqmodel + optimum)."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job.get("dtype", "bfloat16")),
                                              device_map="cpu").eval()
    t_load = time.perf_counter() - t0
    kernels = sorted({type(mod).__name__ for mod in hf.modules() if hasattr(mod, "qweight")})
    t1 = time.perf_counter()
    plps, greedy = logprobs_and_greedy(hf, job)
    return {"ok": True, "prompt_logprobs": plps, "greedy": greedy, "kernels": kernels,
            "seconds": {"load": round(t_load, 1), "generate": round(time.perf_counter() - t1, 1)}}


def quantize(job: dict) -> dict:
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig

    cfg = QuantizeConfig(bits=int(job.get("bits", 4)), group_size=int(job.get("group_size", 32)),
                         sym=bool(job.get("sym", True)), desc_act=bool(job.get("desc_act", False)))
    m = GPTQModel.load(job["model"], cfg, device="cpu", dtype=torch.float32)
    samples = [{"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s), dtype=torch.long)}
               for s in job["samples"]]
    m.quantize(samples, batch_size=1)
    m.save(job["out"])
    return {"ok": True, "out": job["out"]}


if __name__ == "__main__":
    run_main({"load": load, "hf_load": hf_load, "quantize": quantize}, "gptqmodel")
