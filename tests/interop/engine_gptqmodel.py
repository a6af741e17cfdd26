"""Run GPTQModel (its own venv) on one checkpoint, or quantize a model with it.

    <gptqmodel-venv>/bin/python engine_gptqmodel.py JOB.json RESULT.json

JOB {"action": "load", "model": DIR, "dtype": "float32", "prompts": [[ids]], "max_new_tokens": 16,
     "top_k": 20, "backend": "torch"}  -> {"ok", "prompt_logprobs", "greedy", "kernels", ...}
    (prompt_logprobs[p][t] = top-K {id: logprob} of the token after position t, as engine_vllm)
JOB {"action": "quantize", "model": DENSE_DIR, "out": DIR, "bits": 4, "group_size": 32,
     "sym": true, "desc_act": false, "samples": [[ids]]}  -> {"ok", "out"}
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _topk(logits, k):
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(k, dim=-1)
    return [{str(int(a)): float(b) for a, b in zip(ii, vv)} for ii, vv in zip(i.tolist(), v.tolist())]


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
    k = int(job.get("top_k", 20))
    plps, greedy = [], []
    t1 = time.perf_counter()
    with torch.inference_mode():
        for ids in job["prompts"]:
            logits = hf(input_ids=torch.tensor([ids])).logits[0]
            plps.append(_topk(logits, k))
            cur, gen = list(ids), []
            for _ in range(int(job.get("max_new_tokens", 16))):
                nxt = int(hf(input_ids=torch.tensor([cur])).logits[0, -1].float().argmax())
                gen.append(nxt)
                cur.append(nxt)
            greedy.append(gen)
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


def main(job_path: str, out_path: str) -> int:
    job = json.load(open(job_path))
    try:
        import gptqmodel

        res = {"load": load, "quantize": quantize}[job.get("action", "load")](job)
        res["gptqmodel_version"] = gptqmodel.__version__
    except BaseException as exc:  # noqa: BLE001
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-6000:]}
    json.dump(res, open(out_path, "w"))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    rc = main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(rc)
