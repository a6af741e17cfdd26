"""Peer runner (runs in llm-compressor's own venv, not ours): GPTQ with llm-compressor.

    python llmc_gptq.py MODEL_DIR DATA.pt --bits 4 --group 64 [--actorder static|none] [--method gptq|awq]

DATA.pt (written by benchmarks/gptq_peers.py): {"calib": LongTensor [n, L], "eval": LongTensor
[w, L]}. Prints one JSON line: quantization seconds (the oneshot call: no load, no save) and the
perplexity of the fake-quantized model on the eval windows (mean token NLL, exp).
"""

import argparse
import json
import math
import time

import torch


def perplexity(model, windows: torch.Tensor) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = model(input_ids=w[None]).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += w.numel() - 1
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--actorder", default="static")
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq", "dense"])
    args = ap.parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    data = torch.load(args.data)
    calib = data["calib"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    seconds = 0.0
    if args.method != "dense":
        from llmcompressor import oneshot

        ds = Dataset.from_dict({"input_ids": calib.tolist(),
                                "attention_mask": torch.ones_like(calib).tolist()})
        weights = {"num_bits": args.bits, "type": "int", "symmetric": args.method == "gptq",
                   "strategy": "group", "group_size": args.group}
        groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
        if args.method == "gptq":
            from llmcompressor.modifiers.gptq import GPTQModifier

            actorder = None if args.actorder == "none" else args.actorder
            recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=actorder)
        else:
            from llmcompressor.modifiers.awq import AWQModifier
            from llmcompressor.pipelines import cache

            cache.IntermediatesCache.pin_memory = lambda self, *a, **k: None  # CPU-only machine
            recipe = AWQModifier(config_groups=groups, ignore=["lm_head"])
        t0 = time.perf_counter()
        oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=calib.shape[1],
                num_calibration_samples=calib.shape[0], shuffle_calibration_samples=False)
        seconds = time.perf_counter() - t0
    ppl = perplexity(model, data["eval"])
    print(json.dumps({"seconds": seconds, "ppl": ppl}))


if __name__ == "__main__":
    main()
