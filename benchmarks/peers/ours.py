"""Runner for quantspec's side of the peer benchmarks (same arguments and output as the peer
runners): a calibrated method on the calibration ids of DATA.pt, perplexity of the
fake-quantized model on its eval windows.

    python ours.py MODEL_DIR DATA.pt --method gptq|awq|smoothquant|rtn --bits 4 --group 128 [--asym] [--actorder static|group|none]
    python ours.py MODEL_DIR DATA.pt --method rtn|gptq --scheme fp8-dynamic|nvfp4|mxfp4 [--asymmetric] [--forward-dtype bfloat16]

``seconds`` is the engine's wall time (capture and every block; no load, no save). Layers whose
K the group size does not divide are regrouped as quantspec's format writes them. W8A8
(smoothquant) evaluates with int8 per-token activations, as the runtime computes them.
"""

import argparse
import json
import time

import torch

from peer_common import perplexity

from quantspec.formats import get_format
from quantspec.kernels.reference import quantize_per_token_int8
from quantspec.core.floatcodes import quantize_per_token_fp8
from quantspec.core.scheme import SCHEME_PRESETS
from quantspec.models import load_dense
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.registry import build_method
from quantspec.quant.plan import make_plan
from quantspec.quant.recipe import Recipe

ACT_ORDER = {"none": {}, "static": {"act_order": True, "static_groups": True}, "group": {"act_order": True}}
FORMAT = {"gptq": "gptq", "awq": "compressed-tensors", "awq+gptq": "gptq", "smoothquant": "compressed-tensors",
          "rtn": "gptq"}  # formats that hold the configs (AWQ GEMM is 4-bit only)


def fake_quantize_activations(model, names, kind: str = "int8-token-dynamic") -> None:
    """Per-token fake quantization (int8, or FP8 E4M3 for fp8-token-dynamic) of the inputs of
    the Linears ``names``."""
    quant = quantize_per_token_fp8 if kind == "fp8-token-dynamic" else quantize_per_token_int8

    def pre(_mod, args):
        x = args[0]
        q, s = quant(x.reshape(-1, x.shape[-1]))
        return ((q.float() * s).reshape(x.shape).to(x.dtype),) + tuple(args[1:])

    for name in names:
        model.get_submodule(name).register_forward_pre_hook(pre)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--method", default="gptq", choices=sorted(FORMAT) + ["dense"])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--asym", action="store_true")
    ap.add_argument("--actorder", default="none", choices=sorted(ACT_ORDER))
    ap.add_argument("--scheme", choices=sorted(SCHEME_PRESETS), help="a float scheme instead of --bits/--group")
    ap.add_argument("--asymmetric", action="store_true", help="GPTQ: gptq.asymmetric")
    ap.add_argument("--forward-dtype", choices=["float32", "bfloat16", "auto"], help="GPTQ: gptq.forward_dtype")
    args = ap.parse_args()
    data = torch.load(args.data)
    model, _, _ = load_dense(args.model, dtype="float32")
    if args.method == "dense":
        print(json.dumps({"seconds": 0.0, "ppl": perplexity(model, data["eval"])}))
        return
    scheme = {"bits": args.bits, "group_size": args.group, "symmetric": not args.asym, **ACT_ORDER[args.actorder]}
    fmt = FORMAT[args.method]
    if args.method == "smoothquant":
        scheme = {"bits": 8, "group_size": -1, "activations": "int8-token-dynamic"}
    if args.scheme:
        scheme = {**SCHEME_PRESETS[args.scheme].to_dict(), **ACT_ORDER[args.actorder]}
        fmt = "compressed-tensors"
    recipe = Recipe.from_dict({"method": args.method, "format": fmt, "scheme": scheme,
                               "gptq": {**({"asymmetric": True} if args.asymmetric else {}),
                                        **({"forward_dtype": args.forward_dtype} if args.forward_dtype else {})}})
    plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore)
    method = build_method(recipe)
    # as the pipeline does (job.prepare): calibration data only for a method or scheme that uses it
    ids = data["calib"] if method.needs_calibration or recipe.scheme.static_activations else None
    t0 = time.perf_counter()
    run_blockwise(model, get_arch(model), ids, method, plan.quantize, progress=False)
    seconds = time.perf_counter() - t0
    if recipe.scheme.activations:
        fake_quantize_activations(model, plan.quantize, recipe.scheme.activations)
    print(json.dumps({"seconds": seconds, "ppl": perplexity(model, data["eval"])}))


if __name__ == "__main__":
    main()
