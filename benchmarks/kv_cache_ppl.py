"""KV-cache quantization: perplexity with calibrated KV scales against scale 1.0 and dynamic
scales, side by side in one run (issue 30; the comparison ROCm/vllm#317 made on Llama-3.1-70B).

One checkpoint per KV strategy and scale rule (FP8 E4M3 weights per channel, RTN, 16-bit
activations: the KV cache is the only other quantization, and the cpu backend runs the weights
exactly), calibrated with ``quantize --kv-cache fp8`` (per tensor: what vLLM reads; per KV head;
``--kv-scale-rule`` amax and mse, docs/decisions/kv-scale-rule.md) on the protocol's calibration
(C4 64 x 512, seed 0; 32 of those samples observed for the KV scales); then wikitext2 perplexity
(seqlen 512, first 40 windows) with attention reading: an unquantized cache, FP8 with the
calibrated scales, FP8 with scale 1.0, FP8 with dynamic per-write scales, and the same three for
int8 (its calibrated scales are the FP8 ones x 448 / 127).

``--peer llmc``: llm-compressor (its own venv, benchmarks/peers/llmc.py) makes the same kind of
checkpoint in the same run (FP8 E4M3 weights per channel, RTN; its ``kv_cache_scheme`` FP8 per
tensor, static, calibrated on the same 64 x 512 samples, all of them observed by its default
"minmax" observer: a moving average of each sample's max), and quantspec's
evaluator reads that checkpoint's k_scale / v_scale: the two calibrations of the KV scales
compared on one evaluator, the same windows.

    python benchmarks/kv_cache_ppl.py --model smollm2-135m [--peer llmc] [--kinds fp8] [--rules mse,amax] [--windows 20]

Unit and dynamic scales never read the calibrated ones, so they are measured once (on the per-tensor
checkpoint); ``--kinds fp8`` leaves the int8 rows out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quant_peers import DATA, RESULTS, prepare, python_of  # noqa: E402

import quantspec  # noqa: E402
from quantspec.eval.machine import describe_machine, machine_line  # noqa: E402
from quantspec.eval.perplexity import perplexity  # noqa: E402
from quantspec.models import load_tokenizer  # noqa: E402
from quantspec.models.source import dense_folder  # noqa: E402
from quantspec.core.kv_config import KV_SCALE_RULES, KVCacheConfig  # noqa: E402
from quantspec.quant.recipe import Recipe  # noqa: E402
from quantspec.core.scheme import SCHEME_PRESETS  # noqa: E402

SETTINGS = [("off", "calibrated"), ("fp8", "calibrated"), ("fp8", "unit"), ("fp8", "dynamic"),
            ("int8", "calibrated"), ("int8", "unit"), ("int8", "dynamic")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--out", type=Path, default=RESULTS / "kv-cache-ppl")
    ap.add_argument("--peer", choices=["llmc"], help="also llm-compressor's calibrated FP8 KV checkpoint")
    ap.add_argument("--kinds", default="fp8,int8", help="KV cache kinds measured (the unquantized cache always)")
    ap.add_argument("--rules", default="mse,amax", help="KV scale rules calibrated (a checkpoint each; auto is mse for fp8)")
    args = ap.parse_args()
    kinds = {"off", *args.kinds.split(",")}
    if not kinds <= {"off", "fp8", "int8"}:
        raise SystemExit(f"--kinds {args.kinds}: use fp8, int8 or fp8,int8")
    folder = dense_folder(args.model)
    tok = load_tokenizer(str(folder))
    wiki = str(DATA / "wikitext2" / "wikitext-2-raw-v1.test.txt")
    rules = args.rules.split(",")
    if not set(rules) <= set(KV_SCALE_RULES):
        raise SystemExit(f"--rules {args.rules}: use some of {list(KV_SCALE_RULES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, rule in [(s, r) for s in ("tensor", "head") for r in rules]:
            first = (strategy, rule) == ("tensor", rules[0])
            recipe = Recipe(name=f"rtn-fp8-kv-{strategy}-{rule}", method="rtn", format="compressed-tensors",
                            scheme=SCHEME_PRESETS["fp8-weight"], kv_cache=KVCacheConfig("fp8", strategy, samples=32, scale_rule=rule))
            recipe = replace(recipe, calibration=replace(recipe.calibration, data=str(DATA / "c4" / "c4-validation-2k.jsonl"),
                                                         samples=64, seqlen=512, seed=0))
            t0 = time.perf_counter()
            outcome = quantspec.quantize(str(folder), recipe, Path(tmp) / f"{strategy}-{rule}", progress=False)
            seconds = {"quantize_seconds": round(time.perf_counter() - t0, 1),  # the whole call: weights, KV scales, writing
                       "kv_seconds": outcome.report["kv_cache"]["seconds"]}
            ckpt = outcome.out
            model = quantspec.load_quantized(ckpt, dtype="float32", backend="exact")
            for kind, scales in SETTINGS:
                if kind not in kinds or (not first and (kind == "off" or scales != "calibrated")):
                    continue  # unit and dynamic scales do not read the calibrated ones: the same rows as per tensor
                r = perplexity(model, tok, wiki, seqlen=512, windows=args.windows, progress=False,
                               kv_cache="checkpoint" if (kind, scales) == ("fp8", "calibrated") else kind,
                               kv_scales=scales)
                calibrated = scales == "calibrated" and kind != "off"
                row = {"tool": "quantspec", "kv_strategy": strategy if calibrated else "-", "kv_rule": rule if calibrated else "-",
                       "kv": "none" if r["kv_cache"] is None else f"{r['kv_cache']['kind']} {r['kv_cache']['scales']}",
                       "ppl": round(r["ppl"], 4), **(seconds if calibrated else {})}
                print(row, flush=True)
                rows.append(row)
        if args.peer:
            rows += peer_rows(folder, Path(tmp), tok, wiki, args.windows)
    meta = {"model": args.model, "weights": "fp8-weight RTN (FP8 E4M3 per channel, fp32 activations)",
            "calibration": "c4 64 x 512 seed 0 (KV: first 32)", "eval": f"wikitext2 seqlen 512 x {args.windows} windows",
            "backend": "exact (cpu fgemm where built, else reference)", "machine": machine_line(describe_machine()),
            "date": time.strftime("%Y-%m-%d"), "command": shlex.join(["python", *sys.argv])}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# KV-cache quantization on {args.model} ({meta['weights']}; {meta['eval']})", "",
             f"Command: `{meta['command']}`. Raw rows: `{args.out.name}.json`. {meta['machine']}, {meta['date']}.", "",
             ("quantize s: quantspec's whole `quantize` call (load, FP8 weights, KV scales, write; KV scales alone in "
              "brackets); llm-compressor's `oneshot` call alone (no load, no save)."), "",
             "| checkpoint by | KV cache | scales from | scale rule | wikitext2 ppl | quantize s |", "|---|---|---|---|---:|---|"]

    def secs(r):
        if "quantize_seconds" in r:
            return f"{r['quantize_seconds']} ({r['kv_seconds']})"
        return str(r["llmc_seconds"]) if r["tool"] == "llm-compressor" and r["kv_strategy"] != "-" else "-"
    lines += [f"| {r['tool']} | {r['kv']} | {r['kv_strategy']} | {r['kv_rule']} | {r['ppl']:.4f} | {secs(r)} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def peer_rows(folder: Path, tmp: Path, tok, wiki: str, windows: int) -> list[dict]:
    """llm-compressor's FP8-weight + calibrated FP8 KV checkpoint, read by our evaluator: its
    perplexity with an unquantized cache and with its own KV scales."""
    data, out = tmp / "data.pt", tmp / "llmc"
    prepare(folder, data, 64, 512, windows)
    cmd = [python_of("llmc"), str(HERE / "peers" / "llmc.py"), str(folder), str(data), "--method", "rtn",
           "--scheme", "fp8-weight", "--kv-cache", "fp8", "--save", str(out)]
    env = {**os.environ, "PYTHONPATH": str(HERE / "peers"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"llm-compressor failed: {proc.stderr[-2000:]}")
    own = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    model = quantspec.load_quantized(out, dtype="float32", backend="exact")
    rows = []
    for kind in ("off", "checkpoint"):
        r = perplexity(model, tok, wiki, seqlen=512, windows=windows, progress=False, kv_cache=kind)
        rows.append({"tool": "llm-compressor", "kv_strategy": "tensor" if kind == "checkpoint" else "-",
                     "kv_rule": "its minmax observer (moving average)" if kind == "checkpoint" else "-",
                     "kv": "none" if r["kv_cache"] is None else f"{r['kv_cache']['kind']} {r['kv_cache']['scales']}",
                     "ppl": round(r["ppl"], 4), "llmc_runtime_ppl": round(own["ppl"], 4),
                     "llmc_seconds": round(own["seconds"], 1)})
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    main()
