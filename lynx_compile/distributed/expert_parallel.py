"""Expert parallelism (MoE): the token all-to-alls as windows, and what a plan put in them.

torchtitan 0.3.0's ``AllToAllTokenDispatcher`` (EP > 1, ``spmd_backend="partial_dtensor"``, or
any backend under compile) exchanges tokens with ``_c10d_functional.all_to_all_single``. In one
MoE block's dynamo graph (per-block compile, ``fullgraph=True``, ``capture_scalar_outputs``)::

    forward   counts a2a ─▶ wait ─▶ .tolist() (u0..u3, unbacked) ─▶ dispatch a2a (R = u2+u3 rows)
              ─▶ wait ─▶ permute ─▶ grouped_mm ×3 (bf16) ─▶ unpermute ─▶ combine a2a ─▶ wait
    backward  combine's a2a (grad of the expert outputs) ─▶ wait ─▶ grouped_mm backward
              ─▶ dispatch's a2a (grad of the routed tokens) ─▶ wait ─▶ router, attention ...

Nothing here builds windows: ``passes/remat_problem._windows`` takes every functional collective
of the backward with its ``wait_tensor`` as one, the two backward all-to-alls included, and the
plan may recompute units between the issue and the wait (``decisions.Window``). This module
only reads a compiled graph's record back: which units the plan recomputes in which all-to-all.

Sizes that depend on the token counts are unbacked SymInts; lynx's cost and memory models size
each unbacked symbol as ``graph.values.UNBACKED_SIZE_HINT`` rows (not the counts of a step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from lynx_compile.graph.collectives import canonical_collective
from lynx_compile.decisions import Window


@dataclass(frozen=True)
class AllToAllWindow:
    """One backward all-to-all of a compiled graph and the recompute the plan put in it."""

    graph_id: int
    collective: str
    """The all-to-all's node name in the backward (``decisions.Window.collective``)."""
    duration_s: float
    """Its priced time (``costs.comm.collective_time``): the window's length."""
    recomputed: tuple[str, ...]
    """Units (joint-graph op names) recomputed while it is in flight, in name order."""


def all_to_all_windows(records: Iterable) -> list[AllToAllWindow]:
    """Every backward all-to-all window of ``records`` (``backend.records``) whose plan was made
    by lynx's optimizer (a record with its ``RematProblem``), with the units placed in it."""
    out = []
    for rec in records:
        if rec.plan is None or rec.problem is None:
            continue
        placed: dict[str, list[str]] = {}
        for unit, decision in rec.plan.decisions:
            if isinstance(decision, Window):
                placed.setdefault(decision.collective, []).append(unit)
        for w in rec.problem.windows:
            if canonical_collective(w.kind) == "all_to_all":
                out.append(AllToAllWindow(graph_id=rec.graph_id, collective=w.name, duration_s=w.duration_s,
                                          recomputed=tuple(sorted(placed.get(w.name, ())))))
    return out


def describe(windows: Iterable[AllToAllWindow]) -> str:
    """One line per window: ``graph 1 all_to_all_single_3 (30.7 us): mm_5, mul_57``."""
    return "\n".join(f"graph {w.graph_id} {w.collective} ({w.duration_s * 1e6:.1f} us): "
                     + (", ".join(w.recomputed) or "nothing") for w in windows)
