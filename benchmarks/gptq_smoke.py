"""GPTQ smoke benchmark: W4 g128 GPTQ on SmolLM2-135M, engine wall time and perplexity.

Calibration: 64 x 512 tokens of c4 validation (local copy); evaluation: wikitext2 test,
seqlen 512, 40 non-overlapping windows, on the fake-quant (dequantized) model.
Reference numbers on the same protocol: dense ~29.19, RTN W4 g128 ~44.25.

    python benchmarks/gptq_smoke.py [--samples 64] [--seqlen 512] [--windows 40] [--json out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from quantspec.data import calibration_samples
from quantspec.eval.perplexity import perplexity
from quantspec.models import load_dense
from quantspec.quant.arch import block_linears, get_arch
from quantspec.quant.block_methods import GPTQMethod
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.recipe import GPTQOptions
from quantspec.quant.scheme import QuantScheme

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model spec for load_dense (default SmolLM2-135M)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy CPU)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok, _ = load_dense(args.model, dtype="float32")
    arch = get_arch(model)
    scheme = QuantScheme(bits=4, group_size=128, act_order=args.act_order)
    plan = {name: scheme for name in block_linears(model, arch)}
    c4 = args.data / "c4" / "c4-validation-2k.jsonl"
    ids = calibration_samples(tok, str(c4), args.samples, args.seqlen, seed=0)

    report: dict = {}
    t0 = time.perf_counter()
    run_blockwise(model, arch, ids, GPTQMethod(GPTQOptions()), plan, report=report)
    engine_s = time.perf_counter() - t0

    wiki = args.data / "wikitext2" / "wikitext-2-raw-v1.test.txt"
    ppl = perplexity(model, tok, str(wiki), seqlen=args.seqlen, windows=args.windows)
    out = {
        "method": "gptq",
        "scheme": scheme.short_name,
        "calibration": {"data": "c4", "samples": args.samples, "seqlen": args.seqlen},
        "engine_seconds": round(engine_s, 1),
        "gptq_seconds": round(sum(r["seconds"] for r in report.values()), 1),
        "median_layer_rel_mse": statistics.median(r["rel_mse"] for r in report.values()),
        "max_damp_retries": max(r["retries"] for r in report.values()),
        "wikitext2_ppl": round(ppl["ppl"], 3),
        "eval": {"seqlen": ppl["seqlen"], "windows": ppl["windows"]},
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
