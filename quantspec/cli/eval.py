"""``quantspec eval MODEL_OR_DIR``: perplexity (fixed protocol), lm-eval tasks, speed."""

from __future__ import annotations

import argparse

from ._common import write_json


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity / lm-eval tasks / speed of a model or checkpoint")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder, model id, folder or .gguf (default: smollm2-135m)")
    p.add_argument("--ppl", action="append", default=None, metavar="DATA",
                   help="wikitext2, c4, pydoc or a .txt/.jsonl path (repeatable; default wikitext2 unless --tasks/--speed)")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--windows", type=int, default=40, help="first N windows (0 = all)")
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--tasks", help="comma-separated lm-eval tasks (needs quantspec[lm-eval])")
    p.add_argument("--tasks-path", "--include-path", dest="tasks_path", help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, help="lm-eval: examples per task")
    p.add_argument("--speed", action="store_true", help="also measure speed against the dense baseline")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="exact",
                   help="kernel backend of quantized layers for perplexity and tasks. exact (default): the "
                        "fastest that computes the checkpoint's declared scheme (on CPU, weight-only layers "
                        "run on the reference backend); auto: the fastest (on CPU: rounded activations for "
                        "weight-only layers, a speed option that moves accuracy); or reference, cpu, triton. "
                        "--speed always times the fastest")
    p.add_argument("--kv-cache", choices=["checkpoint", "off", "fp8", "int8"], default="checkpoint",
                   help="the KV cache attention reads in --ppl: the checkpoint's (its calibrated scales; "
                        "unquantized without), off, or fp8/int8 with --kv-scales")
    p.add_argument("--kv-scales", choices=["calibrated", "unit", "dynamic"], default="calibrated",
                   help="calibrated (the checkpoint's k_scale/v_scale), unit (1.0, an engine's default "
                        "without them) or dynamic (each cache write's own amax)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", help="write the results as JSON")
    p.set_defaults(func=run)


def _size_bytes(spec: str, model) -> int:
    """A quantized checkpoint's bytes on disk; a dense model's bytes as a 16-bit checkpoint."""
    from pathlib import Path

    from ..checkpoint.load import is_quantized_folder
    from ..checkpoint.save import folder_size_bytes
    from ..eval.compare import dense_size_bytes

    if Path(spec).is_dir() and is_quantized_folder(Path(spec)):
        return folder_size_bytes(Path(spec))
    return dense_size_bytes(model)


def check_flags(args) -> None:
    """Refuse flags that would do nothing in this run, or out of range, before any model loads."""
    from ..errors import QuantspecError

    if args.tasks is not None and not [t for t in args.tasks.split(",") if t.strip()]:
        raise QuantspecError(f"--tasks {args.tasks!r} names no task.", "pass task names, e.g. --tasks arc_easy.")
    if not args.tasks and (args.limit is not None or args.tasks_path):
        flag = "--limit" if args.limit is not None else "--tasks-path"
        raise QuantspecError(f"{flag} applies to lm-eval tasks, and no --tasks was given.", f"add --tasks, or drop {flag}.")
    if args.limit is not None and args.limit < 1:
        raise QuantspecError(f"--limit {args.limit} is not positive.", "pass 1 or more examples per task, or drop --limit.")


def run(args) -> int:
    from ..eval.perplexity import perplexity

    check_flags(args)
    out: dict = {"model": args.model}
    datas = args.ppl if args.ppl is not None else ([] if (args.tasks or args.speed) else ["wikitext2"])
    if datas:
        from ..models.load import load_model, model_label

        model, tok, desc = load_model(args.model, args.dtype, args.device, args.backend)
        out["model"] = label = model_label(desc)
        out["size_mb"] = round(_size_bytes(args.model, model) / 2**20, 3)
        out["ppl"] = {}
        for data in datas:
            r = perplexity(
                model, tok, data, seqlen=args.seqlen, windows=args.windows or None,
                stride=args.stride, progress=args.progress, kv_cache=args.kv_cache, kv_scales=args.kv_scales,
            )
            out["ppl"][data] = r["ppl"]
            out.update({"seqlen": r["seqlen"], "windows": r["windows"], "tokens": r["tokens"],
                        "kernels": r["kernels"], "kv_cache": r["kv_cache"]})
            out.setdefault("ppl_details", {})[data] = r
            print(
                f"{label}: ppl {r['ppl']:.3f} on {r['data']} "
                f"(seqlen {r['seqlen']}, {r['windows']} windows, {r['tokens']} tokens; "
                f"backend {r['kernels']['backend']}, activations {r['kernels']['activations']}"
                f"{'' if r['kv_cache'] is None else ', KV cache ' + r['kv_cache']['kind'] + ' ' + r['kv_cache']['scales']})"
            )
        del model
    if args.tasks:
        from ..eval.lmeval_adapter import run_lm_eval

        res = run_lm_eval(
            args.model, [t for t in args.tasks.split(",") if t], limit=args.limit,
            include_path=args.tasks_path, device=args.device, backend=args.backend,
        )
        out["tasks"] = res
        print(res)
    if args.speed:
        from ..eval.speed import speed_report

        out["speed"] = speed_report(args.model, device=args.device)
    if args.json:
        write_json(args.json, out)
    return 0
