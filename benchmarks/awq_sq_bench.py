"""AWQ (W4/W3 g128, asymmetric) and SmoothQuant W8A8 on SmolLM2-135M: perplexity and wall time.

Protocol: calibration = C4, 64 samples x 512 tokens, seed 0; perplexity = wikitext2 test,
seqlen 512, 40 windows (quantspec.eval.perplexity). Weight-only rows evaluate the fake-quant
model (dequantized weights in fp32); W8A8 rows also quantize every quantized Linear's input
per token to int8 (symmetric, dynamic), as the reference kernel does. Wall time = the block
engine's quantization time (no model load, no eval).

    QUANTSPEC_DATA=/work/shared/data nice python benchmarks/awq_sq_bench.py --out benchmarks/results/awq_sq.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from torch import nn

ROWS = ("dense", "rtn-w4g128", "awq-w4g128", "w8a8-rtn", "smoothquant-w8a8", "rtn-w3g128", "awq-w3g128")


def w8a8_hooks(model: nn.Module, names) -> list:
    """Per-token int8 fake quantization of the inputs of ``names`` (forward pre-hooks)."""
    from quantspec.kernels.reference import quantize_per_token_int8

    def pre(_m, args):
        x = args[0]
        q, s = quantize_per_token_int8(x.reshape(-1, x.shape[-1]))
        return ((q.float() * s).reshape(x.shape).to(x.dtype),)

    return [model.get_submodule(n).register_forward_pre_hook(pre) for n in names]


def method_for(row: str, search_tokens: int = 2048, clip_tokens: int = 512):
    from quantspec.quant.awq import AWQMethod, AWQSettings
    from quantspec.quant.block_methods import RTNMethod
    from quantspec.quant.compose import Composed
    from quantspec.core.scheme import QuantScheme
    from quantspec.quant.smoothquant import SmoothQuantMethod

    awq = AWQSettings(search_tokens=search_tokens, clip_tokens=clip_tokens)
    w8a8 = QuantScheme(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")
    table = {
        "rtn-w4g128": (RTNMethod(), QuantScheme(4, 128, False)),
        "awq-w4g128": (AWQMethod(awq), QuantScheme(4, 128, False)),
        "rtn-w3g128": (RTNMethod(), QuantScheme(3, 128, False)),
        "awq-w3g128": (AWQMethod(awq), QuantScheme(3, 128, False)),
        "w8a8-rtn": (RTNMethod(), w8a8),
        "smoothquant-w8a8": (Composed(SmoothQuantMethod(), RTNMethod()), w8a8),
    }
    return table[row]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--search-tokens", type=int, default=2048, help="AWQ scale-search token sample")
    ap.add_argument("--clip-tokens", type=int, default=512, help="AWQ clip-search token sample")
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids oversubscription on shared CPUs)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/awq_sq.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from quantspec.data import calibration_samples
    from quantspec.eval.perplexity import perplexity
    from quantspec.models import load_dense
    from quantspec.quant.arch import block_linears
    from quantspec.quant.arch_infer import get_arch
    from quantspec.quant.calibrate import run_blockwise

    dense, tok, _ = load_dense(args.model)
    arch = get_arch(dense)
    ids = calibration_samples(tok, "c4", args.samples, args.seqlen, 0)
    names = list(block_linears(dense, arch))
    results = {"model": args.model, "calibration": f"c4 {args.samples}x{args.seqlen} seed 0",
               "awq_tokens": {"search": args.search_tokens, "clip": args.clip_tokens},
               "eval": f"wikitext2 seqlen {args.eval_seqlen} x {args.windows} windows", "rows": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in args.rows:
        model, seconds, handles = dense, 0.0, []
        if row != "dense":
            method, scheme = method_for(row, args.search_tokens, args.clip_tokens)
            model = copy.deepcopy(dense)
            t0 = time.perf_counter()
            run_blockwise(model, arch, ids, method, {n: scheme for n in names}, progress=True)
            seconds = time.perf_counter() - t0
            if scheme.activations:
                handles = w8a8_hooks(model, names)
        ppl = perplexity(model, tok, "wikitext2", seqlen=args.eval_seqlen, windows=args.windows)["ppl"]
        for h in handles:
            h.remove()
        results["rows"][row] = {"ppl": round(float(ppl), 3), "quantize_seconds": round(seconds, 1)}
        print(f"{row:18s} ppl {ppl:8.3f}  quantize {seconds:7.1f} s", flush=True)
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
