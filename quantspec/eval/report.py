"""The sweep report: every number in report.json, one table in report.md, the plots in
report.png, and all of it in one self-contained report.html.

Table columns: method, bits, group, format, size MB, ppl (first ppl data set), delta vs dense,
task accuracy (mean of the tasks' ``acc``), decode tokens/s (batch = first bench batch size)
and speed-up (tokens/s over the dense model's, both measured in the same bench run).
:func:`render_report` redraws report.md/.png/.html from a saved report.json without measuring
anything (``quantspec report DIR``); a plot with no point is left out and the text says why.
A report.json is checked field by field before anything is drawn (:func:`check_report`), and the
files are drawn into a temporary folder and moved into place together: never a partial set.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import QuantspecError, one_line
from .machine import describe_machine, machine_line

COLUMNS = ("name", "method", "bits", "group", "format", "size_mb", "ppl", "ppl_delta", "acc",
           "tokens_per_s", "speedup", "status")


def _first(d: dict | None) -> Any:
    return next(iter(d.values())) if d else None


def _ppl(rec: dict) -> float | None:
    ev = rec.get("eval") or {}
    return _first(ev.get("ppl"))


def _acc(rec: dict) -> float | None:
    tasks = rec.get("tasks") or {}
    accs = [m.get("acc", m.get("acc_norm")) for m in tasks.values()]
    accs = [a for a in accs if isinstance(a, (int, float))]
    return statistics.mean(accs) if accs else None


def _speed(rec: dict) -> tuple[float | None, float | None, float | None]:
    """(tokens/s, speed-up vs dense, size MB as measured by the bench)."""
    bench = rec.get("bench")
    if not bench:
        return None, None, None
    m = bench["model"]
    batch = next(iter(m["decode"]))
    tps = m["decode"][batch]["tokens_per_s"]
    if bench.get("speedup"):
        sp = bench["speedup"]["decode"].get(batch)
    else:
        sp = 1.0 if m.get("kind") == "dense" else None
    return tps, sp, m.get("disk_mb") if m.get("kind") == "quantized" else m.get("weights_mb")


def report_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One flat row per point (failed points keep their error)."""
    dense = next((r for r in records if r["name"] == "dense" and r["status"] == "ok"), None)
    dense_ppl = _ppl(dense) if dense else None
    rows = []
    for rec in records:
        p = rec["point"]
        dense_point = p["method"] is None
        row = {"name": rec["name"], "method": p["method"] or "dense", "bits": None if dense_point else p["bits"],
               "group": None if dense_point else p["group_size"], "format": p["format"] or "-",
               "status": rec["status"]}
        if rec["status"] != "ok":
            rows.append({**row, "error": rec.get("error")})
            continue
        tps, sp, bench_size = _speed(rec)
        ppl = _ppl(rec)
        row.update(size_mb=rec.get("size_mb") or bench_size, ppl=ppl, acc=_acc(rec), tokens_per_s=tps, speedup=sp,
                   ppl_delta=None if ppl is None or dense_ppl is None else ppl - dense_ppl)
        rows.append(row)
    return rows


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["point", "method", "bits", "group", "format", "size MB", "ppl", "delta vs dense", "task acc",
            "tokens/s", "speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        group = "-" if r["group"] is None else ("channel" if r["group"] == -1 else str(r["group"]))
        if r["status"] != "ok":
            err = (r.get("error") or "").splitlines()[0][:80].replace("|", "/")
            lines.append(f"| {r['name']} | {r['method']} | {_fmt(r['bits'], 'd')} | {group} | {r['format']} | "
                         f"FAILED: {err} | | | | | |")
            continue
        delta = "-" if r["ppl_delta"] is None else f"{r['ppl_delta']:+.3f}"
        lines.append(
            f"| {r['name']} | {r['method']} | {_fmt(r['bits'], 'd')} | {group} | {r['format']} | {_fmt(r['size_mb'], '.1f')} | "
            f"{_fmt(r['ppl'], '.3f')} | {delta} | {_fmt(r['acc'], '.3f')} | {_fmt(r['tokens_per_s'], '.1f')} | "
            f"{'-' if r['speedup'] is None else format(r['speedup'], '.2f') + 'x'} |"
        )
    return "\n".join(lines)


def protocol(cfg_dict: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    ev, sp = cfg_dict["eval"], cfg_dict["speed"]
    bench = next((r.get("bench") for r in records if r.get("bench")), None)
    return {
        "perplexity": f"data {list(ev['ppl'])}, non-overlapping windows of {ev['seqlen']} tokens, first "
                      f"{ev['windows']} windows, ppl = exp(mean NLL over predicted tokens)",
        "tasks": {"names": list(ev["tasks"]), "limit": ev["limit"], "metric": "mean acc over tasks"},
        "speed": {"settings": sp, "bench": bench.get("protocol") if bench else None,
                  "speedup": "decode tokens/s over the dense model's, measured in the same bench run"},
        "size": "quantized: bytes of the checkpoint folder; dense: its weights as a 16-bit checkpoint (MiB)",
        "dtype": cfg_dict["dtype"],
    }


def build_report(cfg, records: list[dict[str, Any]], serving: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg_dict = cfg.to_dict()
    bench = next((r["bench"] for r in records if r.get("bench")), None)
    machine = bench["machine"] if bench else describe_machine()
    return {
        "created": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "model": cfg_dict["model"],
        "machine": machine,
        "versions": machine.get("versions"),
        "protocol": protocol(cfg_dict, records),
        "sweep": cfg_dict,
        "rows": report_rows(records),
        "points": records,
        **({"serving": serving} if serving else {}),
    }


def plot_why(report: dict[str, Any]) -> dict[str, str]:
    """The cause of a panel's missing data, where the sweep's settings tell it."""
    ev = (report.get("sweep") or {}).get("eval") or {}
    return {"tokens_per_s": "speed was not measured: the sweep ran with eval.speed = false"} if ev.get("speed") is False else {}


def report_markdown(report: dict[str, Any], png: str | Path | None = "report.png", notes: list[str] = ()) -> str:
    """report.md: the table, the machine, the protocol, the plot (when drawn) and ``notes`` on it."""
    ok = sum(r["status"] == "ok" for r in report["rows"])
    pr = report["protocol"]
    v = report.get("versions") or {}
    timed = any(r.get("tokens_per_s") is not None for r in report["rows"])
    lines = [
        f"# quantspec sweep: {report['model']}",
        "",
        markdown_table(report["rows"]),
        "",
        f"{ok}/{len(report['rows'])} points ok. Machine: {machine_line(report['machine'])}. "
        f"torch {v.get('torch')}, transformers {v.get('transformers')}, quantspec {v.get('quantspec')}.",
        "",
        f"- Perplexity: {pr['perplexity']}.",
        f"- Speed: {pr['speed']['speedup']}; settings {pr['speed']['settings']}." if timed else "- Speed: not measured.",
        f"- Size: {pr['size']}.",
        "",
    ]
    if png is not None:
        lines += [f"![quality vs speed and size]({Path(png).name})", ""]
    lines += [f"- {n}" for n in notes]
    lines += ["", "report.md, report.png and report.html are drawn from report.json: `quantspec report DIR` redraws them."]
    return "\n".join(lines).rstrip("\n") + "\n"


REPORT_FILES = ("report.md", "report.png", "report.html")
SERVING_FILES = ("serve-report.md", "serve-report.png", "serve-report.html")


def _draw(report: dict[str, Any], out: Path) -> Path | None:
    """Write report.md, report.png and report.html (and the serving report) into ``out``; return
    the PNG path, None when no plot has a point."""
    from .report_html import report_html
    from .report_plot import plot_notes, plot_report

    notes = plot_notes(report["rows"], plot_why(report))
    png = plot_report(report["rows"], out / "report.png", title=f"{report['model']} on {machine_line(report['machine'])}")
    md, page = report_markdown(report, png, notes), report_html(report, png, notes)
    if report.get("serving"):  # the serving stage: its own report files, linked and summarised here
        from ..serving.report import serving_markdown, write_serving_report

        files = write_serving_report(report["serving"], out)
        md += "\n## Serving\n\n" + serving_markdown(report["serving"], files.get("png") and files["png"].name)
        page = page.replace("</body>", '<h2>Serving</h2><p><a href="serve-report.html">serving report: latency '
                            'against throughput, goodput, accuracy against goodput</a></p></body>')
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(page)
    return png


def render_report(report: dict[str, Any], out: str | Path) -> Path | None:
    """Write report.md, report.png and report.html into ``out`` from a report (as saved in
    report.json: nothing is measured); return the PNG path, None when no plot has a point.

    The report is checked first (``check_report``), every file is drawn into a temporary folder
    in ``out``, and moved into place only when all of them are drawn: a failure leaves the files
    of the previous render as they were, never a new picture beside an old table."""
    check_report(report)
    out = Path(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    except OSError as exc:
        raise QuantspecError(f"cannot write the report files into {out} ({exc.strerror or type(exc).__name__}).",
                             "make the folder writable, or copy report.json into a writable folder and pass that.") from None
    try:
        png = _draw(report, tmp)
        owned = REPORT_FILES + (SERVING_FILES if report.get("serving") else ())
        for name in owned:  # drawn: replaces the previous file; not drawn (no picture): the previous one goes
            if (tmp / name).is_file():
                os.replace(tmp / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return None if png is None else out / png.name


# ---------------------------------------------------------------- what report.json must hold

# field -> the types it may hold (``strict.admits``). Rows: every row has ROW_FIELDS, an ok row
# OK_ROW_FIELDS (None where not measured), a failed one may carry its "error".
REPORT_FIELDS = {"model": str, "created": str, "machine": dict, "protocol": dict, "rows": list}
OPTIONAL_REPORT_FIELDS = {"versions": dict | None, "sweep": dict | None, "serving": dict | None}
PROTOCOL_FIELDS = {"perplexity": str, "size": str, "speed": dict}
MACHINE_FIELDS = {"gpus": tuple[str, ...] | None, "cpu_isa": str | None}  # optional: what machine_line reads
ROW_FIELDS = {"name": str, "method": str, "bits": int | None, "group": int | None, "format": str, "status": str}
OK_ROW_FIELDS = {k: float | None for k in ("size_mb", "ppl", "ppl_delta", "acc", "tokens_per_s", "speedup")}


def _check_fields(obj: dict[str, Any], spec: dict[str, Any], where: str, required: bool = True) -> None:
    """QuantspecError naming ``where + field`` for the first field of ``spec`` that ``obj`` lacks
    (when ``required``) or holds with a type ``spec`` does not allow."""
    from ..strict import admits, describe

    for key, tp in spec.items():
        if key not in obj:
            if required:
                raise QuantspecError(f"report.json {where}{key} is missing.", _REPORT_FIX)
            continue
        if not admits(tp, obj[key]):
            raise QuantspecError(f"report.json {where}{key} must be {describe(tp)}, got {one_line(repr(obj[key]), 60)}.",
                                 _REPORT_FIX)


_REPORT_FIX = ("restore the field as quantspec sweep wrote it (rerunning the sweep into the same folder rewrites "
               "report.json, reusing every finished point).")


def check_report(report: Any) -> None:
    """QuantspecError naming the first field of a report (as read from report.json) that rendering
    would trip on: missing, or of the wrong type."""
    if not isinstance(report, dict):
        raise QuantspecError(f"report.json must hold a mapping, not {type(report).__name__}.", _REPORT_FIX)
    _check_fields(report, REPORT_FIELDS, "")
    _check_fields(report, OPTIONAL_REPORT_FIELDS, "", required=False)
    _check_fields(report["machine"], MACHINE_FIELDS, "machine.", required=False)
    _check_fields(report["protocol"], PROTOCOL_FIELDS, "protocol.")
    _check_fields(report["protocol"]["speed"], {"speedup": str}, "protocol.speed.")
    _check_fields(report.get("sweep") or {}, {"eval": dict | None}, "sweep.", required=False)
    for i, row in enumerate(report["rows"]):
        if not isinstance(row, dict):
            raise QuantspecError(f"report.json rows[{i}] must be a mapping, got {one_line(repr(row), 60)}.", _REPORT_FIX)
        _check_fields(row, ROW_FIELDS, f"rows[{i}].")
        if row["status"] == "ok":
            _check_fields(row, OK_ROW_FIELDS, f"rows[{i}].")
        else:
            _check_fields(row, {"error": str | None}, f"rows[{i}].", required=False)


def load_report(path: str | Path) -> dict[str, Any]:
    """A saved report.json (or the folder holding one), checked to have what rendering reads
    (``check_report``: a hand-edited file fails here, naming the field, before anything is written)."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        report = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise QuantspecError(f"cannot read a report from {p}: {exc}.", "pass a sweep's report.json or its folder.")
    lacks = [k for k in ("model", "machine", "protocol", "rows", "created") if k not in report] \
        if isinstance(report, dict) else ["mapping at the top"]
    if lacks:
        raise QuantspecError(f"{p} is not a sweep report: it has no {', '.join(lacks)}.",
                             "pass the report.json that quantspec sweep wrote.")
    check_report(report)
    return report


def write_report(cfg, records: list[dict[str, Any]], out: str | Path, serving: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write report.json, report.md, report.png and report.html into ``out`` (and the serving
    report when the sweep served its points); return the report."""
    out = Path(out)
    text = json.dumps(build_report(cfg, records, serving), indent=2, default=str) + "\n"
    (out / "report.json").write_text(text)
    report = json.loads(text)  # drawn from what was saved, as `quantspec report` redraws it
    render_report(report, out)
    return report
