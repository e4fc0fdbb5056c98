"""How much recompute ran while a collective was in flight, from a profiler trace.

Inputs: a Chrome trace exported by ``torch.profiler`` from a run compiled with
``trace_recompute=True`` (recompute appears as ``lynx::recompute[...]`` ranges) and the
collectives' in-flight intervals. Those come from one of two sources:

- the emulated link's log (``lynx_compile.distributed.emulated_link.collective_log()``): issue
  time and the time the transfer completed, in ``time.perf_counter`` seconds; mapped onto the
  trace's clock through a ``lynx::clock_sync`` range recorded at a known ``perf_counter``;
- without it, the trace itself: from the start of each ``_c10d_functional`` collective op to
  the end of the ``wait_tensor`` that completes it (paired in issue order). That is an upper
  bound on the in-flight time (the transfer may have finished before the wait was called),
  so the share it gives is an upper bound too; the report says which source was used.

``share = recompute time inside any in-flight interval / all recompute time``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

from lynx_compile.passes.trace_ranges import RANGE_PREFIX as RECOMPUTE_PREFIX

CLOCK_SYNC = "lynx::clock_sync"
_COLLECTIVE_OPS = ("_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
                   "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single")
_WAIT_OP = "_c10d_functional::wait_tensor"


@dataclass(frozen=True)
class OverlapReport:
    """Recompute time, how much of it overlapped communication, and where the intervals came from."""

    recompute_s: float
    overlapped_s: float
    window_recompute_s: float
    """Recompute the plan placed inside windows (``lynx::recompute[window:*]`` ranges)."""
    collectives: int
    in_flight_s: float
    source: str
    """``emulated-link-log`` (exact) or ``trace-issue-to-wait`` (upper bound)."""

    @property
    def share(self) -> float:
        return self.overlapped_s / self.recompute_s if self.recompute_s > 0 else 0.0


def _events(trace: dict | str) -> list[dict]:
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_in_flight(events: list[dict]) -> list[tuple[float, float]]:
    """[collective op start, its wait_tensor end] in µs, pairing in issue order per thread."""
    pending: dict[int, list[float]] = {}
    out = []
    for e in sorted(events, key=lambda e: e["ts"]):
        name, tid = e.get("name", ""), e.get("tid", 0)
        if name in _COLLECTIVE_OPS:
            pending.setdefault(tid, []).append(float(e["ts"]))
        elif name == _WAIT_OP and pending.get(tid):
            out.append((pending[tid].pop(0), float(e["ts"]) + float(e.get("dur", 0))))
    return out


def overlap_report(trace: dict | str, link_log: list | None = None,
                   sync_perf_counter_s: float | None = None) -> OverlapReport:
    """Overlap of recompute with collectives in ``trace`` (see the module docstring).

    ``link_log``: entries with ``issue_t`` and ``done_t`` (perf_counter seconds), used when
    ``sync_perf_counter_s`` (the perf_counter at the ``lynx::clock_sync`` range) is given."""
    events = _events(trace)
    rec = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["name"]) for e in events
           if str(e.get("name", "")).startswith(RECOMPUTE_PREFIX)]
    recompute = _union((a, b) for a, b, _ in rec)
    windowed = _union((a, b) for a, b, n in rec if "window:" in n)
    sync = [e for e in events if e.get("name") == CLOCK_SYNC]
    if link_log and sync and sync_perf_counter_s is not None:
        offset = float(sync[0]["ts"]) - sync_perf_counter_s * 1e6  # trace µs = perf_counter µs + offset
        flight = [(_get(x, "issue_t") * 1e6 + offset, _get(x, "done_t") * 1e6 + offset) for x in link_log]
        source = "emulated-link-log"
    else:
        flight = trace_in_flight(events)
        source = "trace-issue-to-wait"
    in_flight = _union(flight)
    return OverlapReport(
        recompute_s=sum(b - a for a, b in recompute) / 1e6,
        overlapped_s=_intersection(recompute, in_flight) / 1e6,
        window_recompute_s=sum(b - a for a, b in windowed) / 1e6,
        collectives=len(flight), in_flight_s=sum(b - a for a, b in in_flight) / 1e6, source=source)


def _get(entry, key: str) -> float:
    return float(entry[key] if isinstance(entry, dict) else getattr(entry, key))
