"""``quantspec report DIR``: redraw a sweep's report.md/.png/.html from its report.json."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "report",
        help="redraw report.md/.png/.html from a sweep's report.json (nothing is measured)",
        description="Reads DIR/report.json (or the given JSON file) and writes the other report files beside it.",
    )
    p.add_argument("report", type=Path, help="a sweep's output folder or its report.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..eval.report import load_report, render_report

    report = load_report(args.report)
    out = args.report if args.report.is_dir() else args.report.parent
    png = render_report(report, out)
    print(f"wrote {out}/report.md, report.html" + (", report.png" if png else " (no plot: no point to draw)"))
    return 0
