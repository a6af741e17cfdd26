"""The serving report: latency against throughput per target (PNG and an interactive SVG page),
goodput at the stated SLOs, and the Pareto front of accuracy (perplexity through the server)
against goodput. Drawn from a serve-bench JSON only: nothing is measured here."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..eval.report_plot import pareto_front
from .table import serve_markdown, serve_rows

Y_AXES = {"ttft": "TTFT p50 (ms)", "tpot": "TPOT p50 (ms)", "e2e": "E2E latency p99 (ms)"}
_Y_KEY = {"ttft": ("ttft", "p50_ms"), "tpot": ("tpot", "p50_ms"), "e2e": ("e2e", "p99_ms")}
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


def curves(result: dict) -> list[dict]:
    """One curve per target: its measured levels (not partial) as points, by throughput."""
    out = []
    for t in result.get("targets", []):
        pts = []
        for lv in t.get("levels", []):
            if lv.get("partial") or not lv.get("completed"):
                continue
            pt = {"level": lv["level"], "x": lv["output_throughput"], "goodput": lv.get("goodput")}
            for k, (a, b) in _Y_KEY.items():
                pt[k] = lv[a][b]
            pts.append(pt)
        if pts:
            out.append({"label": t["label"], "points": sorted(pts, key=lambda p: p["x"]),
                        "ppl": (t.get("accuracy", {}).get("ppl") or {}).get("ppl")})
    return out


def accuracy_goodput(result: dict) -> list[dict]:
    """Per target with both: its best goodput over the levels and its perplexity, and whether
    it is on the Pareto front (higher goodput, lower perplexity)."""
    pts = [{"label": c["label"], "goodput": max(p["goodput"] for p in c["points"] if p["goodput"] is not None),
            "ppl": c["ppl"]}
           for c in curves(result) if c["ppl"] is not None and any(p["goodput"] is not None for p in c["points"])]
    front = set(pareto_front([(p["goodput"], p["ppl"]) for p in pts], x_higher=True, y_higher=False))
    for i, p in enumerate(pts):
        p["pareto"] = i in front
    return pts


def plot_serving(result: dict, path: str | Path) -> Path | None:
    """PNG: TTFT and TPOT against output tokens/s per target (and perplexity against goodput
    when both were measured); None (no file) when no level finished."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    cs = curves(result)
    if not cs:
        path.unlink(missing_ok=True)
        return None
    ag = accuracy_goodput(result)
    n = 3 if ag else 2
    fig = Figure(figsize=(5.2 * n, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, key in zip(axes, ("ttft", "tpot")):
        for i, c in enumerate(cs):
            xs, ys = [p["x"] for p in c["points"]], [p[key] for p in c["points"]]
            ax.plot(xs, ys, "o-", color=COLORS[i % len(COLORS)], label=c["label"], ms=4)
            for p in c["points"]:
                ax.annotate(p["level"].split("=")[-1], (p["x"], p[key]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(Y_AXES[key])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if ag:
        ax = axes[2]
        for i, p in enumerate(ag):
            ax.plot(p["goodput"], p["ppl"], "o", color=COLORS[i % len(COLORS)], ms=6 if p["pareto"] else 4)
            ax.annotate(p["label"], (p["goodput"], p["ppl"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = sorted((p for p in ag if p["pareto"]), key=lambda p: p["goodput"])
        ax.plot([p["goodput"] for p in front], [p["ppl"] for p in front], "--", color="#555", lw=1)
        ax.set_xlabel(f"goodput (req/s) at {result.get('config', {}).get('slo')}")
        ax.set_ylabel("perplexity through the server")
        ax.grid(alpha=0.3)
    eng = result.get("engine", {})
    fig.suptitle(f"{eng.get('name')} {eng.get('version') or ''}: latency against throughput per target", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _svg(cs: list[dict], key: str, w: int = 640, h: int = 380, pad: int = 50) -> str:
    xs = [p["x"] for c in cs for p in c["points"]]
    ys = [p[key] for c in cs for p in c["points"] if p[key] is not None]
    x0, x1 = 0.0, max(xs) * 1.08 or 1.0
    y0, y1 = 0.0, (max(ys) * 1.1 if ys else 1.0) or 1.0

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * (y - y0) / (y1 - y0)

    parts = [f'<svg class="chart" data-metric="{key}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'xmlns="http://www.w3.org/2000/svg" font-size="11">',
             f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#333"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#333"/>',
             f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">output tokens/s</text>',
             f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">'
             f'{html.escape(Y_AXES[key])}</text>']
    for f in (0.0, 0.5, 1.0):
        parts.append(f'<text x="{px(x0 + f * (x1 - x0)):.1f}" y="{h - pad + 14}" text-anchor="middle">'
                     f'{x0 + f * (x1 - x0):.0f}</text>')
        parts.append(f'<text x="{pad - 4}" y="{py(y0 + f * (y1 - y0)) + 4:.1f}" text-anchor="end">'
                     f'{y0 + f * (y1 - y0):.0f}</text>')
    for i, c in enumerate(cs):
        color = COLORS[i % len(COLORS)]
        pts = [p for p in c["points"] if p[key] is not None]
        path = " ".join(f"{px(p['x']):.1f},{py(p[key]):.1f}" for p in pts)
        parts.append(f'<g class="series" data-series="{i}"><polyline fill="none" stroke="{color}" points="{path}"/>')
        for p in pts:
            tip = (f"{c['label']} {p['level']}: {p['x']:.1f} tok/s, TTFT p50 {p['ttft']:.1f} ms, "
                   f"TPOT p50 {p['tpot'] if p['tpot'] is None else round(p['tpot'], 1)} ms"
                   + ("" if p["goodput"] is None else f", goodput {p['goodput']:.2f} req/s"))
            parts.append(f'<circle cx="{px(p["x"]):.1f}" cy="{py(p[key]):.1f}" r="4" fill="{color}">'
                         f'<title>{html.escape(tip)}</title></circle>')
        parts.append("</g>")
    return "".join(parts + ["</svg>"])


_JS = """document.querySelectorAll('.legend button').forEach(b => b.addEventListener('click', () => {
  b.classList.toggle('off');
  document.querySelectorAll('.series[data-series="' + b.dataset.series + '"]')
    .forEach(g => g.style.display = b.classList.contains('off') ? 'none' : '');
}));"""
_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1300px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}
td:first-child,td:nth-child(2){text-align:left}.legend button{margin:2px;border:1px solid #999;background:#fff;
cursor:pointer}.legend button.off{opacity:.35}.charts{display:flex;flex-wrap:wrap;gap:1em}
pre{background:#f7f7f7;padding:1em;font-size:12px;overflow-x:auto}"""


def _table_html(result: dict) -> str:
    head, rows = serve_rows(result)
    return ("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</table>")


def serving_html(result: dict) -> str:
    """A self-contained page: the table, interactive latency/throughput charts (hover a point for
    its figures, click a legend entry to hide a target), the accuracy/goodput Pareto table."""
    cs = curves(result)
    legend = "".join(f'<button data-series="{i}" style="color:{COLORS[i % len(COLORS)]}">{html.escape(c["label"])}'
                     f'</button>' for i, c in enumerate(cs))
    charts = "".join(_svg(cs, k) for k in ("ttft", "tpot", "e2e")) if cs else "<p>No level finished: no chart.</p>"
    ag = accuracy_goodput(result)
    pareto = ""
    if ag:
        pareto = ("<h2>Accuracy against goodput</h2><table><tr><th>target</th><th>best goodput req/s</th>"
                  "<th>ppl</th><th>Pareto</th></tr>" + "".join(
                      f"<tr><td>{html.escape(p['label'])}</td><td>{p['goodput']:.2f}</td><td>{p['ppl']:.3f}</td>"
                      f"<td>{'yes' if p['pareto'] else ''}</td></tr>" for p in ag) + "</table>")
    meta = {k: result.get(k) for k in ("command", "engine", "config", "machine", "dataset", "status")}
    return ("<!doctype html><html><head><meta charset='utf-8'><title>quantspec serve-bench</title>"
            f"<style>{_CSS}</style></head><body><h1>quantspec serve-bench</h1>"
            f"{_table_html(result)}<h2>Latency against throughput</h2>"
            f"<div class=legend>{legend}</div><div class=charts>{charts}</div>{pareto}"
            f"<h2>Run</h2><pre>{html.escape(json.dumps(meta, indent=2, default=str))}</pre>"
            f"<script>{_JS}</script></body></html>\n")


def serving_markdown(result: dict, png: str | None) -> str:
    lines = ["# quantspec serve-bench", "", serve_markdown(result), ""]
    ag = accuracy_goodput(result)
    if ag:
        lines += ["| target | best goodput req/s | ppl | Pareto |", "|---|---|---|---|"]
        lines += [f"| {p['label']} | {p['goodput']:.2f} | {p['ppl']:.3f} | {'yes' if p['pareto'] else ''} |" for p in ag]
        lines.append("")
    if png:
        lines += [f"![latency against throughput]({Path(png).name})", ""]
    if result.get("machine"):
        from ..eval.machine import machine_line

        cfg = result.get("config", {})
        reps = cfg.get("repeats", 1)
        how = ("targets measured one after another, each on a freshly started server" if reps == 1 else
               f"{reps} rounds, the targets in a new random order each round, each on a freshly started server; "
               "figures are medians over the rounds, request counts their sums")
        lines += [(f"Machine: {machine_line(result['machine'])}. Dataset: {result.get('dataset')}; "
                   f"{cfg.get('num_prompts')} requests per level, {how}."), ""]
    lines += [f"Command: `{result.get('command')}`", ""]
    return "\n".join(lines)


def write_serving_report(result: dict, out: str | Path) -> dict[str, Path]:
    """serve-report.md / .png / .html in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_serving(result, out / "serve-report.png")
    (out / "serve-report.md").write_text(serving_markdown(result, png and png.name))
    (out / "serve-report.html").write_text(serving_html(result))
    return {"md": out / "serve-report.md", "html": out / "serve-report.html", **({"png": png} if png else {})}


def load_serving(path: str | Path) -> dict[str, Any]:
    from ..errors import QuantspecError

    p = Path(path)
    try:
        r = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise QuantspecError(f"cannot read a serve-bench result from {p}: {exc}.", "pass a serve-bench JSON") from exc
    if r.get("kind") != "serve-bench":
        raise QuantspecError(f"{p} is not a serve-bench result.", "pass the JSON that quantspec serve-bench wrote")
    return r
