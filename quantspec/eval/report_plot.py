"""report.png: quality against decode speed and against size, Pareto front marked, dense as the
reference point (matplotlib, Agg backend chosen per figure, no global state touched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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


def _label(row: dict[str, Any]) -> str:
    return str(row["name"]).replace("compressed-tensors", "ct")


def _overlaps(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place_labels(ax, pts, xkey, ykey) -> None:
    """Annotate each point, moving a label down (with a leader line) while it would cover an
    earlier one: points of equal size or speed otherwise print their names on top of each other."""
    ax.autoscale_view()
    scale = ax.figure.dpi / 72.0  # points -> pixels
    placed: list[tuple[float, float, float, float]] = []
    for r in sorted(pts, key=lambda r: (r[xkey], r[ykey])):
        text = _label(r)
        x, y = ax.transData.transform((r[xkey], r[ykey]))
        width, height = len(text) * 4.9 * scale, 10 * scale
        dy = 5.0
        for _ in range(16):
            box = (x + 6 * scale, y + dy * scale, x + 6 * scale + width, y + dy * scale + height)
            if not any(_overlaps(box, b) for b in placed):
                break
            dy -= 11.0
        placed.append(box)
        leader = {"arrowstyle": "-", "color": "gray", "lw": 0.5} if dy != 5.0 else None
        ax.annotate(text, (r[xkey], r[ykey]), textcoords="offset points", xytext=(6, dy), fontsize=8,
                    arrowprops=leader)


def _panel(ax, rows, xkey, xlabel, x_higher, ykey, ylabel, y_higher) -> None:
    pts = [r for r in rows if r.get(xkey) is not None and r.get(ykey) is not None]
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, which="both")
    if not pts:
        ax.text(0.5, 0.5, f"no {xlabel.split(' (')[0]} data", ha="center", va="center", transform=ax.transAxes)
        return
    xy = [(r[xkey], r[ykey]) for r in pts]
    front = set(pareto_front(xy, x_higher, y_higher))
    for i, r in enumerate(pts):
        dense = r["method"] == "dense"
        ax.scatter(r[xkey], r[ykey], s=160 if dense else 60, marker="*" if dense else "o",
                   color="black" if dense else ("tab:red" if i in front else "tab:blue"), zorder=3,
                   edgecolors="white", linewidths=0.8)
        if dense:
            ax.axhline(r[ykey], color="gray", ls="--", lw=0.8, zorder=1)
            ax.axvline(r[xkey], color="gray", ls="--", lw=0.8, zorder=1)
    fx = [xy[i] for i in sorted(front, key=lambda i: xy[i][0])]
    if len(fx) > 1:
        ax.plot([p[0] for p in fx], [p[1] for p in fx], color="tab:red", lw=1.2, alpha=0.7, zorder=2,
                label="Pareto front")
        ax.legend(loc="lower right", fontsize=8)
    ys = [p[1] for p in xy]
    if not y_higher and min(ys) > 0 and max(ys) / min(ys) > 3:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")  # perplexities that span a wide range
        plain = FuncFormatter(lambda v, _pos: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.margins(0.15)
    if not y_higher:
        ax.invert_yaxis()  # better is up on both panels
    _place_labels(ax, pts, xkey, ykey)


def plot_report(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Two panels (quality vs decode tokens/s, quality vs size MB); returns the PNG path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in rows if r.get("status") == "ok"]
    ykey, ylabel, y_higher = quality_axis(ok)
    fig = Figure(figsize=(12, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    _panel(ax1, ok, "tokens_per_s", "decode tokens/s (batch 1)", True, ykey, ylabel, y_higher)
    _panel(ax2, ok, "size_mb", "weights size (MB)", False, ykey, ylabel, y_higher)
    ax1.set_title("quality vs speed (dense = black star)")
    ax2.set_title("quality vs size (red = Pareto-optimal)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
