"""``quantspec report DIR``: redraw a sweep's report.md/.png/.html from its report.json."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="redraw report.md/.png/.html from a sweep's report.json, or serve-report.* from a serve-bench "
             "JSON (nothing is measured)",
        description="Reads DIR/report.json (or the given JSON file) and writes the other report files beside it.",
    )
    p.add_argument("report", type=Path, help="a sweep's output folder or its report.json, or a serve-bench "
                   "JSON (or its folder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.report import load_report, render_report

    serve_json = args.report / "serve-bench.json" if args.report.is_dir() else args.report
    if serve_json.is_file() and not (args.report.is_dir() and (args.report / "report.json").is_file()):
        from ..serving.report import load_serving, write_serving_report

        try:
            kind = json.loads(serve_json.read_text()).get("kind")
        except (OSError, ValueError):
            kind = None
        if kind == "serve-bench":
            files = write_serving_report(load_serving(serve_json), serve_json.parent)
            print("wrote " + ", ".join(str(p) for p in files.values()))
            return 0

    report = load_report(args.report)
    out = args.report if args.report.is_dir() else args.report.parent
    png = render_report(report, out)
    print(f"wrote {out}/report.md, report.html" + (", report.png" if png else " (no plot: no point to draw)"))
    return 0
