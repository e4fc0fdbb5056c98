"""The exact reference for one per-micro-batch choice: its replayed step and each rank's peak.

``replay`` prices micro-batch j of stage s with the variant ``choice[s][j]`` picks (a
:class:`StageVariant`: F, B and W seconds, held and carried bytes), replays the ranks' actions
with ``schedule_sim.replay_actions`` and walks each rank's memory. The MILP of
``microbatch_milp`` is built from the same walk, and ``microbatch_plan`` reports ``replay``'s
numbers, never the MILP's.

Memory walk of one rank (``replay`` and the MILP's rows both come from ``walk_points``): walk
its actions in order, starting from nothing alive.

- F(s, j): the micro-batch's held bytes become alive; a point is taken after it.
- B(s, j): its carry is created while its held bytes are still alive (B reads the saved
  activations and writes W's carry): a point is taken with its held bytes and the part of its
  carry B creates (``StageVariant.fresh``; the rest of the carry is held bytes W reads), then
  the held bytes W does not read die.
- W(s, j): its carry dies (no point: memory only falls).

The rank's peak is the largest sum of held, carry and fresh bytes alive at a point. Per stage,
with one variant, the pairs ``schedule_sim.held_microbatches`` returns are the counts (f, w)
just *after* each action; the B point here is that pair with the micro-batch B runs still held
and only its fresh part carried, so a stage's peak is ``max(f x held + w x carry)`` over the
after-F pairs and ``max((f + 1) x held + (w - 1) x carry + fresh)`` over the after-B ones. A
rank sums its stages point by point (not their separate maxima). It is an upper bound: B frees
held bytes as it goes. Measured on 2 gloo ranks (gpt-small, 8 layers, batch 8 in 4, ZBV,
nothing recomputed), the walk plus the bytes the limit reserves (``StageVariants.reserved_bytes``)
is 15% (rank 0) and 19% (rank 1) above the allocator's peak; counting the whole carry at B, as
before, it was 28% and 26% above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .schedule_sim import Action, replay_actions

Choice = tuple[tuple[int, ...], ...]
"""``choice[stage][microbatch]``: the index of the variant that micro-batch of that stage runs."""


@dataclass(frozen=True, kw_only=True)
class StageVariant:
    """One recompute plan of a stage, priced per micro-batch."""

    name: str
    """What it recomputes, e.g. ``"keep"``, ``"recompute-w"``."""
    forward_s: float
    input_backward_s: float
    """B, with the recompute B runs."""
    weight_backward_s: float
    """W, with the recompute W runs."""
    held_bytes: int
    """What one micro-batch holds between its F and its B."""
    carry_bytes: int
    """What it holds between its B and its W."""
    fresh_bytes: int | None = None
    """Of ``carry_bytes``, what its B creates while its held bytes are still alive (output
    gradients W reads; the rest of the carry is held bytes W reads); None: all of it."""

    @property
    def fresh(self) -> int:
        return self.carry_bytes if self.fresh_bytes is None else min(self.fresh_bytes, self.carry_bytes)

    def seconds(self, kind: str) -> float:
        return {"F": self.forward_s, "B": self.input_backward_s, "W": self.weight_backward_s}[kind]

    @property
    def work_s(self) -> float:
        return self.forward_s + self.input_backward_s + self.weight_backward_s


Pairs = tuple[tuple[int, int], ...]


def walk_points(order: Sequence[Action]) -> list[tuple[Pairs, Pairs, Pairs]]:
    """The memory walk's points of one rank (module docstring): per point, the (stage,
    micro-batch) pairs whose held bytes, whose carry bytes and whose fresh bytes (the one in B)
    are alive there."""
    held: dict[tuple[int, int], None] = {}   # ordered sets
    carry: dict[tuple[int, int], None] = {}
    points = []
    for kind, s, j in order:
        if kind == "F":
            held[s, j] = None
            points.append((tuple(held), tuple(carry), ()))
        elif kind == "B":
            points.append((tuple(held), tuple(carry), ((s, j),)))
            carry[s, j] = None
            del held[s, j]
        else:
            del carry[s, j]
    return points


def walk_peak(points, variants: Sequence[Sequence[StageVariant]], choice: Choice) -> int:
    """The most bytes alive at any of ``points`` (``walk_points``) under ``choice``."""
    def at(point) -> int:
        held, carry, fresh = point
        return (sum(variants[s][choice[s][j]].held_bytes for s, j in held)
                + sum(variants[s][choice[s][j]].carry_bytes for s, j in carry)
                + sum(variants[s][choice[s][j]].fresh for s, j in fresh))
    return max((at(pt) for pt in points), default=0)


def replay(orders: Sequence[Sequence[Action]], variants: Sequence[Sequence[StageVariant]], choice: Choice,
           send_s: Sequence[float]) -> tuple[float, tuple[int, ...]]:
    """Step seconds and per-rank peak bytes of ``choice`` (the exact reference): micro-batch j of
    stage s takes the F, B and W seconds of ``variants[s][choice[s][j]]`` under
    ``schedule_sim.replay_actions``' rules (``send_s[s]``: the transfer between stage s and s + 1
    on different ranks); peaks from the memory walk (module docstring)."""
    def seconds(action: Action) -> float:
        kind, s, j = action
        return variants[s][choice[s][j]].seconds(kind)

    step = replay_actions(orders, len(variants), seconds, send_s).step_s
    return step, tuple(walk_peak(walk_points(order), variants, choice) for order in orders)
