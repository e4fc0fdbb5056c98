"""A block's recompute curve, and how a stage splits its kept bytes between its blocks.

A :class:`RecomputeCurve` is the exposed recompute seconds of one block (one micro-batch) against
the bytes it keeps, from Lynx-HEU solves of the traced model at a ladder of budgets
(``profile.profile_pipeline``). Curves are convex piecewise linear (the lower hull of the solved
points), so splitting a stage's bytes between its blocks (``allocate``) is a greedy by seconds
saved per byte, which is exact for them.

While a block's backward runs, what it dropped is recomputed and alive on top of what the stage
keeps (``transient_bytes``: the largest block's size minus its share of the kept bytes), so a
stage fits ``kept + transient(kept) <= room`` (``allocate_with_transient``). ``weight_share`` is
the part of the exposed recompute that only the weight gradients need (W under a zero-bubble
schedule's B/W split). Pure (no torch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, kw_only=True)
class RecomputeCurve:
    """Exposed recompute seconds of one block (one micro-batch) against the bytes it keeps.

    Points sorted by ``kept_bytes``; ``kept_bytes[0]`` is the least the block can keep (full
    recompute), ``kept_bytes[-1]`` keeps everything (``exposed_s[-1] == 0``)."""

    kept_bytes: tuple[int, ...]
    exposed_s: tuple[float, ...]
    exposed_w_s: tuple[float, ...] = ()
    """Per point, the part of ``exposed_s`` that only the weight gradients need (W's recompute
    under a zero-bubble schedule's B/W split; ``profile``); empty: not known (all B)."""

    def _interp(self, ys: Sequence[float], kept: float) -> float:
        """Piecewise-linear interpolation of ``ys`` (one per point) at ``kept`` bytes over the
        points sorted by bytes; clamped to the ends."""
        pts = sorted(zip(self.kept_bytes, ys))
        if kept <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if kept <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (kept - x0) / (x1 - x0)
        return pts[-1][1]

    def weight_share(self, kept: float) -> float:
        """The share of the exposed recompute at ``kept`` bytes that only W needs (0..1),
        interpolated between the solved points; 0 when not known."""
        if not self.exposed_w_s:
            return 0.0
        total = self._interp(self.exposed_s, kept)
        return min(1.0, self._interp(self.exposed_w_s, kept) / total) if total > 0 else 0.0

    def hull(self) -> tuple[tuple[int, float], ...]:
        """Lower convex hull of the points (non-increasing, convex in bytes)."""
        pts = sorted(zip(self.kept_bytes, self.exposed_s))
        best: list[tuple[int, float]] = []
        for x, y in pts:  # keep the cheapest point per byte count, and monotone non-increasing
            if best and y >= best[-1][1] - 1e-15:
                continue
            if best and x == best[-1][0]:
                best[-1] = (x, y)
                continue
            best.append((x, y))
        hull: list[tuple[int, float]] = []
        for p in best:
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) <= 0:
                hull.pop()
            hull.append(p)
        return tuple(hull)

    @property
    def min_bytes(self) -> int:
        return min(self.kept_bytes)

    @property
    def max_bytes(self) -> int:
        return max(self.kept_bytes)


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def weight_share(curves: Sequence[RecomputeCurve], kept: float) -> float:
    """The share of the exposed recompute of blocks keeping ``kept`` bytes together (in equal
    shares, as ``transient_bytes``) that only W needs (``RecomputeCurve.weight_share``, weighted
    by each block's exposed seconds there); 0 without curves or when nothing is exposed."""
    if not curves:
        return 0.0
    each = kept / len(curves)
    total = sum(c._interp(c.exposed_s, each) for c in curves)
    if total <= 0:
        return 0.0
    return min(1.0, sum(c.weight_share(each) * c._interp(c.exposed_s, each) for c in curves) / total)


def transient_bytes(curves: Sequence[RecomputeCurve], kept: float) -> int:
    """Bytes a block's backward brings back on top of what the stage keeps: the largest block's
    full activations minus its share of ``kept`` (blocks assumed to keep equal shares, exact for
    identical blocks). 0 without blocks."""
    if not curves:
        return 0
    return int(max(0.0, max(c.max_bytes for c in curves) - kept / len(curves)))


def allocate_with_transient(curves: Sequence[RecomputeCurve], room: float) -> tuple[int, float, bool, int]:
    """``allocate`` under ``kept + transient_bytes(kept) <= room``: start from the largest
    transient (every block at its least), then shrink it to what the allocation leaves,
    re-allocating the freed bytes, a few rounds. Every round's (kept, transient) pair satisfies
    the constraint with the transient it was allocated under, which is never below the one it
    implies."""
    transient = transient_bytes(curves, sum(c.min_bytes for c in curves))
    kept, exposed, fits = allocate(curves, room - transient)
    for _ in range(8):
        if not fits:
            break
        implied = transient_bytes(curves, kept)
        if implied >= transient - 1:
            break
        transient = implied
        kept, exposed, fits = allocate(curves, room - transient)
    return kept, exposed, fits, transient


def allocate(curves: Sequence[RecomputeCurve], room: float) -> tuple[int, float, bool]:
    """Split ``room`` kept bytes between blocks minimizing summed exposed recompute.

    Returns (kept bytes, exposed seconds, fits). Greedy over hull segments by seconds saved per
    byte: exact for convex piecewise-linear curves (a fractional last segment interpolates)."""
    hulls = [c.hull() for c in curves]
    kept = sum(h[0][0] for h in hulls)
    exposed = sum(h[0][1] for h in hulls)
    if kept > room:
        return kept, exposed, False
    steps = []
    for h in hulls:
        for (x0, y0), (x1, y1) in zip(h, h[1:]):
            steps.append(((y0 - y1) / (x1 - x0), x1 - x0, y0 - y1))
    steps.sort(key=lambda t: -t[0])  # convexity keeps each hull's segments in order
    left = room - kept
    for _, dx, dy in steps:
        if left <= 0:
            break
        take = min(1.0, left / dx)
        kept += int(dx * take)
        exposed -= dy * take
        left -= dx * take
    return int(kept), max(0.0, exposed), True

