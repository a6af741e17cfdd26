"""Peer runner (runs in llm-compressor's own venv, not ours): GPTQ, AWQ or SmoothQuant + GPTQ.

    python llmc.py MODEL_DIR DATA.pt --method gptq|awq|smoothquant --bits 4 --group 64 [--asym] [--actorder static|none]
    python llmc.py MODEL_DIR DATA.pt --method rtn|gptq --scheme fp8-dynamic|nvfp4|mxfp4
    python llmc.py MODEL_DIR DATA.pt --method rtn --scheme fp8-weight --kv-cache fp8 --save DIR

DATA.pt (written by benchmarks/quant_peers.py): {"calib": LongTensor [n, L], "eval": LongTensor
[w, L]}. Prints one JSON line: quantization seconds (the oneshot call: no load, no save) and the
perplexity of the fake-quantized model (llm-compressor's own fake quantization, activations
included for W8A8) on the eval windows. ``--kv-cache fp8`` adds llm-compressor's calibrated FP8
KV cache (``kv_cache_scheme``: per tensor, static, symmetric); ``--save DIR`` writes the
compressed checkpoint (with its k_scale / v_scale) for another evaluator to read.
"""

import argparse
import json
import time

import torch

from peer_common import perplexity


PRESETS = {"fp8-dynamic": "FP8_DYNAMIC", "nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
# schemes llm-compressor has no preset for, as config groups
GROUPS = {"fp8-weight": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def recipe_for(args):
    if args.scheme in GROUPS:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        groups = {"group_0": {"targets": ["Linear"], "weights": GROUPS[args.scheme]}}
        return QuantizationModifier(config_groups=groups, ignore=["lm_head"],
                                    kv_cache_scheme=KV_FP8 if args.kv_cache == "fp8" else None)
    if args.scheme:
        preset = PRESETS[args.scheme]
        if args.method == "rtn":
            from llmcompressor.modifiers.quantization import QuantizationModifier

            return QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(targets="Linear", scheme=preset, ignore=["lm_head"],
                            actorder=None if args.actorder == "none" else args.actorder)
    weights = {"num_bits": args.bits, "type": "int", "symmetric": not args.asym,
               "strategy": "group", "group_size": args.group}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if args.method == "gptq":
        from llmcompressor.modifiers.gptq import GPTQModifier

        return GPTQModifier(config_groups=groups, ignore=["lm_head"],
                            actorder=None if args.actorder == "none" else args.actorder)
    if args.method == "awq":
        from llmcompressor.modifiers.awq import AWQModifier
        from llmcompressor.pipelines import cache

        cache.IntermediatesCache.pin_memory = lambda self, *a, **k: None  # CPU-only machine
        return AWQModifier(config_groups=groups, ignore=["lm_head"])
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    return [SmoothQuantModifier(smoothing_strength=0.5),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--method", default="gptq", choices=["gptq", "awq", "smoothquant", "rtn"])
    ap.add_argument("--scheme", choices=sorted(PRESETS) + sorted(GROUPS), help="a float preset instead of --bits/--group")
    ap.add_argument("--kv-cache", choices=["fp8"], help="with a --scheme of GROUPS: a calibrated FP8 KV cache")
    ap.add_argument("--save", help="write the compressed checkpoint here")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--actorder", default="static")
    args = ap.parse_args()
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    data = torch.load(args.data)
    calib = data["calib"]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
    recipe = recipe_for(args)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=calib.shape[1],
            num_calibration_samples=calib.shape[0], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0
    if args.save:
        model.save_pretrained(args.save, save_compressed=True)
    print(json.dumps({"seconds": seconds, "ppl": perplexity(model, data["eval"])}))


if __name__ == "__main__":
    main()
