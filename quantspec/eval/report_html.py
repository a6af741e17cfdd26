"""report.html: one self-contained page (the PNG inlined as base64, the table, the protocol)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

from .machine import machine_line

_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.failed{color:#b00}
pre{background:#f7f7f7;padding:1em;overflow-x:auto;font-size:12px}"""


def _cell(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return html.escape(format(v, spec) if spec else str(v))


def table_html(rows: list[dict[str, Any]]) -> str:
    head = ["point", "method", "bits", "group", "format", "size MB", "ppl", "delta vs dense", "task acc",
            "tokens/s", "speed-up"]
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in rows:
        group = "-" if r["group"] is None else ("channel" if r["group"] == -1 else str(r["group"]))
        cells = [_cell(r["name"]), _cell(r["method"]), _cell(r["bits"]), group, _cell(r["format"])]
        if r["status"] != "ok":
            err = html.escape((r.get("error") or "")[:300])
            out.append("<tr class=failed>" + "".join(f"<td>{c}</td>" for c in cells)
                       + f"<td colspan=6 style='text-align:left'>FAILED: {err}</td></tr>")
            continue
        cells += [_cell(r["size_mb"], ".1f"), _cell(r["ppl"], ".3f"), _cell(r["ppl_delta"], "+.3f"),
                  _cell(r["acc"], ".3f"), _cell(r["tokens_per_s"], ".1f"),
                  "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"]
        out.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(out + ["</table>"])


def report_html(report: dict[str, Any], png: str | Path | None, notes: list[str] = ()) -> str:
    """The page; ``notes`` (plots left out, points a plot leaves off) follow the plot."""
    img = ""
    if png is not None and Path(png).is_file():
        data = base64.b64encode(Path(png).read_bytes()).decode("ascii")
        img = (f'<img id="report-plot" alt="quality vs speed and size" style="max-width:100%" '
               f'src="data:image/png;base64,{data}">')
    if notes:
        img += "<ul class=notes>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>"
    meta = {k: report.get(k) for k in ("machine", "versions", "protocol")}  # versions may be absent
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>quantspec sweep: {html.escape(str(report['model']))}</title><style>{_CSS}</style></head><body>"
        f"<h1>quantspec sweep: {html.escape(str(report['model']))}</h1>"
        f"<p>{html.escape(machine_line(report['machine']))} &middot; {html.escape(report['created'])}</p>"
        f"{table_html(report['rows'])}\n{img}"
        f"<h2>Machine, versions and protocol</h2><pre>{html.escape(json.dumps(meta, indent=2, default=str))}</pre>"
        "</body></html>\n"
    )
