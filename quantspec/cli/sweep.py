"""``quantspec sweep [SWEEP.yaml] --out DIR``: quantize + evaluate a grid of recipes, write a report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="run a grid of recipes (quantize, eval, bench) and write report.json/.md/.png/.html",
        description="Each point runs as quantspec subprocesses; rerunning skips finished points.",
    )
    p.add_argument("sweep", nargs="?", default=None, help="sweep YAML (default: recipes/sweep-default.yaml)")
    p.add_argument("--out", type=Path, default=Path("quantspec-sweep"), help="output folder (default: ./quantspec-sweep)")
    p.add_argument("--model", help="override the sweep's model")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="print progress to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..eval.report import markdown_table
    from ..eval.sweep import SweepConfig, default_sweep_path, run_sweep

    cfg = SweepConfig.from_yaml(args.sweep or default_sweep_path())
    if args.model:
        cfg = replace(cfg, model=args.model)
    say = (lambda m: print(f"[sweep] {m}", file=sys.stderr, flush=True)) if args.progress else None
    report = run_sweep(cfg, args.out, progress=say)
    print(markdown_table(report["rows"]))
    print(f"wrote {args.out}/report.json, report.md, report.png, report.html")
    return 0 if all(r["status"] == "ok" for r in report["rows"]) else 1
