"""report.png: quality against decode speed and against size, Pareto front marked, dense as the
reference point (matplotlib, Agg backend chosen per figure, no global state touched).

A panel with no point to draw is left out (:func:`plot_notes` says why, for the report's text),
and no PNG is written when no panel has a point; labels never overlap (see report_labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .report_labels import PointLabel, add_key, place_labels

TOP_IN = 0.75  # inches kept above the panels for the title and the legend
PANEL_W_IN, PANEL_H_IN = 6.0, 5.0
DENSE_S, POINT_S = 160, 60  # marker areas (points^2)


@dataclass(frozen=True)
class Panel:
    """One scatter: quality (y) against ``xkey``; ``rows`` have both values, ``missing`` names the
    ok rows left off it with the value(s) they lack."""

    xkey: str
    xlabel: str
    x_higher: bool
    title: str
    rows: tuple[dict[str, Any], ...]
    missing: tuple[tuple[str, str], ...]


PANELS = (  # xkey, axis label, higher is better, title, what a row lacks without it
    ("tokens_per_s", "decode tokens/s (batch 1)", True, "quality vs decode speed", "decode tokens/s"),
    ("size_mb", "weights size (MB)", False, "quality vs size", "size"),
)


def quality_axis(rows: list[dict[str, Any]]) -> tuple[str, str, bool]:
    """(row key, axis label, higher is better): task accuracy when measured, else perplexity."""
    if any(r.get("acc") is not None for r in rows):
        return "acc", "task accuracy (higher is better)", True
    return "ppl", "perplexity (lower is better)", False


def pareto_front(points: list[tuple[float, float]], x_higher: bool, y_higher: bool) -> list[int]:
    """Indices of the points no other point beats on both axes, sorted by x."""
    def better_eq(a, b, higher):
        return a >= b if higher else a <= b

    front = []
    for i, (xi, yi) in enumerate(points):
        dominated = any(
            better_eq(xj, xi, x_higher) and better_eq(yj, yi, y_higher) and (xj, yj) != (xi, yi)
            for j, (xj, yj) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plan_panels(rows: list[dict[str, Any]]) -> list[Panel]:
    """Every panel with the ok rows it can draw and those it cannot (empty ones included)."""
    ok = [r for r in rows if r.get("status") == "ok"]
    ykey, _, _ = quality_axis(ok)
    quality = "task accuracy" if ykey == "acc" else "perplexity"
    panels = []
    for xkey, xlabel, x_higher, title, what in PANELS:
        drawn, missing = [], []
        for r in ok:
            lacks = [w for k, w in ((xkey, what), (ykey, quality)) if r.get(k) is None]
            if lacks:
                missing.append((r["name"], " or ".join(lacks)))
            else:
                drawn.append(r)
        panels.append(Panel(xkey, xlabel, x_higher, title, tuple(drawn), tuple(missing)))
    return panels


def plot_notes(rows: list[dict[str, Any]], why: dict[str, str] | None = None) -> list[str]:
    """Sentences for the report's text: each panel left out and each point a panel leaves off.
    ``why`` maps a panel's xkey to the cause of its missing data (e.g. speed not measured)."""
    notes = []
    for p in plan_panels(rows):
        cause = f" ({why[p.xkey]})" if why and p.xkey in why else ""
        if not p.rows:
            lacks = sorted({m for _, m in p.missing}) or ["an ok point"]
            notes.append(f"The {p.title} plot is left out: no point has {' or '.join(lacks)}{cause}.")
        elif p.missing:
            names = ", ".join(f"{n} (no {m})" for n, m in p.missing)
            notes.append(f"Not in the {p.title} plot: {names}.")
    return notes


def _log_if_wide(ax, ys: list[float], y_higher: bool) -> None:
    if y_higher or min(ys) <= 0 or max(ys) / min(ys) <= 3:
        return
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")  # perplexities that span a wide range
    plain = FuncFormatter(lambda v, _pos: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)


def _draw_panel(ax, p: Panel, ykey: str, ylabel: str, y_higher: bool) -> set[str]:
    """Scatter one panel; return which legend entries it used."""
    ax.set_title(p.title)
    ax.set_xlabel(p.xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, which="both")
    xy = [(r[p.xkey], r[ykey]) for r in p.rows]
    front = set(pareto_front(xy, p.x_higher, y_higher))
    used = set()
    for i, r in enumerate(p.rows):
        kind = "dense" if r["method"] == "dense" else ("front" if i in front else "dominated")
        used.add(kind)
        ax.scatter(*xy[i], s=DENSE_S if kind == "dense" else POINT_S, marker="*" if kind == "dense" else "o",
                   color=_STYLE[kind][1], zorder=3, edgecolors="white", linewidths=0.8)
        if kind == "dense":
            ax.axhline(xy[i][1], color="gray", ls="--", lw=0.8, zorder=1)
            ax.axvline(xy[i][0], color="gray", ls="--", lw=0.8, zorder=1)
    line = [xy[i] for i in sorted(front, key=lambda i: xy[i][0])]
    if len(line) > 1:
        ax.plot([q[0] for q in line], [q[1] for q in line], color="tab:red", lw=1.2, alpha=0.7, zorder=2)
        used.add("line")
    _log_if_wide(ax, [q[1] for q in xy], y_higher)
    ax.margins(0.15)
    if not y_higher:
        ax.invert_yaxis()  # better is up on every panel
    return used


_STYLE = {  # legend entry -> (marker, colour, line style, text)
    "dense": ("*", "black", "none", "dense model (dashed: its values)"),
    "front": ("o", "tab:red", "none", "Pareto-optimal"),
    "dominated": ("o", "tab:blue", "none", "dominated"),
    "line": ("none", "tab:red", "-", "Pareto front"),
}


def _legend(fig, used: set[str], top_px: float) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=m, color=c, ls=ls, markersize=10 if k == "dense" else 7, label=t)
               for k, (m, c, ls, t) in _STYLE.items() if k in used]
    height = fig.get_size_inches()[1] * fig.dpi
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - top_px / height))


def plot_report(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """One panel per measured axis (quality vs decode tokens/s, quality vs size MB), none empty;
    returns the PNG path, or None (and no file) when no panel has a point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    ok = [r for r in rows if r.get("status") == "ok"]
    panels = [p for p in plan_panels(ok) if p.rows]
    if not panels:
        path.unlink(missing_ok=True)  # a picture from an earlier render would not match this report
        return None
    ykey, ylabel, y_higher = quality_axis(ok)
    height = PANEL_H_IN + TOP_IN
    fig = Figure(figsize=(PANEL_W_IN * len(panels), height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    used = set().union(*(_draw_panel(ax, p, ykey, ylabel, y_higher) for ax, p in zip(axes, panels)))
    fig.tight_layout(rect=(0, 0, 1, 1 - TOP_IN / height))  # final layout: labels are placed on it
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    number = {r["name"]: str(i + 1) for i, r in enumerate(ok)}
    keyed = []
    for ax, p in zip(axes, panels):
        keyed += place_labels(ax, [PointLabel(r[p.xkey], r[ykey], DENSE_S if r["method"] == "dense" else POINT_S,
                                              str(r["name"]).replace("compressed-tensors", "ct"), number[r["name"]])
                                   for r in p.rows], renderer)
    add_key(fig, keyed)  # grows the figure downwards; the top strip keeps its pixel height
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.08 / fig.get_size_inches()[1], va="top")
    _legend(fig, used, top_px=0.3 * fig.dpi)
    fig.savefig(path)
    return path
