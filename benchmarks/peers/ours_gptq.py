"""Runner for quantspec's side of benchmarks/gptq_peers.py (same arguments and output as the
peer runners): GPTQ with quantspec's engine on the calibration ids of DATA.pt, perplexity of
the fake-quantized model on its eval windows.

    python ours_gptq.py MODEL_DIR DATA.pt --bits 4 --group 128 [--actorder static|group|none]

``seconds`` is the engine's wall time (capture, every block, no load, no save). Layers whose K
the group size does not divide are regrouped as quantspec's GPTQ format writes them.
"""

import argparse
import json
import time

import torch

from llmc_gptq import perplexity

from quantspec.formats import get_format
from quantspec.models import load_dense
from quantspec.quant.arch import get_arch
from quantspec.quant.block_methods import GPTQMethod
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.plan import make_plan
from quantspec.quant.recipe import GPTQOptions
from quantspec.quant.scheme import QuantScheme

ACT_ORDER = {"none": {}, "static": {"act_order": True, "static_groups": True}, "group": {"act_order": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--actorder", default="static", choices=sorted(ACT_ORDER))
    args = ap.parse_args()
    data = torch.load(args.data)
    model, _, _ = load_dense(args.model, dtype="float32")
    scheme = QuantScheme(bits=args.bits, group_size=args.group, **ACT_ORDER[args.actorder])
    plan = make_plan(model, scheme, get_format("gptq"))
    t0 = time.perf_counter()
    run_blockwise(model, get_arch(model), data["calib"], GPTQMethod(GPTQOptions()), plan.quantize,
                  progress=False)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "ppl": perplexity(model, data["eval"])}))


if __name__ == "__main__":
    main()
