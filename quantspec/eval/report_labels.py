"""Point labels that stay readable when points crowd.

Each label tries offsets around its point, nearest first, and takes the first place where its
box (measured with the renderer: the real text extents) covers no other label, no marker and
does not leave its axes; a label set away from its point gets a leader line. A name that fits
nowhere is replaced by the point's number, and :func:`add_key` lists those numbers under the
plots. Call :func:`place_labels` once the figure's layout is final (after ``tight_layout``).
"""

from __future__ import annotations

from dataclasses import dataclass

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels

FONT_SIZE = 8
PAD_PX = 2.0  # free pixels kept between a label and anything else
RINGS_PT = (7, 12, 20, 30, 42, 56, 76, 100, 130, 165)  # offset distances tried, in points
KEY_LINE_CHARS = 150
LEADER_FROM_PT = 20  # labels this far from their point or farther get a leader line
DIRECTIONS = ((1, 0.6), (1, -0.6), (-1, 0.6), (-1, -0.6), (0, 1), (0, -1), (1, 0), (-1, 0))


@dataclass(frozen=True)
class PointLabel:
    """One point to label: data coordinates, marker area (scatter ``s``, points^2), its name and
    the short key (its number) used when the name fits nowhere."""

    x: float
    y: float
    marker_s: float
    name: str
    key: str


def overlaps(a: Box, b: Box, pad: float = 0.0) -> bool:
    return a[0] < b[2] + pad and b[0] < a[2] + pad and a[1] < b[3] + pad and b[1] < a[3] + pad


def inside(a: Box, outer: Box) -> bool:
    return a[0] >= outer[0] and a[1] >= outer[1] and a[2] <= outer[2] and a[3] <= outer[3]


def label_box(anchor: tuple[float, float], offset: tuple[float, float], size: tuple[float, float]) -> Box:
    """The box of a label of ``size`` (w, h px) set ``offset`` px from ``anchor``, on the side the
    offset points to (the alignment :func:`_alignment` gives it)."""
    (x, y), (ox, oy), (w, h) = anchor, offset, size
    x0 = x + ox if ox > 0 else (x + ox - w if ox < 0 else x + ox - w / 2)
    y0 = y + oy if oy > 0 else (y + oy - h if oy < 0 else y + oy - h / 2)
    return (x0, y0, x0 + w, y0 + h)


def _alignment(dx: float, dy: float) -> tuple[str, str]:
    ha = "left" if dx > 0 else ("right" if dx < 0 else "center")
    va = "bottom" if dy > 0 else ("top" if dy < 0 else "center")
    return ha, va


def _text_size(ax, text: str, renderer) -> tuple[float, float]:
    probe = ax.text(0, 0, text, fontsize=FONT_SIZE, transform=None)
    bb = probe.get_window_extent(renderer)
    probe.remove()
    return bb.width, bb.height


def _find_place(anchor, size, scale, taken: list[Box], frame: Box) -> tuple[tuple[float, float], Box] | None:
    for ring in RINGS_PT:
        for ux, uy in DIRECTIONS:
            dx, dy = ring * ux, ring * uy
            box = label_box(anchor, (dx * scale, dy * scale), size)
            if inside(box, frame) and not any(overlaps(box, t, PAD_PX) for t in taken):
                return (dx, dy), box
    return None


def place_labels(ax, points: list[PointLabel], renderer) -> list[PointLabel]:
    """Annotate every point of ``ax`` without overlap; return the points labelled by their key."""
    scale = ax.figure.dpi / 72.0  # points -> pixels
    frame = tuple(ax.get_window_extent(renderer).extents)
    anchors = [tuple(ax.transData.transform((p.x, p.y))) for p in points]
    taken: list[Box] = []
    for (x, y), p in zip(anchors, points):  # every marker is an obstacle
        half = (p.marker_s ** 0.5) / 2 * scale + 1
        taken.append((x - half, y - half, x + half, y + half))
    keyed = []
    for anchor, p in sorted(zip(anchors, points), key=lambda ap: (-ap[0][1], ap[0][0])):
        text, place = p.name, _find_place(anchor, _text_size(ax, p.name, renderer), scale, taken, frame)
        if place is None:
            keyed.append(p)
            text = p.key
            size = _text_size(ax, text, renderer)
            place = _find_place(anchor, size, scale, taken, frame) or (
                (RINGS_PT[0], RINGS_PT[0]), label_box(anchor, (RINGS_PT[0] * scale,) * 2, size))
        (dx, dy), box = place
        taken.append(box)
        ha, va = _alignment(dx, dy)
        leader = {"arrowstyle": "-", "color": "gray", "lw": 0.5} if max(abs(dx), abs(dy)) >= LEADER_FROM_PT else None
        ax.annotate(text, (p.x, p.y), textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                    fontsize=FONT_SIZE, arrowprops=leader, zorder=4,
                    bbox={"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.75})
    return keyed


def add_key(fig, keyed: list[PointLabel]) -> None:
    """List the numbered points under the plots, growing the figure downwards so that the axes
    (and the labels already placed on them) keep their pixel positions."""
    entries = sorted({(int(p.key), p.name) for p in keyed})
    if not entries:
        return
    lines, line = [], "key:"
    for item in (f"{k} = {n}" for k, n in entries):  # an entry is never split across lines
        if len(line) + len(item) + 2 > KEY_LINE_CHARS:
            lines.append(line + ",")
            line = item
        else:
            line = f"{line} {item}" if line == "key:" else f"{line}, {item}"
    lines.append(line)
    w, h = fig.get_size_inches()
    extra = 0.18 * len(lines) + 0.2
    for ax in fig.axes:
        p = ax.get_position()
        ax.set_position([p.x0, (p.y0 * h + extra) / (h + extra), p.width, p.height * h / (h + extra)])
    fig.set_size_inches(w, h + extra)
    fig.text(0.01, 0.1 / (h + extra), "\n".join(lines), fontsize=FONT_SIZE, ha="left", va="bottom")
