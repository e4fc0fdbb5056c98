"""``lynx demo``: a GPT where activation memory matters, one training step, the ways to trade its
memory for time.

The default model is the zoo's ``gpt-small`` at 8 layers and sequence 512 (hidden 128, 4 heads,
manual attention: each block keeps its 512 x 512 attention maps), batch 2, fp32, dropout 0: an
eager step takes about 0.3 s on one CPU thread and its step peaks at ~21x its parameters. The
same model (same weights, same batch) runs forward + loss + backward under

    eager                          eager, torch.utils.checkpoint per block
    torch.compile                  torch.compile + activation_memory_budget=0.5
    lynx at memory_budget 0.7, 0.5 and 0.2 (0.2: near the smallest it reaches)

the compiled ones per block (``--compile per-block``, the default: each transformer block
``block.compile(fullgraph=True)`` as torchtitan's ``apply_compile`` does; the blocks are alike, so
one compile serves all of them and the compile time does not grow with depth; per-block lynx
plans the blocks together from the recorded second step, so every variant warms up for 3 steps).
Each is measured the same way (``lynx_compile.variants.run_variant``, also what
``benchmarks/bench_step.py`` uses): the first step compiles and its gradients are compared with
eager's; then warm-up and timed steps give the median step time and the measured peak step
memory (``lynx_compile.memory.measure_step``: the CUDA allocator, or on CPU the profiler's
allocator events; ``.grad`` allocated first, the returned gradients counted). A budget lynx cannot
reach is a row marked refused (lynx's one-line BudgetError, naming the smallest reachable
budget), not a crash. The table is printed and written as ``demo_<device>.md`` beside
``demo_<device>.png``, peak memory against step time with one labelled point per variant (when
matplotlib is installed).

``--model gpt-tiny`` (any preset; its own layers and sequence, batch 4) runs the old small demo;
``--layers`` / ``--seq-len`` override the shape.
"""
from __future__ import annotations

import copy
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from lynx_compile.report import environment, human_bytes, markdown_table
from lynx_compile.variants import GRAD_RTOL, describe, parse_variant, run_variant, under_inductor

DEMO_VARIANTS = ("eager", "checkpoint", "inductor", "inductor-b0.5", "lynx-b0.7", "lynx-b0.5", "lynx-b0.2")
DEMO_MODEL, DEMO_LAYERS, DEMO_SEQ, DEMO_BATCH = "gpt-small", 8, 512, 2
"""The default: gpt-small at 8 layers, sequence 512, batch 2 (an eager step ~0.3 s on one
thread); the seven variants (five per-block compiles) take about 2 minutes on two busy CPU
cores, most of it compiling."""
OTHER_PRESET_BATCH = 4
"""Batch for ``--model`` other than the default (gpt-tiny: at 2 its parameter gradients hold the
smallest reachable budget at 0.76 of its step)."""
DEMO_STYLE, DEMO_WARMUP, DEMO_STEPS = "per-block", 3, 10
TABLE_COLUMNS = ["variant", "what", "step_ms", "peak", "peak_vs_compile", "peak_vs_eager", "predicted_peak",
                 "grads_equal_eager", "grad_rel_diff", "first_step_s"]


@dataclass(frozen=True)
class DemoResult:
    """What ``run_demo`` measured and wrote."""

    rows: list[dict]
    """One per variant: ``variant``, ``result`` (``ok`` / ``refused: ...`` / ``error: ...``),
    ``step_ms``, ``peak_MiB``, ``grad_rel_diff``, ``grads_equal_eager`` (bool),
    ``why_not_equal`` (None when equal), ``predicted_peak_MiB`` (lynx), ``first_step_s``."""
    text: str
    """What ``lynx demo`` prints: what ran and how it was measured, the table, refusals."""
    markdown: str
    """The report written to ``table_path``: ``text`` under a title, and the plot."""
    table_path: str
    plot_path: Optional[str]
    """None when matplotlib is not installed (``plot_note`` says so)."""
    plot_note: Optional[str]
    device: str
    wall_s: float = 0.0
    """Seconds from building the model to the written report."""


def resolve_device(device: str) -> str:
    """``auto``: ``cuda`` when a CUDA device is present, else ``cpu``; ``cuda`` without one
    raises ValueError."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu or auto)")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: auto, cpu or cuda")
    return device


def why_not_equal(row: dict, *, dropout: float, lynx_compiler: str = "inductor") -> Optional[str]:
    """None when the row's first-step gradients equal eager's (``GRAD_RTOL``), else why not."""
    if row["result"] != "ok":
        return "did not run"
    diff = row.get("grad_rel_diff")
    if diff is not None and diff <= GRAD_RTOL:
        return None
    if dropout > 0 and under_inductor(row["variant"], lynx_compiler):
        return "Inductor draws its own dropout masks"
    return f"differs by {diff:.1e} (> {GRAD_RTOL:g})"


def demo_shape(preset: Optional[str], batch_size: Optional[int], n_layers: Optional[int],
               seq_len: Optional[int]) -> tuple[str, int, dict]:
    """``(preset, batch, config overrides)``: None for ``preset`` is the default demo model
    (``DEMO_MODEL`` at ``DEMO_LAYERS`` layers, sequence ``DEMO_SEQ``, batch ``DEMO_BATCH``); a
    named preset keeps its own shape (batch ``OTHER_PRESET_BATCH``). ``n_layers`` / ``seq_len``
    / ``batch_size`` given override either."""
    if preset is None:
        preset, overrides, batch = DEMO_MODEL, {"n_layers": DEMO_LAYERS, "seq_len": DEMO_SEQ}, DEMO_BATCH
    else:
        overrides, batch = {}, OTHER_PRESET_BATCH
    overrides.update({k: v for k, v in (("n_layers", n_layers), ("seq_len", seq_len)) if v is not None})
    return preset, batch if batch_size is None else batch_size, overrides


def run_demo(preset: Optional[str] = None, *, batch_size: Optional[int] = None, n_layers: Optional[int] = None,
             seq_len: Optional[int] = None, dropout: float = 0.0, warmup: int = DEMO_WARMUP,
             steps: int = DEMO_STEPS, device: str = "auto", out: Optional[str] = None,
             variants: Sequence[str] = DEMO_VARIANTS, style: str = DEMO_STYLE, solver: str = "auto",
             progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> DemoResult:
    """Run every variant on ``preset`` (shape: ``demo_shape``) and write ``demo_<device>.md`` and
    ``.png`` under ``out`` (default: ``<tmp>/lynx_demo``).
    ``variants``: ``lynx_compile.variants`` names; ``eager`` always runs first (the reference).
    ``style``: ``per-block`` or ``whole`` (``lynx_compile.variants.COMPILE_STYLES``).
    ``warmup``: steps before the timed ones, the compiling first included (per-block lynx takes at
    least 3, ``variants.min_warmup``; every variant gets the same so their steps compare).
    ``dropout`` > 0 shows why Inductor-compiled gradients then differ from eager's.
    On CPU the steps run on one thread (restored after): with more, a loaded machine's other
    processes stall torch's thread barriers and the step times mean little."""
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.variants import min_warmup

    t_start = time.perf_counter()
    device = resolve_device(device)
    preset, batch_size, overrides = demo_shape(preset, batch_size, n_layers, seq_len)
    torch.manual_seed(0)
    base = build_model(preset, device=device, dropout=dropout, **overrides)
    x = example_batch(base, batch_size, generator=torch.Generator().manual_seed(1)).to(device)
    names = ["eager", *(v for v in variants if v != "eager")]
    warmup = max([warmup, *(min_warmup(n, style) for n in names)])
    threads = torch.get_num_threads()
    rows, ref = [], None
    try:
        if device == "cpu":
            torch.set_num_threads(1)
        for i, name in enumerate(names):
            start = time.perf_counter()
            torch.compiler.reset()
            row, grads = run_variant(name, copy.deepcopy(base), lambda m: m(x).loss, device=device, warmup=warmup,
                                     steps=steps, solver=solver, ref_grads=ref, style=style)
            if name == "eager":
                ref, row["grad_rel_diff"] = grads, 0.0
            row["model"] = preset
            row["style"] = style
            row["why_not_equal"] = why_not_equal(row, dropout=dropout)
            row["grads_equal_eager"] = row["why_not_equal"] is None
            rows.append(row)
            status = short_result(row) if row["result"] != "ok" else \
                f"{row['step_ms']:.3g} ms, peak {human_bytes(row['peak_MiB'] * 2**20)}"
            progress(f"[{i + 1}/{len(names)}] {name}: {status} ({time.perf_counter() - start:.1f} s)")
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    cfg = base.config
    shape = (f"{preset} ({cfg.n_layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}), batch {batch_size}, fp32, "
             f"dropout {dropout:g}")
    return write_report(rows, shape=shape, device=device, threads=used_threads, out=out, warmup=warmup, steps=steps,
                        solver=solver, style=style, started=t_start)


def short_result(row: dict) -> str:
    """A failed row's result, short enough for a table cell: a refusal with the smallest
    reachable budget lynx named (``refused (reachable >= 0.188)``), an error's first 60 characters."""
    result = row["result"]
    if result.startswith("refused"):
        m = re.search(r"memory_budget >= ([0-9.]+)", result)
        return f"refused (reachable >= {m.group(1)})" if m else "refused"
    return result if len(result) <= 60 else result[:57] + "..."


def what(row: dict) -> str:
    """``describe`` of the variant, saying when it was compiled per block."""
    text = describe(row["variant"])
    if row.get("style") == "per-block" and parse_variant(row["variant"]).kind in ("inductor", "lynx"):
        text = text.replace("torch.compile", "torch.compile per block", 1) if text.startswith("torch.compile") \
            else text.replace("lynx", "lynx per block", 1)
    return text


def table_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows as the printed table shows them. ``peak_vs_compile``: of torch.compile's own
    step (the ``inductor`` row), what a lynx ``memory_budget`` fraction is of."""
    eager_peak = next((r.get("peak_MiB") for r in rows if r["variant"] == "eager" and r["result"] == "ok"), None)
    compile_peak = next((r.get("peak_MiB") for r in rows if r["variant"] == "inductor" and r["result"] == "ok"),
                        None)
    out = []
    for r in rows:
        ok = r["result"] == "ok"
        peak = r.get("peak_MiB")
        predicted = r.get("predicted_peak_MiB")
        out.append({
            "variant": r["variant"], "what": what(r),
            "step_ms": round(r["step_ms"], 1) if ok else short_result(r),
            "peak": human_bytes(peak * 2**20) if ok else "-",
            "peak_vs_compile": round(peak / compile_peak, 3) if ok and compile_peak else None,
            "peak_vs_eager": round(peak / eager_peak, 3) if ok and eager_peak else None,
            "predicted_peak": human_bytes(predicted * 2**20) if predicted is not None and ok else "-",
            "grads_equal_eager": "yes" if r["grads_equal_eager"] else "- (did not run)" if not ok
            else f"no: {r['why_not_equal']}",
            "grad_rel_diff": f"{r['grad_rel_diff']:.1e}" if r.get("grad_rel_diff") is not None and ok else "-",
            "first_step_s": round(r["first_step_s"], 1) if r.get("first_step_s") is not None else None,
        })
    return out


def write_report(rows: Sequence[dict], *, shape: str, device: str, threads: int, out: Optional[str], warmup: int,
                 steps: int, solver: str, style: str = DEMO_STYLE, started: Optional[float] = None) -> DemoResult:
    """Write ``demo_<device>.md`` (and ``.png`` when matplotlib is present) under ``out``."""
    out = out or os.path.join(tempfile.gettempdir(), "lynx_demo")
    os.makedirs(out, exist_ok=True)
    env = environment()
    machine = env.get("gpu") if device == "cuda" else f"{env['cpu']}, {os.cpu_count()} cores, {threads} thread(s)"
    header = f"lynx demo on {device} ({machine}; torch {env['torch']}, python {env['python']})"
    stem = os.path.join(out, f"demo_{device}")
    plot_path, plot_note = stem + ".png", None
    title = f"lynx demo: {shape}\n{device}: {machine}; torch {env['torch']}"
    try:
        plot_demo(rows, plot_path, title)
    except ImportError:
        plot_path, plot_note = None, "no plot: matplotlib is not installed (pip install matplotlib)"
    compiled = "each transformer block compiled on its own (torchtitan's apply_compile)" if style == "per-block" \
        else "the whole model compiled"
    lines = [header, "", f"{shape}; {compiled}. Step = forward + loss + backward (no optimizer); {warmup} warm-up "
             f"step(s) (the first compiles: first_step_s), median of {steps} timed steps. peak = step memory "
             "measured by `lynx_compile.memory.measure_step` (" + (
                 "CUDA allocator" if device == "cuda" else "the profiler's CPU allocator events")
             + "; .grad allocated first, the returned gradients counted); peak_vs_compile = of torch.compile's "
             "own step (what a lynx memory_budget fraction is of); predicted_peak = lynx's plan of the step. "
             f"grads_equal_eager: first-step gradients within {GRAD_RTOL:g} relative of eager's (grad_rel_diff). "
             f"lynx: solver {solver}, compiler inductor.",
             "", markdown_table(table_rows(rows), TABLE_COLUMNS)]
    failed = [r for r in rows if r["result"] != "ok"]
    if failed:
        lines += ["", *(f"- {r['variant']}: {r['result']}" for r in failed)]
    wall_s = time.perf_counter() - started if started is not None else 0.0
    if started is not None:
        lines += ["", f"Wall time: {wall_s:.0f} s (model, every variant's compile and steps, the report)."]
    text = "\n".join(lines)
    picture = f"![peak memory vs step time, one point per variant]({os.path.basename(stem)}.png)" if plot_path \
        else f"({plot_note})"
    markdown = f"# {text}\n\n{picture}\n"
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    return DemoResult(rows=list(rows), text=text, markdown=markdown, table_path=stem + ".md", plot_path=plot_path,
                      plot_note=plot_note, device=device, wall_s=wall_s)


# ----------------------------------------------------------------------------------- the plot

_STYLE = {  # kind -> marker, colour
    "eager": ("o", "black"), "checkpoint": ("v", "dimgray"), "inductor": ("s", "tab:blue"),
    "lynx": ("D", "tab:red"),
}


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


def cmd_demo(args: Any) -> int:
    """``lynx demo``: run, print the table and where the files are; exit 1 when a variant failed
    with an error or its gradients differ from eager's (a refused budget is a result, not a
    failure; ``--device cuda`` without CUDA: ValueError, which the CLI prints as one line with
    exit 2)."""
    steps = getattr(args, "steps", None)
    result = run_demo(getattr(args, "model", None), batch_size=getattr(args, "batch_size", None),
                      n_layers=getattr(args, "layers", None), seq_len=getattr(args, "seq_len", None),
                      steps=DEMO_STEPS if steps is None else steps, device=args.device, out=args.out,
                      style=getattr(args, "compile", None) or DEMO_STYLE)
    print("\n" + result.text)
    print(f"\ntable: {result.table_path}")
    print(f"plot:  {result.plot_path}" if result.plot_path else f"plot:  {result.plot_note}")
    ran = [r for r in result.rows if not r["result"].startswith("refused")]
    bad = [r["variant"] for r in ran if not r["grads_equal_eager"]]
    refused = [r["variant"] for r in result.rows if r["result"].startswith("refused")]
    print("\nevery variant that ran has eager's gradients" if not bad else f"\nnot equal to eager: {', '.join(bad)}",
          flush=True)
    if refused:
        print(f"refused (budget below what lynx reaches): {', '.join(refused)}", flush=True)
    return 1 if bad else 0
