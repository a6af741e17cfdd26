"""KV-cache scale rule on a validation split: ``amax`` (the observed max on the top code) against
``mse`` (the multiple of that scale with the least squared error of the observed keys / values),
per tensor and per KV head, FP8 and int8 (docs/decisions/kv-scale-rule.md).

The float model (fp32, weights unquantized: the KV cache is the only quantization) is observed on
the protocol's calibration draw (C4 64 x 512, seed 0; the first ``--samples`` of it, as
``quantize --kv-cache`` does) through quantspec's own calibration functions (``observe_kv``,
``observe_errors``, ``kv_scales``); perplexity with each setting on the validation split (C4
documents 1800-1999 outside the draw, awq_tune_defaults.py's) and, beside it and not used to
choose, wikitext2 (test, the text of the published tables).

    python benchmarks/kv_scale_rule.py --model qwen2.5-coder-0.5b [--kinds fp8,int8] [--windows 20]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from awq_tune_defaults import load_data  # noqa: E402
from peer_common import perplexity  # noqa: E402
from quant_peers import RESULTS  # noqa: E402

from quantspec.core.kv_config import KVCacheConfig  # noqa: E402
from quantspec.models.source import dense_folder, load_dense  # noqa: E402
from quantspec.quant.kv_calibrate import error_bases, kv_scales, observe_errors, observe_kv  # noqa: E402
from quantspec.runtime.kv import cache_kwarg  # noqa: E402
from quantspec.runtime.kv_quant import KVSetting, QuantKVCache  # noqa: E402


def ppl(model, windows: torch.Tensor, kv: tuple | None) -> float:
    """Perplexity with attention reading a KV cache rounded by ``kv`` (KVSetting, scales), or a plain one."""
    kw = cache_kwarg(model)
    return perplexity(model, windows, None if kv is None else
                      lambda: {kw: QuantKVCache(*kv, config=model.config), "use_cache": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--kinds", default="fp8,int8")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--samples", type=int, default=KVCacheConfig().samples)
    ap.add_argument("--search-samples", default="",
                    help="comma-separated: also the mse rule with its error pass over only the first N samples "
                         "(rows 'mse@N'; the maxima still come from all --samples)")
    ap.add_argument("--out", type=Path, default=RESULTS / "kv-scale-rule")
    args = ap.parse_args()
    folder = dense_folder(args.model)
    model, _, _ = load_dense(str(folder), dtype="float32")
    data = load_data(folder, args.windows)
    calib, splits = data["calib"][: args.samples], {"val": data["val"], "wikitext2": data["test"]}
    searches = [int(n) for n in args.search_samples.split(",") if n.strip()]
    t0 = time.perf_counter()
    amax = observe_kv(model, calib)
    rows = [{"kind": "none", "strategy": "-", "rule": "-", **{s: round(ppl(model, w, None), 4) for s, w in splits.items()}}]
    print(rows[-1], flush=True)
    for kind in args.kinds.split(","):
        rows.append({"kind": kind, "strategy": "-", "rule": "dynamic",
                     **{s: round(ppl(model, w, (KVSetting(kind, "dynamic"), None)), 4) for s, w in splits.items()}})
        print(rows[-1], flush=True)
        for strategy in ("tensor", "head"):
            bases = error_bases(amax, strategy)
            errors = {None: observe_errors(model, calib, bases, kind)}
            for n in searches:
                errors[n] = observe_errors(model, calib[:n], bases, kind)
            for rule, n in [("amax", None), ("mse", None)] + [("mse", n) for n in searches]:
                cfg = KVCacheConfig(kind, strategy, args.samples, rule)
                scales = {i: (k.reshape(-1), v.reshape(-1)) for i, (k, v) in kv_scales(amax, cfg, errors[n]).items()}
                kv = (KVSetting(kind, "calibrated"), scales)
                rows.append({"kind": kind, "strategy": strategy, "rule": rule if n is None else f"{rule}@{n}",
                             **{s: round(ppl(model, w, kv), 4) for s, w in splits.items()}})
                print(rows[-1], flush=True)
    meta = {"model": args.model, "weights": "float32, unquantized", "calibration": f"c4 64 x 512 seed 0, first {args.samples}",
            "val": f"C4 documents 1800-1999 outside the draw, {args.windows} x 512",
            "wikitext2": f"test, first {args.windows} x 512 (not used to choose)", "seconds": round(time.perf_counter() - t0, 1),
            "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "command": shlex.join(["python", *sys.argv])}
    path = args.out.with_suffix(".json")
    runs = json.loads(path.read_text()) if path.exists() else {}
    key = args.model + (f" search {args.search_samples}" if searches else "")
    runs[key] = {"meta": meta, "rows": rows}  # one entry per model (and search list): a rerun replaces its own
    path.write_text(json.dumps(runs, indent=1) + "\n")
    lines = ["# KV-cache scale rule: amax vs mse on the validation split", "",
             "Perplexity, lower is better; `val` chooses, wikitext2 beside it. Raw rows: `kv-scale-rule.json`.", ""]
    for name, run in runs.items():
        m = run["meta"]
        lines += [f"## {name} ({m['weights']}; calibration {m['calibration']}; {m['date']}, {m['machine']})", "",
                  f"Command: `{m['command']}`", "", "| KV cache | strategy | rule | val | wikitext2 |", "|---|---|---|---:|---:|"]
        lines += [f"| {r['kind']} | {r['strategy']} | {r['rule']} | {r['val']:.4f} | {r['wikitext2']:.4f} |" for r in run["rows"]]
        lines.append("")
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
