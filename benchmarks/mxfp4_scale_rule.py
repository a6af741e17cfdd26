"""MXFP4's (and with --scheme nvfp4, NVFP4's) scale rule (``QuantScheme.scale_rule``) chosen on a
validation split; wikitext2 (the text of the published tables) is measured beside it and never
used to choose.

Weight-only MXFP4 (MXFP4A16: ``quantspec quantize --scheme mxfp4 --method rtn|gptq``, the same
recipe, plan, method and block driver; act-order as that command's default, off, unless
--act-order) with each rule; perplexity of the fake-quantized float32 model. Splits and
calibration are awq_tune_defaults.py's (``load_data``): validation = C4 documents 1800-1999 of
c4-validation-2k.jsonl outside the 64 x 512 seed-0 calibration draw, its first 40 windows of 512;
test = wikitext2's first 40 windows of 512; calibration (GPTQ) 64 C4 x 512, seed 0. ``dense``
measures the unquantized model on both splits.

Each run appends its rows (with the command and the date) to --json; --md is rewritten from it.

    python benchmarks/mxfp4_scale_rule.py --model smollm2-135m --methods dense,rtn,gptq
    python benchmarks/mxfp4_scale_rule.py --model qwen2.5-coder-0.5b --methods gptq --rules mse,ocp
    python benchmarks/mxfp4_scale_rule.py --scheme nvfp4 --model smollm2-135m --methods rtn,gptq  # nvfp4-scale-rule.md
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from awq_tune_defaults import load_data  # (it also puts peers/ on the path)
from peer_common import perplexity
from quant_peers import RESULTS

from quantspec.core.scheme import MX_SCALE_RULE, SCALE_RULES, SCHEME_PRESETS
from quantspec.formats import get_format
from quantspec.models import load_dense
from quantspec.models.source import dense_folder
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.plan import make_plan
from quantspec.quant.recipe import Recipe
from quantspec.quant.registry import build_method


def measure(model_dir: Path, data: dict, method: str, rule: str | None, act_order: bool, preset: str = "mxfp4") -> dict:
    """One row: ``method`` (dense, rtn, gptq) with ``rule`` on a freshly loaded float32 model."""
    model, _, _ = load_dense(str(model_dir), dtype="float32")
    seconds = 0.0
    if method != "dense":
        scheme = {**SCHEME_PRESETS[preset].to_dict(), "scale_rule": rule,
                  "act_order": act_order, "static_groups": act_order}
        recipe = Recipe.from_dict({"method": method, "format": "compressed-tensors", "scheme": scheme})
        plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore)
        quant = build_method(recipe)
        t0 = time.perf_counter()
        run_blockwise(model, get_arch(model), data["calib"] if quant.needs_calibration else None, quant,
                      plan.quantize, progress=False)
        seconds = round(time.perf_counter() - t0, 1)
    return {"method": method, "rule": rule, "act_order": act_order if method == "gptq" else None,
            "val_ppl": perplexity(model, data["val"]), "test_ppl": perplexity(model, data["test"]),
            "seconds": seconds}


def key(r: dict) -> str:
    return json.dumps([r["model"], r["method"], r["rule"], r["act_order"], r["windows"]])


NV_TEXT = ("Weight-only NVFP4 (E2M1 values, one E4M3 scale per 16 under the per-tensor global scale), float32 "
           "model, perplexity of the fake-quantized weights. Rules (`QuantScheme.scale_rule`, "
           "quantspec/quant/floatgrid.py `nv_group_scales`): amax = the E4M3 code nearest amax / 6 x global "
           "(llm-compressor's), mse = of that code, the one above and the two below, the one with the smallest "
           "squared error of the group. Validation: C4 documents 1800-1999 of c4-validation-2k.jsonl outside the "
           "64 x 512 seed-0 calibration draw, first windows of 512; test: wikitext2's first windows of 512. The "
           "rule is chosen on the validation column only; **bold**: the best rule of its model and method there. "
           "Raw rows: nvfp4-scale-rule.json.")


def write_md(path: Path, table: list[dict], preset: str = "mxfp4") -> None:
    lines = [f"# {preset.upper()} scale rule on a validation split (C4 outside the calibration draw) and on wikitext2 (test)", "",
             NV_TEXT if preset == "nvfp4" else ("Weight-only MXFP4 (E2M1 values, one E8M0 power-of-two scale per 32), float32 model, perplexity of the "
             "fake-quantized weights. Rules (`QuantScheme.scale_rule`, quantspec/quant/floatgrid.py): ocp = "
             "floor(log2 amax) - 2 (may clip the group max), ceil = the next exponent where ocp clips, mse = the "
             "one of the two with the smaller squared error of the group. Validation: C4 documents 1800-1999 of "
             "c4-validation-2k.jsonl outside the 64 x 512 seed-0 calibration draw, first windows of 512; test: "
             "wikitext2's first windows of 512 (benchmarks/awq_tune_defaults.py's `load_data`). The rule is chosen "
             "on the validation column only; **bold**: the best rule of its model and method there. quantize s: "
             "wall time on a shared 2-core machine, not a speed comparison. Raw rows: mxfp4-scale-rule.json."), "",
             "| model | method | act-order | scale rule | windows | C4 val ppl | wikitext2 ppl | quantize s | when |",
             "|---|---|---|---|---|---|---|---|---|"]
    best = {}
    for r in table:
        if r["method"] != "dense":
            g = (r["model"], r["method"], r["act_order"], r["windows"])
            best[g] = min(best.get(g, float("inf")), r["val_ppl"])
    for r in sorted(table, key=lambda r: (r["model"], ["dense", "rtn", "gptq"].index(r["method"]), str(r["rule"]))):
        val = f"{r['val_ppl']:.3f}"
        if best.get((r["model"], r["method"], r["act_order"], r["windows"])) == r["val_ppl"]:
            val = f"**{val}**"
        order = {None: "-", False: "none", True: "static"}[r["act_order"]]
        rule = r["rule"] or "-"
        lines.append(f"| {r['model']} | {r['method']} | {order} | {rule} | {r['windows']} | {val} | "
                     f"{r['test_ppl']:.3f} | {r['seconds']} | {r['when']} |")
    lines += ["", "Commands (each row's `command` field in the JSON):", ""]
    lines += [f"    {c}" for c in dict.fromkeys(r["command"] for r in table)]
    path.write_text("\n".join(lines) + "\n")


def save_row(args, row: dict) -> None:
    old = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
    row = {"model": Path(args.model).name, "windows": args.windows, **row,
           "command": "python benchmarks/mxfp4_scale_rule.py " + shlex.join(sys.argv[1:]),
           "when": time.strftime("%Y-%m-%d %H:%M"), "default_then": MX_SCALE_RULE}
    table = [r for r in old if key(r) != key(row)] + [row]
    args.json.write_text(json.dumps({"rows": table}, indent=1))
    write_md(args.md, table, args.scheme)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="alias or local HF folder")
    ap.add_argument("--methods", default="dense,rtn,gptq", help="comma list of dense, rtn, gptq (run in this order)")
    ap.add_argument("--scheme", choices=sorted(SCALE_RULES), default="mxfp4")
    ap.add_argument("--rules", default=None,
                    help="comma list of the scheme's rules (default all but auto; mxfp4's auto: round or mse by method)")
    ap.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=False,
                    help="GPTQ with static-group act-order (off: the quantize command's default)")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None, help="default results/SCHEME-scale-rule.json")
    ap.add_argument("--md", type=Path, default=None)
    args = ap.parse_args()
    args.json = args.json or RESULTS / f"{args.scheme}-scale-rule.json"
    args.md = args.md or RESULTS / f"{args.scheme}-scale-rule.md"
    known = SCALE_RULES[args.scheme]
    methods = args.methods.split(",")
    rules = args.rules.split(",") if args.rules else [r for r in known if r != "auto"]
    if set(methods) - {"dense", "rtn", "gptq"} or set(rules) - set(known):
        raise SystemExit(f"bad --methods {args.methods} or --rules {args.rules}")
    model_dir = dense_folder(args.model)
    data = load_data(model_dir, args.windows)
    for method in methods:
        for rule in [None] if method == "dense" else rules:
            row = {**measure(model_dir, data, method, rule, args.act_order, args.scheme),
                   "val_docs": [data["val_docs"][0], data["val_docs"][-1], len(data["val_docs"])]}
            save_row(args, row)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
