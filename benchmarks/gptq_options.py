"""Values of one GPTQ option (a ``gptq:`` recipe key: ``hessian_dtype``, ``asymmetric``, ...), side
by side on a validation split, with wikitext2 (the text of the published tables) beside it and
never used to choose.

Weight-only GPTQ with static act-order (quant_peers.py's protocol: float32 model, 64 C4 x 512
calibration, the same recipe, plan, method and block driver as ``quantspec quantize``) for each
config and calibration draw, the values interleaved per draw (the order alternating by draw);
perplexity of the fake-quantized model. Validation: the first windows of 512 of the C4
documents from 1800 on that none of the draws reads; test: wikitext2's first windows of 512.
Quantize seconds are the block driver's wall time at --threads (the machine otherwise idle).
Each row also records the Hessian and forward precisions its layers ran in (``auto`` resolves by
machine). The result files are rewritten after each row; ``--resume`` keeps the rows of a stopped
run of the same comparison on the same machine line and measures the rest.

    python benchmarks/gptq_options.py --option asymmetric --values false,true --model smollm2-135m --configs nvfp4,mxfp4
    python benchmarks/gptq_options.py --option asymmetric+forward_dtype --values false/float32,true/bfloat16 ...

Options joined by ``+`` are set together: each value then names one setting per option, joined by ``/``.
    python benchmarks/gptq_hessian_dtype.py --model smollm2-135m --configs nvfp4,mxfp4 --seeds 0,1,2   # hessian_dtype
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from peer_common import perplexity  # noqa: E402
from quant_peers import DATA, RESULTS  # noqa: E402

from quantspec.core.scheme import SCHEME_PRESETS, QuantScheme  # noqa: E402
from quantspec.data import calibration_samples, cached_token_ids, load_text  # noqa: E402
from quantspec.data.calibration import documents_outside_draw  # noqa: E402
from quantspec.data.tokens import encode_text  # noqa: E402
from quantspec.eval.machine import describe_machine, machine_line  # noqa: E402
from quantspec.eval.perplexity import window_starts  # noqa: E402
from quantspec.formats import get_format  # noqa: E402
from quantspec.models import load_dense, load_tokenizer  # noqa: E402
from quantspec.models.source import dense_folder  # noqa: E402
from quantspec.quant.arch_infer import get_arch  # noqa: E402
from quantspec.quant.calibrate import run_blockwise  # noqa: E402
from quantspec.quant.plan import make_plan  # noqa: E402
from quantspec.quant.recipe import Recipe  # noqa: E402
from quantspec.quant.registry import build_method  # noqa: E402

SAMPLES, SEQLEN, VAL_FIRST_DOC = 64, 512, 1800
C4 = DATA / "c4" / "c4-validation-2k.jsonl"


def _reported_alone(used: set, value) -> bool:
    return used == {value}


# whether the per-layer report's values of an option show that the run used the value given
REPORTED = {"hessian_dtype": _reported_alone, "forward_dtype": _reported_alone,
            "asymmetric": lambda used, value: ("on" in used) if value else not used}


# what each layer's report says it ran in, recorded per row whatever the comparison: ``auto``
# resolves by the machine (bf16 where native), so two machines can run one setting differently
PRECISIONS = ("hessian_dtype", "forward_dtype")


def layer_values(report: dict, key: str) -> set:
    """The values the layers of a per-layer ``report`` give ``key`` (layers without it left out)."""
    return {r[key] for r in report.values() if isinstance(r, dict) and key in r}


def precisions_used(report: dict) -> dict[str, list[str]]:
    """{key: the sorted values the layers of ``report`` name} for each key of PRECISIONS."""
    return {key: sorted(map(str, layer_values(report, key))) for key in PRECISIONS}


def parse_value(text: str):
    """A --values item as YAML would read it: true/false, a number, else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def windows_of(ids: torch.Tensor, n: int) -> torch.Tensor:
    starts = window_starts(ids.numel(), SEQLEN, SEQLEN, n)
    if len(starts) < n:
        raise SystemExit(f"the split holds {len(starts)} windows of {SEQLEN} tokens, not {n}")
    return torch.stack([ids[s : s + SEQLEN] for s in starts])


def load_data(model_dir: Path, seeds: list[int], windows: int) -> dict:
    tok = load_tokenizer(model_dir)
    docs = load_text(str(C4)).documents
    lengths = [encode_text(tok, d).numel() for d in docs]
    outside = set(range(VAL_FIRST_DOC, len(docs)))
    for seed in seeds:
        outside &= set(documents_outside_draw(lengths, SAMPLES, SEQLEN, seed))
    val_text = "\n\n".join(docs[i] for i in sorted(outside))
    wiki = cached_token_ids(tok, load_text(str(DATA / "wikitext2" / "wikitext-2-raw-v1.test.txt")))
    return {"calib": {s: calibration_samples(tok, str(C4), SAMPLES, SEQLEN, seed=s) for s in seeds},
            "val": windows_of(encode_text(tok, val_text), windows), "test": windows_of(wiki, windows),
            "val_docs": len(outside)}


def scheme_of(config: str) -> dict:
    """A float preset (nvfp4, mxfp4, ...) or an integer ``wNgM`` (symmetric, as gptq-w4g128), with
    static act-order."""
    m = re.fullmatch(r"w(\d)g(\d+|-1)", config)
    if config in SCHEME_PRESETS:
        base = SCHEME_PRESETS[config].to_dict()
    elif m:
        base = QuantScheme(bits=int(m[1]), group_size=int(m[2])).to_dict()
    else:
        raise SystemExit(f"unknown config {config!r}: use one of {sorted(SCHEME_PRESETS)} or wNgM (w4g128)")
    return {**base, "act_order": True, "static_groups": True}


def settings(option: str, value) -> dict:
    """The gptq keys of one compared value: ``option`` may join keys by "+", the value then holds
    one setting per key joined by "/" (``asymmetric+forward_dtype``, ``true/bfloat16``)."""
    keys = option.split("+")
    parts = [value] if len(keys) == 1 else [parse_value(v) for v in str(value).split("/")]
    if len(parts) != len(keys):
        raise SystemExit(f"value {value!r} does not hold one setting per option of {option!r} (join them by '/')")
    return dict(zip(keys, parts))


def measure(model_dir: Path, calib: torch.Tensor, data: dict, config: str, option: str, value,
            fixed: dict | None = None) -> dict:
    model, _, _ = load_dense(str(model_dir), dtype="float32")
    scheme = scheme_of(config)
    chosen = settings(option, value)
    recipe = Recipe.from_dict({"method": "gptq", "format": "compressed-tensors", "scheme": scheme,
                               "gptq": {**(fixed or {}), **chosen}})
    plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore)
    report: dict = {}
    t0 = time.perf_counter()
    run_blockwise(model, get_arch(model), calib, build_method(recipe), plan.quantize, progress=False, report=report)
    seconds = round(time.perf_counter() - t0, 1)
    for key, setting in chosen.items():
        if key in REPORTED:
            used = layer_values(report, key) - {None}
            if not REPORTED[key](used, setting):
                raise SystemExit(f"the report says {key} {used}, not {setting!r}")
    return {"val_ppl": perplexity(model, data["val"]), "test_ppl": perplexity(model, data["test"]), "seconds": seconds,
            "used": precisions_used(report)}


def write_md(path: Path, meta: dict, rows: list[dict]) -> None:
    option, values = meta["option"], meta["values"]
    held = ", ".join(f"{k} = {v}" for k, v in meta.get("fixed", {}).items())
    lines = [f"# GPTQ {option} = {' vs '.join(map(str, values))} ({meta['model']}{'; ' + held if held else ''})", "",
             f"Command: `{meta['command']}`; raw: {path.name[:-3]}.json; {meta['machine']}, "
             f"{meta['threads']} threads; {meta['when']}"
             + (f" (resumed {meta['resumed']} time(s) after a stop: each row is one whole measurement)" if meta.get("resumed") else "")
             + ".", "",
             "GPTQ weight-only, static act-order, float32 model, 64 C4 x 512 calibration per draw (the values "
             "interleaved within each draw). Validation: the first "
             f"{meta['windows']} windows of 512 of the C4 documents from {VAL_FIRST_DOC} on outside every draw "
             f"({meta['val_docs']} documents); test: wikitext2's first {meta['windows']} windows of 512, never used "
             "to choose. Medians over the draws (each draw's value in parentheses).", "",
             f"| config | gptq.{option} | C4 val ppl | wikitext2 ppl | quantize s |", "|---|---|---|---|---|"]
    for config in dict.fromkeys(r["config"] for r in rows):
        for value in values:
            sel = [r for r in rows if r["config"] == config and r["value"] == value]
            if not sel:
                continue

            def cell(k, fmt="{:.3f}"):
                vals = [r[k] for r in sel]
                return fmt.format(statistics.median(vals)) + " (" + ", ".join(fmt.format(v) for v in vals) + ")"
            lines.append(f"| {config} | {value} | {cell('val_ppl')} | {cell('test_ppl')} | {cell('seconds', '{:.1f}')} |")
    lines += precision_lines(rows)
    path.write_text("\n".join(lines) + "\n")


def precision_lines(rows: list[dict]) -> list[str]:
    """Under the table: which precision each draw's layers ran in, per key of PRECISIONS (rows of
    runs from before the record have none)."""
    out = []
    for key in PRECISIONS:
        seeds: dict[str, list] = {}
        for r in rows:
            if "used" in r:
                seeds.setdefault(" + ".join(r["used"][key]) or "-", []).append(r["seed"])
        if seeds:
            parts = [f"{v} (draw{'s' * (len(set(s)) > 1)} {', '.join(map(str, dict.fromkeys(s)))})" for v, s in seeds.items()]
            out.append(f"{key} as the layers ran it: {'; '.join(parts)}.")
    return ["", *out] if out else []


# the meta keys that must match for a resumed run's rows to stand beside the new ones
SAME_RUN = ("model", "command", "option", "values", "fixed", "machine", "threads", "windows", "val_docs")


def resume(path: Path, meta: dict) -> list[dict]:
    """The rows of an earlier run of the same comparison at ``path``; ``meta["when"]`` then names
    every day it ran on. Refuses a file of another comparison or machine."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    differ = [k for k in SAME_RUN if old["meta"].get(k) != meta[k]]
    if differ:
        raise SystemExit(f"{path} holds another run ({', '.join(differ)} differ): drop --resume or pick another --out")
    meta["when"] = ", ".join(dict.fromkeys(old["meta"]["when"].split(", ") + [meta["when"]]))
    meta["resumed"] = old["meta"].get("resumed", 0) + 1
    return old["rows"]


def main(argv: list[str] | None = None, script: str = "gptq_options.py", stem: str = "gptq-{option}") -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--option", required=True, help="a gptq recipe key (hessian_dtype, asymmetric, damp_percent, ...)")
    ap.add_argument("--values", required=True, help="comma list of its values, as in YAML (false,true; float32,bfloat16)")
    ap.add_argument("--model", default="smollm2-135m", help="alias or local HF folder")
    ap.add_argument("--configs", default="nvfp4,mxfp4", help="comma list of float presets (nvfp4, mxfp4, ...)")
    ap.add_argument("--seeds", default="0,1,2", help="calibration draws")
    ap.add_argument("--fixed", default="", help="other gptq keys held at one value in every run: KEY=VALUE,... "
                                                 "(asymmetric=true)")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None, help="result stem (default results/gptq-OPTION-MODEL)")
    ap.add_argument("--resume", action="store_true", help="keep the rows of the --out JSON of the same comparison "
                                                           "(same meta, same machine) and measure only the others")
    args = ap.parse_args(argv)
    values = [parse_value(v) for v in args.values.split(",")]
    fixed = {k: parse_value(v) for k, v in (item.split("=", 1) for item in args.fixed.split(",") if item)}
    if set(args.option.split("+")) & set(fixed):
        raise SystemExit(f"--fixed holds {args.option}, the option compared")
    for value in values:  # an unknown key or a bad value: now
        Recipe.from_dict({"method": "gptq", "gptq": {**fixed, **settings(args.option, value)}})
    torch.set_num_threads(args.threads)
    model_dir = dense_folder(args.model)
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    for c in configs:
        scheme_of(c)
    out = args.out or RESULTS / f"{stem.format(option=args.option.replace('_', '-').replace('+', '-'))}-{Path(str(model_dir)).name}"
    data = load_data(model_dir, seeds, args.windows)
    command = [a for a in sys.argv[1:] if a != "--resume"]  # what the user typed (a wrapper passes argv)
    meta = {"model": Path(str(model_dir)).name, "command": f"python benchmarks/{script} " + shlex.join(command),
            "option": args.option, "values": values, "fixed": fixed,
            "machine": machine_line(describe_machine()), "threads": args.threads, "windows": args.windows, "val_docs": data["val_docs"],
            "when": time.strftime("%Y-%m-%d")}
    rows = resume(Path(f"{out}.json"), meta) if args.resume else []
    done = {(r["seed"], r["config"], json.dumps(r["value"])) for r in rows}
    for seed in seeds:
        for config in configs:
            for value in (values if seed % 2 == 0 else values[::-1]):  # alternate which runs first
                if (seed, config, json.dumps(value)) in done:
                    continue
                row = {"config": config, "value": value, "seed": seed,
                       **measure(model_dir, data["calib"][seed], data, config, args.option, value, fixed)}
                print(json.dumps(row), flush=True)
                rows.append(row)
                # (not with_suffix: a model name like qwen2.5-coder-0.5b has a dot of its own)
                Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
                write_md(Path(f"{out}.md"), meta, rows)


if __name__ == "__main__":
    main()
