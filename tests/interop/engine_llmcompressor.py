"""Run llm-compressor (its own venv) to write a checkpoint, or load one with transformers +
compressed-tensors as llm-compressor's users do.

    <llmcompressor-venv>/bin/python engine_llmcompressor.py JOB.json RESULT.json

JOB {"action": "quantize", "model": DENSE_DIR, "out": DIR, "bits": 4, "group_size": 64,
     "sym": true, "method": "rtn" | "gptq", "samples": [[ids]]}  -> {"ok", "out"}
    (rtn: QuantizationModifier, min-max weights, no calibration data; gptq: GPTQModifier on the
    samples; saved compressed, as pack-quantized compressed-tensors)
JOB {"action": "load", "model": DIR, "dtype": "float32", "prompts": [[ids]], "max_new_tokens": 16,
     "top_k": 20}  -> {"ok", "prompt_logprobs", "greedy", ...} (as engine_gptqmodel)
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from engine_common import logprobs_and_greedy, run_main


def quantize(job: dict) -> dict:
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    if job.get("preset"):  # one of llm-compressor's named schemes (FP8_DYNAMIC, NVFP4A16, ...), RTN
        from llmcompressor.modifiers.quantization import QuantizationModifier

        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=job["preset"], ignore=["lm_head"]))
        return _save(model, job)
    weights = {"num_bits": int(job.get("bits", 4)), "type": "int", "symmetric": bool(job.get("sym", True)),
               "strategy": "group", "group_size": int(job.get("group_size", 64))}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if job.get("method", "rtn") == "gptq":
        from datasets import Dataset
        from llmcompressor.modifiers.gptq import GPTQModifier

        ids = job["samples"]
        ds = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(s) for s in ids]})
        oneshot(model=model, dataset=ds, recipe=GPTQModifier(config_groups=groups, ignore=["lm_head"]),
                max_seq_length=max(len(s) for s in ids), num_calibration_samples=len(ids),
                shuffle_calibration_samples=False)
    else:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
    return _save(model, job)


def _save(model, job: dict) -> dict:
    model.save_pretrained(job["out"], save_compressed=True)
    for f in Path(job["model"]).iterdir():  # the tokenizer files, as users copy them
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config")):
            shutil.copy(f, Path(job["out"]) / f.name)
    return {"ok": True, "out": job["out"]}


def load(job: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, job.get("dtype", "float32"))
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval()
    t_load = time.perf_counter() - t0
    plps, greedy = logprobs_and_greedy(hf, job)
    return {"ok": True, "prompt_logprobs": plps, "greedy": greedy, "seconds": {"load": round(t_load, 1)}}


if __name__ == "__main__":
    run_main({"load": load, "quantize": quantize}, "llmcompressor")
