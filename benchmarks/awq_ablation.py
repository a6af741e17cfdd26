"""AWQ ablations on one model: AWQ settings (or plain RTN) on the first N blocks, perplexity of
the fake-quantized model; the protocol of quant_peers.py (64 C4 x 512 calibration, wikitext2
seqlen 512), fewer eval windows by default for quick comparisons.

    python benchmarks/awq_ablation.py --model ~/.cache/quantspec/models/qwen2.5-coder-0.5b \\
        --blocks 4 --windows 20 --bits 4 --variant '{"awq": {"clip": false}}' --variant rtn

Each --variant is "rtn" or a JSON object of AWQSettings fields ("awq": AWQOptions fields).
Prints one JSON line per variant: seconds, ppl, per-layer alpha and rel. MSE of block 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from peer_common import perplexity  # noqa: E402
from quant_peers import prepare  # noqa: E402

from quantspec.formats import get_format  # noqa: E402
from quantspec.models import cache_root, load_dense  # noqa: E402
from quantspec.quant.arch_infer import get_arch  # noqa: E402
from quantspec.quant.awq import AWQMethod, AWQSettings  # noqa: E402
from quantspec.quant.block_methods import RTNMethod  # noqa: E402
from quantspec.quant.calibrate import run_blockwise  # noqa: E402
from quantspec.quant.plan import make_plan  # noqa: E402
from quantspec.quant.recipe import AWQOptions, Recipe  # noqa: E402


def method_of(variant: str):
    if variant == "rtn":
        return RTNMethod()
    fields = json.loads(variant)
    return AWQMethod(AWQSettings(awq=AWQOptions(**fields.pop("awq", {})), **fields))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(cache_root() / "models" / "smollm2-135m"))
    ap.add_argument("--variant", action="append", default=None, help='"rtn" or AWQSettings JSON (repeatable)')
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=0, help="quantize only the first N blocks (0: all)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(args.model), Path(tmp) / "data.pt", args.samples, 512, args.windows)
        data = torch.load(Path(tmp) / "data.pt")
    for variant in args.variant or ["{}", "rtn"]:
        model, _, _ = load_dense(args.model, dtype="float32")
        arch = get_arch(model)
        scheme = {"bits": args.bits, "group_size": args.group, "symmetric": False}
        recipe = Recipe.from_dict({"method": "awq", "format": "compressed-tensors", "scheme": scheme})
        plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore).quantize
        if args.blocks:
            keep = tuple(arch.block_name(i) + "." for i in range(args.blocks))
            plan = {n: s for n, s in plan.items() if n.startswith(keep)}
        report: dict = {}
        t0 = time.perf_counter()
        run_blockwise(model, arch, data["calib"], method_of(variant), plan, progress=False, report=report)
        seconds = time.perf_counter() - t0
        first = arch.block_name(0) + "."
        block0 = {n[len(first):]: {"alpha": r.get("awq_alpha"), "rel_mse": r.get("rel_mse"),
                       "clip_gain": r.get("clip_gain")}
                  for n, r in report.items() if n.startswith(first)}
        check = next((r["clip_model_check"] for r in report.values() if "clip_model_check" in r), None)
        print(json.dumps({"variant": variant, "bits": args.bits, "group": args.group, "blocks": args.blocks,
                          "seconds": round(seconds, 1), "ppl": perplexity(model, data["eval"]),
                          "clip_model_check": check, "block0": block0}), flush=True)


if __name__ == "__main__":
    main()
