"""``quantspec quantize [MODEL]``: quantize a model into a checkpoint folder.

Flags override the recipe's fields. With no arguments it quantizes the built-in default model
with the default recipe and prints a before/after table (perplexity, size, decode tokens/s).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from ._common import write_json


def add_parser(sub) -> None:
    from ..formats import FORMAT_NAMES
    from ..quant.registry import METHODS
    from ..core.scheme import MX_SCALE_RULE, MX_SCALE_RULES, NV_SCALE_RULES, SCHEME_PRESETS
    from ..core.kv_config import KV_SCALE_RULES

    p = sub.add_parser(
        "quantize",
        help="quantize a model (hub id, local folder, .gguf, or the built-in default)",
        description=__doc__,
    )
    p.add_argument("model", nargs="?", default=None, help="HF hub id, local folder, .gguf file or alias (default: smollm2-135m)")
    p.add_argument("--recipe", help="recipe name (recipes/NAME.yaml) or a YAML path (default: gptq-w4g128)")
    p.add_argument("--method", choices=list(METHODS),
                   help="; ".join(f"{m}: {spec.summary}" for m, spec in METHODS.items()))
    p.add_argument("--bits", type=int, choices=[2, 3, 4, 8])
    p.add_argument("--group-size", type=int, choices=[-1, 32, 64, 128])
    p.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None, help="symmetric (no zero point)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None, help="GPTQ desc_act")
    p.add_argument("--static-groups", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--w8a8", action="store_true", help="int8 weights and dynamic per-token int8 activations")
    p.add_argument("--scheme", choices=list(SCHEME_PRESETS),
                   help="a float scheme (compressed-tensors format): fp8-weight (E4M3 per channel, weight-only), "
                        "fp8-dynamic (and FP8 activations per token), fp8-static, fp8-block (a scale per 128x128 "
                        "weight block, FP8 activations per token per 128 columns; layers whose K is not a "
                        "multiple of 128 stay dense), fp8-block-weight (weight-only), nvfp4, mxfp4; "
                        "--bits/--group-size name the integer schemes")
    p.add_argument("--scale-rule", choices=list(dict.fromkeys(MX_SCALE_RULES + NV_SCALE_RULES)),
                   help=f"mxfp4: each group's power-of-two scale by the OCP rule floor(log2 amax) - 2 (ocp, may clip "
                        f"the max), the next exponent where that clips (ceil), whichever of the two has the "
                        f"smaller squared error (mse; hmse: weighted by GPTQ's Hessian diagonal), or amax rounded to a "
                        f"power of two as llm-compressor does (round); default {MX_SCALE_RULE}: round for RTN and AWQ, "
                        f"mse for GPTQ (chosen on a validation split). nvfp4: each group's E4M3 scale as the nearest "
                        f"code to amax / 6 (amax, the default) or the one of its neighbours with the smallest squared "
                        f"error (mse)")
    p.add_argument("--format", choices=list(FORMAT_NAMES))
    p.add_argument("--kv-cache", choices=["fp8", "int8"],
                   help="calibrate KV-cache scales (keys after RoPE, values) on the calibration data and write them "
                        "(compressed-tensors kv_cache_scheme, k_scale/v_scale per layer, as vLLM reads them)")
    p.add_argument("--kv-cache-strategy", choices=["tensor", "head"], default=None,
                   help="one KV scale per layer (tensor, the default, what vLLM reads) or per KV head")
    p.add_argument("--kv-scale-rule", choices=list(KV_SCALE_RULES), default=None,
                   help="KV scales: the observed max on the top code (amax), or the multiple of that scale with the "
                        "smallest squared error of the observed keys / values (mse); default auto: mse "
                        "for fp8, amax for int8 (chosen on a validation split, docs/decisions/kv-scale-rule.md)")
    p.add_argument("--kv-search-samples", type=int, default=None, metavar="N",
                   help="the mse KV scale rule's errors are of the first N calibration samples only "
                        "(default 8, chosen on a validation split)")
    p.add_argument("--calib", help="calibration data: c4 (the default), wikitext2, c4-bundled, pydoc or a .txt/.jsonl "
                                   "path; offline without a local copy, c4 and wikitext2 fall back to c4-bundled")
    p.add_argument("--calib-samples", type=int)
    p.add_argument("--calib-seqlen", type=int)
    p.add_argument("--calib-experts", choices=["all", "routed"],
                   help="MoE models: all (default) sends every calibration token through every expert "
                        "for its statistics (the block output stays routed); routed: each expert sees only "
                        "its routed tokens, an expert with none is rounded to nearest (reported)")
    p.add_argument("--seed", type=int)
    p.add_argument("--alpha", type=float, help="SmoothQuant migration strength")
    p.add_argument("--save-scales", help="AWQ: save the searched scales to this file")
    p.add_argument("--load-scales", help="AWQ: reuse scales saved by --save-scales")
    p.add_argument("--clip", action=argparse.BooleanOptionalAction, default=None,
                   help="AWQ: search per-group weight clipping (default: at 4 bits and below)")
    p.add_argument("--clip-min-gain", type=float,
                   help="AWQ: clip a group only where it lowers the group's output error by more than this "
                        "fraction (default 0.3; 0 keeps every clip that helps at all)")
    p.add_argument("--duo-scaling", choices=["both", "on", "off"],
                   help="AWQ candidate scales: the paper's x^a (off), AutoAWQ's x^a / w^(1-a) (on), or both (default)")
    p.add_argument("--awq-search-dtype", choices=["float32", "bfloat16", "auto"],
                   help="AWQ: precision of the searches' forward passes over an fp32 model (default float32; "
                        "bfloat16 about halves the search on CPUs with AMX; auto: bfloat16 where native)")
    p.add_argument("--asymmetric-calibration", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: round each layer toward the float model's output on the float model's inputs "
                        "(GPTAQ; recipe gptq.asymmetric; about twice GPTQ's time; default off; the recipe's "
                        "gptq.asymmetric: auto runs it where it can and plain GPTQ elsewhere). Not --no-sym, "
                        "which is asymmetric quantization (zero points)")
    p.add_argument("--gptq-forward-dtype", choices=["float32", "bfloat16", "auto"],
                   help="GPTQ: precision of the single pass's block forwards over an fp32 model (recipe "
                        "gptq.forward_dtype; default float32; bfloat16 about halves them on CPUs with native bf16; "
                        "auto: bfloat16 where native)")
    p.add_argument("--out", help="output folder (default: ./quantspec-out/<model>-<recipe>/)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its last finished block")
    p.add_argument("--device", help="device for the per-block work (default: cuda if present, else cpu)")
    p.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="read and write one decoder block at a time (default: whenever the model allows it)")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="print a dense vs quantized table (default: on when MODEL is omitted)")
    p.add_argument("--compare-data", default="wikitext2",
                   help="perplexity data of the table (offline without a local copy, wikitext2 and c4 fall back "
                        "to c4-bundled-heldout, documents never used to calibrate)")
    p.add_argument("--compare-windows", type=int, default=40)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="write the result (paths, report summary) as JSON")
    p.set_defaults(func=run)


def recipe_from_args(args):
    from ..quant.pipeline import resolve_recipe
    from dataclasses import asdict

    from ..errors import QuantspecError
    from ..quant.recipe import default_recipe_name
    from ..quant.registry import METHODS, default_scheme
    from ..core.scheme import SCHEME_PRESETS

    recipe = resolve_recipe(args.recipe)
    scheme_fields = {
        "bits": args.bits,
        "group_size": args.group_size,
        "symmetric": args.sym,
        "act_order": args.act_order,
        "static_groups": args.static_groups,
    }
    if args.w8a8:
        given = [flag for flag, v in (("--bits", args.bits), ("--group-size", args.group_size),
                                      ("--sym" if args.sym else "--no-sym", args.sym)) if v is not None]
        if given:
            raise QuantspecError(f"--w8a8 fixes the scheme (8-bit symmetric weights, one scale per output channel); "
                                 f"{', '.join(given)} would be overridden.", f"drop {', '.join(given)} (or --w8a8).")
        scheme_fields.update(bits=8, group_size=-1, symmetric=True, activations="int8-token-dynamic")
    if args.scheme:
        given = [flag for flag, v in (("--bits", args.bits), ("--group-size", args.group_size), ("--sym", args.sym),
                                      ("--w8a8", args.w8a8 or None)) if v is not None]
        if given:
            raise QuantspecError(f"--scheme {args.scheme} fixes the number format; {', '.join(given)} name integer "
                                 "schemes.", f"drop {', '.join(given)} (or --scheme).")
        scheme_fields.update(SCHEME_PRESETS[args.scheme].to_dict())
        scheme_fields.update(act_order=bool(args.act_order), static_groups=bool(args.act_order))
    if args.scale_rule:
        scheme_fields["scale_rule"] = args.scale_rule
    if args.act_order is False and args.static_groups is None:
        scheme_fields["static_groups"] = False  # static groups only mean something with act-order
    changes = {k: v for k, v in scheme_fields.items() if v is not None}
    top: dict = {}
    if args.method:
        top["method"] = args.method
    if args.format:
        top["format"] = args.format
    elif args.w8a8 or args.scheme:
        top["format"] = "compressed-tensors"
    elif args.method and args.recipe is None:  # the method's own default format
        top["format"] = METHODS[args.method].default_format
    calib = {
        k: v
        for k, v in {
            "data": args.calib, "samples": args.calib_samples,
            "seqlen": args.calib_seqlen, "seed": args.seed, "experts": args.calib_experts,
        }.items()
        if v is not None
    }
    awq = {k: v for k, v in {"save_scales": args.save_scales, "load_scales": args.load_scales,
                             "clip": args.clip, "clip_min_gain": args.clip_min_gain, "duo_scaling": {"on": True, "off": False}.get(args.duo_scaling, args.duo_scaling),
                             "search_dtype": args.awq_search_dtype}.items()
           if v is not None}
    for flag, value in (("--kv-cache-strategy", args.kv_cache_strategy), ("--kv-scale-rule", args.kv_scale_rule),
                        ("--kv-search-samples", args.kv_search_samples)):
        if value is not None and not args.kv_cache:
            raise QuantspecError(f"{flag} needs --kv-cache.", "add --kv-cache fp8 (or int8).")
    if args.kv_cache:
        top["kv_cache"] = {"kind": args.kv_cache, "strategy": args.kv_cache_strategy or "tensor",
                           **({"scale_rule": args.kv_scale_rule} if args.kv_scale_rule is not None else {}),
                           **({"search_samples": args.kv_search_samples} if args.kv_search_samples is not None
                              else {})}
        if not args.format:
            top["format"] = "compressed-tensors"
    gptq = {k: v for k, v in {"asymmetric": args.asymmetric_calibration,
                              "forward_dtype": args.gptq_forward_dtype}.items() if v is not None}
    if changes or top or calib or args.alpha is not None or awq or gptq:
        data = recipe.to_dict()
        if "method" in top and args.recipe is None:  # the new method's own default scheme
            data["scheme"] = {**asdict(default_scheme(top["method"])), **changes}
        else:
            data["scheme"] = {**data["scheme"], **changes}
            if not METHODS[top.get("method", recipe.method)].hessian and args.act_order is None:
                data["scheme"].update(act_order=False, static_groups=False)  # GPTQ-only settings
        data.update(top)
        data["calibration"] = {**data["calibration"], **calib}
        if args.alpha is not None:
            data["smoothquant"] = {**data["smoothquant"], "alpha": args.alpha}
        if awq:
            data["awq"] = {**data["awq"], **awq}
        if gptq:
            data["gptq"] = {**data["gptq"], **gptq}
        recipe = type(recipe).from_dict(data)
        flags = {"asymmetric": "--asymmetric-calibration", "forward_dtype": "--gptq-forward-dtype"}
        for key, flag in flags.items():
            if gptq.get(key) and not METHODS[recipe.method].hessian:
                raise QuantspecError(f"{flag} is a GPTQ setting and --method {recipe.method} does not run GPTQ.",
                                     f"use --method gptq (or awq+gptq), or drop {flag}.")
        if changes or top:
            recipe = replace(recipe, name=default_recipe_name(recipe.method, recipe.scheme))
    return recipe


def run(args) -> int:
    from ..quant.pipeline import quantize

    recipe = recipe_from_args(args)
    compare = args.compare if args.compare is not None else args.model is None
    if compare:  # chosen (and a bad path refused) before the long work
        from ..data.fallback import load_or_fallback

        compare_data, _ = load_or_fallback(args.compare_data, "perplexity")
    outcome = quantize(
        args.model, recipe, args.out, overwrite=args.overwrite, device=args.device,
        resume=args.resume, progress=args.progress, streaming=args.streaming,
    )
    if not outcome.written:  # a data-parallel helper process (torchrun rank > 0)
        return 0
    rep = outcome.report
    n_q = sum(1 for v in rep["layers"].values() if v.get("status") == "quantized")
    n_experts = sum(1 for n, v in rep["layers"].items() if v.get("status") == "quantized" and ".experts." in n)
    fallback = sum(1 for v in rep["layers"].values() if v.get("fallback"))
    print(
        f"wrote {outcome.out}  ({recipe.name}: {recipe.method}, {recipe.format}, "
        f"{recipe.scheme.short_name}; {n_q} layers quantized"
        f"{f' ({n_experts} of them expert Linears)' if n_experts else ''}, {len(rep['dense_layers'])} dense, "
        f"{len(rep['regrouped_layers'])} regrouped{f', {fallback} rounded to nearest (see the report)' if fallback else ''}; "
        f"{rep['quantize_seconds']:.1f} s)"
    )
    summary = {
        "out": str(outcome.out),
        "recipe": recipe.to_dict(),
        "quantize_seconds": rep["quantize_seconds"],
        "load_seconds": rep["load_seconds"],
        "layers_quantized": n_q,
        "dense_layers": rep["dense_layers"],
        "regrouped_layers": rep["regrouped_layers"],
    }
    if compare:
        from ..eval.compare import compare_dense_quantized, format_table

        table = compare_dense_quantized(
            args.model, outcome.out, data=compare_data, windows=args.compare_windows,
            progress=args.progress,
        )
        print(format_table(table))
        summary["compare"] = table
    if args.json:
        write_json(args.json, summary)
    return 0


__all__ = ["add_parser", "run", "recipe_from_args"]
