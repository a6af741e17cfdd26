"""KV-cache quantization: perplexity with calibrated KV scales against scale 1.0 and dynamic
scales, side by side in one run (issue 30; the comparison ROCm/vllm#317 made on Llama-3.1-70B).

One checkpoint per KV strategy (FP8 E4M3 weights per channel, RTN, 16-bit activations: the KV
cache is the only other quantization, and the cpu backend runs the weights exactly), calibrated with ``quantize --kv-cache fp8`` (per tensor: what vLLM reads; per KV
head) on the protocol's calibration (C4 64 x 512, seed 0; 32 of those samples observed for the
KV scales); then wikitext2 perplexity (seqlen 512, first 40 windows) with attention reading:
an unquantized cache, FP8 with the calibrated scales, FP8 with scale 1.0, FP8 with dynamic
per-write scales, and the same three for int8 (its calibrated scales are the same maxima / 127).

    python benchmarks/kv_cache_ppl.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quant_peers import DATA, RESULTS  # noqa: E402

import quantspec  # noqa: E402
from quantspec.eval.perplexity import perplexity  # noqa: E402
from quantspec.models import load_tokenizer  # noqa: E402
from quantspec.models.source import dense_folder  # noqa: E402
from quantspec.core.kv_config import KVCacheConfig  # noqa: E402
from quantspec.quant.recipe import Recipe  # noqa: E402
from quantspec.core.scheme import SCHEME_PRESETS  # noqa: E402

SETTINGS = [("off", "calibrated"), ("fp8", "calibrated"), ("fp8", "unit"), ("fp8", "dynamic"),
            ("int8", "calibrated"), ("int8", "unit"), ("int8", "dynamic")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv-cache-ppl")
    args = ap.parse_args()
    folder = dense_folder(args.model)
    tok = load_tokenizer(str(folder))
    wiki = str(DATA / "wikitext2" / "wikitext-2-raw-v1.test.txt")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("tensor", "head"):
            recipe = Recipe(name=f"rtn-fp8-kv-{strategy}", method="rtn", format="compressed-tensors",
                            scheme=SCHEME_PRESETS["fp8-weight"], kv_cache=KVCacheConfig("fp8", strategy, samples=32))
            recipe = replace(recipe, calibration=replace(recipe.calibration, data=str(DATA / "c4" / "c4-validation-2k.jsonl"),
                                                         samples=64, seqlen=512, seed=0))
            ckpt = quantspec.quantize(str(folder), recipe, Path(tmp) / strategy, progress=False).out
            model = quantspec.load_quantized(ckpt, dtype="float32", backend="exact")
            for kind, scales in SETTINGS:
                if strategy == "head" and kind == "off":
                    continue
                r = perplexity(model, tok, wiki, seqlen=512, windows=args.windows, progress=False,
                               kv_cache="checkpoint" if (kind, scales) == ("fp8", "calibrated") else kind,
                               kv_scales=scales)
                row = {"kv_strategy": strategy if scales == "calibrated" and kind != "off" else "-",
                       "kv": "none" if r["kv_cache"] is None else f"{r['kv_cache']['kind']} {r['kv_cache']['scales']}",
                       "ppl": round(r["ppl"], 4)}
                if row in rows:
                    continue
                print(row, flush=True)
                rows.append(row)
    meta = {"model": args.model, "weights": "fp8-weight RTN (FP8 E4M3 per channel, fp32 activations)",
            "calibration": "c4 64 x 512 seed 0 (KV: first 32)", "eval": f"wikitext2 seqlen 512 x {args.windows} windows",
            "backend": "exact (cpu fgemm where built, else reference)", "machine": f"{platform.machine()}", "command": shlex.join(["python", *sys.argv])}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# KV-cache quantization on {args.model} ({meta['weights']}; {meta['eval']})", "",
             f"Command: `{meta['command']}`. Raw rows: `{args.out.name}.json`.", "",
             "| KV cache | scales from | wikitext2 ppl |", "|---|---|---|"]
    lines += [f"| {r['kv']} | {r['kv_strategy']} | {r['ppl']:.4f} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
