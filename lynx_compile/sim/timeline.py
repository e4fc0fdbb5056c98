"""Views of a ``StepResult``: a Chrome trace (chrome://tracing, Perfetto) and a Gantt PNG.

Both draw one row per (rank, lane): ``compute`` (F, B, R), ``comm`` (TP collectives, DP
reduction) and ``p2p`` (pipeline sends). In-window recompute shows as an R bar on ``compute``
under the TP bar it overlaps on ``comm``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from .step import Event, StepResult

LANES = ("compute", "comm", "p2p")
KIND_COLORS = {"F": "#4C72B0", "B": "#55A868", "R": "#C44E52", "TP": "#8172B2", "P2P": "#CCB974", "DP": "#64B5CD"}
KIND_LABELS = {"F": "forward", "B": "backward", "R": "recompute", "TP": "TP collective",
               "P2P": "pipeline send", "DP": "DP all-reduce"}


def _event_name(e: Event) -> str:
    if e.kind == "DP":
        return "DP"
    layer = f" L{e.layer}" if e.layer >= 0 else ""
    return f"{e.kind} s{e.stage} mb{e.microbatch}{layer}"


def to_chrome_trace(result: StepResult, path: str | os.PathLike) -> dict[str, Any]:
    """Write ``result`` as Chrome trace JSON to ``path`` and return it.

    One complete event (ph "X", ts/dur in microseconds) per ``result.events`` entry, pid = rank,
    tid = lane index in ``LANES``; "M" metadata events name the processes and threads.
    """
    trace: list[dict[str, Any]] = []
    for r in range(result.num_ranks):
        trace.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        for tid, lane in enumerate(LANES):
            trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": lane}})
    for e in result.events:
        trace.append({"ph": "X", "name": _event_name(e), "cat": e.kind, "pid": e.rank, "tid": LANES.index(e.lane),
                      "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                      "args": {"stage": e.stage, "microbatch": e.microbatch, "layer": e.layer}})
    doc = {"traceEvents": trace, "displayTimeUnit": "ms",
           "otherData": {"iteration_s": result.iteration_s, "peak_bytes": list(result.peak_bytes)}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return doc


def plot_gantt(result: StepResult, path: str | os.PathLike, title: str | None = None) -> None:
    """Write a Gantt chart of ``result`` to ``path`` (PNG): ranks top to bottom, each with its
    lanes as sub-rows, one color per event kind, time in ms."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_gantt needs matplotlib: pip install matplotlib") from e
    R, rows = result.num_ranks, len(LANES)
    bars: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
    for e in result.events:
        bars.setdefault((e.rank, e.lane, e.kind), []).append((e.start_s * 1e3, (e.end_s - e.start_s) * 1e3))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.9 * R))
    edge = "black" if len(result.events) < 400 else "none"  # outlines would blacken dense charts
    for (rank, lane, kind), spans in bars.items():
        y = (R - 1 - rank) * (rows + 1) + (rows - 1 - LANES.index(lane))  # rank 0 on top, compute first
        ax.broken_barh(spans, (y + 0.1, 0.8), facecolors=KIND_COLORS[kind], edgecolor=edge, linewidth=0.3)
    ticks = [(R - 1 - r) * (rows + 1) + rows - 1 - i + 0.5 for r in range(R) for i in range(rows)]
    ax.set_yticks(ticks, [f"rank {r} {lane}" for r in range(R) for lane in LANES], fontsize=8)
    ax.set_ylim(-0.5, R * (rows + 1) - 0.5)
    ax.set_xlim(0, max(result.iteration_s * 1e3, 1e-9))
    ax.set_xlabel("time (ms)")
    kinds = [k for k in KIND_COLORS if any(key[2] == k for key in bars)]
    ax.legend(handles=[Patch(facecolor=KIND_COLORS[k], label=KIND_LABELS[k]) for k in kinds],
              loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    mem = ", ".join(f"{b / 2**30:.2f}" for b in result.peak_bytes)
    ax.set_title(title or f"iteration {result.iteration_s * 1e3:.3f} ms, bubble {result.bubble_fraction:.1%}, "
                 f"peak GiB per rank [{mem}]" + ("" if result.fits else f", OOM on ranks {list(result.oom)}"))
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
