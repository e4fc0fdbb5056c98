"""The plot ``lynx demo`` draws (``tools/demo.py``): peak memory against step time, one labelled
point per variant, each label placed where it overlaps no other label or marker.

Needs matplotlib, imported by the functions that draw."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from lynx_compile.tools.demo_table import short_result
from lynx_compile.tools.variants import describe, parse_variant

_STYLE = {  # kind -> marker, colour
    "eager": ("o", "black"), "checkpoint": ("v", "dimgray"), "inductor": ("s", "tab:blue"),
    "lynx": ("D", "tab:red"),
}


def plot_demo(rows: Sequence[dict], path: str, title: str, *, keep_open: bool = False) -> Any:
    """Peak memory (x, MiB) against step time (y, ms), one marker per variant that ran, each
    labelled by an annotation placed where it overlaps no other label, no marker and stays inside
    the axes (``place_labels``); lynx's points joined by a dashed line; refused or failed
    variants listed under the plot. Returns the figure when ``keep_open`` (else closes it).
    Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["result"] == "ok"]
    compile_peak = next((r["peak_MiB"] for r in ok if r["variant"] == "inductor"), None)
    fig = plt.figure(figsize=(10, 6.5))
    ax = fig.add_axes((0.08, 0.14, 0.9, 0.72))
    for r in ok:
        marker, colour = _STYLE.get(parse_variant(r["variant"]).kind, ("o", "tab:green"))
        ax.plot(r["peak_MiB"], r["step_ms"], marker, color=colour, markersize=8, zorder=3)
    lynx = sorted((r for r in ok if parse_variant(r["variant"]).kind == "lynx"), key=lambda r: r["peak_MiB"])
    if len(lynx) > 1:
        ax.plot([r["peak_MiB"] for r in lynx], [r["step_ms"] for r in lynx], "--", color="tab:red", alpha=0.4,
                zorder=2)
    if ok:  # room for the labels: wide margins, memory from 0
        xs, ys = [r["peak_MiB"] for r in ok], [r["step_ms"] for r in ok]
        x_hi, y_lo, y_hi = max(xs), min(ys), max(ys)
        y_span = max(y_hi - y_lo, 0.1 * y_hi, 1e-9)
        ax.set_xlim(0, x_hi * 1.3)
        ax.set_ylim(max(0.0, y_lo - 0.9 * y_span), y_hi + 0.9 * y_span)
    ax.set_xlabel("peak step memory (MiB, measured)")
    ax.set_ylabel("step time (ms, median)")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    place_labels(ax, [(r["peak_MiB"], r["step_ms"], point_label(r, compile_peak),
                       _STYLE.get(parse_variant(r["variant"]).kind, ("o", "tab:green"))[1]) for r in ok],
                 lines=[[(r["peak_MiB"], r["step_ms"]) for r in lynx]])
    failed = [r for r in rows if r["result"] != "ok"]
    if failed:
        fig.text(0.08, 0.02, "not shown: " + "; ".join(f"{r['variant']} {short_result(r)}" for r in failed),
                 fontsize=8, color="dimgray")
    fig.savefig(path, dpi=110)
    if keep_open:
        return fig
    plt.close(fig)
    return None


def point_label(row: dict, compile_peak: Optional[float]) -> str:
    """A point's label: what ran, then its peak and step time (and a lynx budget in MiB)."""
    v = parse_variant(row["variant"])
    if v.kind == "eager":
        name = "eager"
    elif v.kind == "checkpoint":
        name = "eager + checkpoint per block"
    elif v.kind == "inductor":
        name = "torch.compile" if v.budget is None else f"torch.compile, activation_memory_budget {v.budget:g}"
    elif v.policy == "lynx":
        bound = f" (\u2264 {v.budget * compile_peak:.3g} MiB)" if compile_peak else ""
        name = f"lynx, memory_budget {v.budget:g}{bound}"
    else:
        name = describe(row["variant"])
    return f"{name}\n{row['peak_MiB']:.3g} MiB, {row['step_ms']:.3g} ms"


def place_labels(ax: Any, points: Sequence[tuple[float, float, str, str]],
                 lines: Sequence[Sequence[tuple[float, float]]] = ()) -> list:
    """Annotate each ``(x, y, text, colour)`` point with a label joined to it by a line, choosing
    each label's place among a ring of offsets around its point (nearest first) to overlap no
    other label, no marker, no polyline of ``lines`` (data coordinates), to stay inside the axes,
    and so that no label's line crosses another label, marker or label's line. Labels are placed greedily, the
    most crowded points first, then each is moved again while that lowers the total cost (the
    overlapping area, crossings weighted as a large overlap). The axes' limits and position must
    be final. Returns the annotations."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    frame = (frame.x0, frame.y0, frame.x1, frame.y1)
    to_px = ax.transData.transform
    anchors = [tuple(to_px((x, y))) for x, y, _, _ in points]
    half = 7 * fig.dpi / 72  # half a marker's side, with room
    markers = [_box(cx, cy, half) for cx, cy in anchors]
    line_px = [to_px(a) + (to_px(b) - to_px(a)) * t / 40 for line in lines for a, b in zip(line, line[1:])
               for t in range(41)]
    offsets = [(r * math.cos(a), r * math.sin(a)) for r in (18, 32, 50, 72, 100, 130, 165)
               for a in (math.radians(d) for d in (30, -30, 150, -150, 90, -90, 0, 180, 60, -60, 120, -120))]
    cross = 2000.0  # a crossing costs as much as a 45 x 45 pixel overlap

    def annotate(i: int, dx: float, dy: float, **kw: Any) -> Any:
        x, y, text, colour = points[i]
        return ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=8, color=colour,
                           ha="left" if dx > 1 else "right" if dx < -1 else "center",
                           va="bottom" if dy > 1 else "top" if dy < -1 else "center", **kw)

    boxes, own = [], []  # per point, per offset: the label's box (padded) and the cost of it alone
    for i in range(len(points)):
        boxes.append([]), own.append([])
        for dx, dy in offsets:
            ann = annotate(i, dx, dy)
            box = _text_box(ann, renderer, pad=3)
            ann.remove()
            boxes[i].append(box)
            own[i].append(sum(_overlap(box, m) for m in markers) + _outside(box, frame)
                          + sum(cross * _crosses(anchors[i], _centre(box), m) for j, m in enumerate(markers) if j != i)
                          + sum(20.0 for p in line_px if box[0] < p[0] < box[2] and box[1] < p[1] < box[3]))

    def cost(i: int, k: int, chosen: dict) -> float:
        box, c = boxes[i][k], own[i][k]
        for j, kj in chosen.items():
            if j == i:
                continue
            other = boxes[j][kj]
            c += _overlap(box, other) + cross * (_crosses(anchors[i], _centre(box), other)
                                                 + _crosses(anchors[j], _centre(other), box)
                                                 + _segments_cross(anchors[i], _centre(box), anchors[j],
                                                                   _centre(other)))
        return c

    def best(i: int, chosen: dict) -> int:
        costs = [cost(i, k, chosen) for k in range(len(offsets))]
        return min(range(len(offsets)), key=lambda k: (costs[k], k))

    def crowd(i: int) -> int:  # points within 150 px
        return sum(1 for c in anchors if math.dist(c, anchors[i]) < 150 * fig.dpi / 100)

    chosen: dict[int, int] = {}
    order = sorted(range(len(points)), key=lambda i: (-crowd(i), points[i][0], points[i][1]))
    for i in order:
        chosen[i] = best(i, chosen)
    for _ in range(5):  # move labels while that helps
        moved = False
        for i in order:
            k = best(i, chosen)
            if cost(i, k, chosen) < cost(i, chosen[i], chosen):
                chosen[i], moved = k, True
        if not moved:
            break
    annotations = []
    for i in range(len(points)):
        colour = points[i][3]
        annotations.append(annotate(i, *offsets[chosen[i]], arrowprops=dict(
            arrowstyle="-", color=colour, alpha=0.6, lw=0.8, shrinkA=1, shrinkB=5)))
    return annotations


def label_boxes(fig: Any) -> list[tuple[float, float, float, float]]:
    """The display-coordinate boxes ``(x0, y0, x1, y1)`` of the figure's point labels (its axes'
    annotations, the text without its arrow), from its renderer: for checking that none overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return [_text_box(t, renderer) for ax in fig.axes for t in ax.texts]


def _text_box(text: Any, renderer: Any, pad: float = 0.0) -> tuple[float, float, float, float]:
    """An annotation's text box in pixels (``Annotation.get_window_extent`` adds the arrow)."""
    from matplotlib.text import Text

    if hasattr(text, "update_positions"):  # an annotation: its text's place follows from xytext
        text.update_positions(renderer)
    b = Text.get_window_extent(text, renderer)
    return (b.x0 - pad, b.y0 - pad, b.x1 + pad, b.y1 + pad)


def _centre(box: tuple) -> tuple[float, float]:
    """Where an annotation's arrow points from (matplotlib's default ``relpos``: the text's centre)."""
    return ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2)


def _segments_cross(p1: tuple, p2: tuple, q1: tuple, q2: tuple) -> float:
    """Whether segments p1-p2 and q1-q2 properly intersect (two labels' lines crossing)."""
    def side(a: tuple, b: tuple, c: tuple) -> float:
        return (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])

    return float(side(p1, p2, q1) * side(p1, p2, q2) < 0 and side(q1, q2, p1) * side(q1, q2, p2) < 0)


def _crosses(a: tuple, b: tuple, box: tuple, samples: int = 24) -> float:
    """Whether the segment a-b passes through ``box`` (sampled)."""
    return float(any(box[0] < a[0] + (b[0] - a[0]) * t / samples < box[2]
                     and box[1] < a[1] + (b[1] - a[1]) * t / samples < box[3] for t in range(1, samples)))


def _box(cx: float, cy: float, half: float) -> tuple:
    return (cx - half, cy - half, cx + half, cy + half)


def _overlap(a: tuple, b: tuple) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def _outside(box: tuple, frame: tuple) -> float:
    """Area of ``box`` outside ``frame`` (weighted up: a label cut off is worse than one touching)."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    return 10 * (area - _overlap(box, frame))
