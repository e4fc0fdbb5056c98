"""The pipeline schedule simulator: replay one step of GPipe / 1F1B / zero-bubble actions.

The stage planners price their plans with it (``step_time``, ``stage_pricer``'s held
micro-batches, ``microbatch_replay``); ``lynx_compile.sim`` (the paper-scale training-iteration simulator)
builds on its ``schedule_order``.

Every rank runs its actions one at a time, in its list's order. ``F j`` (forward of micro-batch
j) of stage s waits for ``F j`` of stage s-1 plus the point-to-point send; ``B j`` waits for
``B j`` of stage s+1 plus the send of the gradient (the last stage's ``B j`` follows its own
``F j``: the loss is local). Two replays follow these rules:

- ``simulate_pipeline``: one stage per rank, the backward whole, in ``schedule_order`` (GPipe,
  1F1B). Interleaved1F1B is priced as 1F1B over all its stages (one stage per rank).
- ``simulate_actions``: any number of stages per rank, the backward split into ``B`` (input
  gradients, what the previous stage waits for; torch's ``I``) and ``W`` (weight gradients; ``W j``
  waits only for ``B j`` of its own stage). The zero-bubble schedules (InterleavedZeroBubble,
  ZBVZeroBubble) run this way; their per-rank lists are torch's own
  (``placement.zero_bubble_orders``; ``step_time`` prices a stage plan).
  A send between two stages on the same rank costs nothing. ``replay_actions`` is its loop,
  with each action priced on its own (``microbatch_replay``: a recompute plan per
  micro-batch).

ZBV on 2 ranks, 4 stages, 4 micro-batches (``F30``: forward of stage 3, micro-batch 0), unit
times, free sends: rank 1 starts one forward late, then neither rank ever waits; step 25 = 24
units of work + 1::

    rank 0: F00 F01 F02 F30 B30 W30 F31 B31 W31 F03 B00 W00 F32 B32 W32 B01 W01 F33 B33 W33 B02 W02 B03 W03
    rank 1:  .  F10 F20 F11 F21 B20 W20 F12 B10 W10 F22 B21 W21 F13 B11 W11 F23 B22 W22 B12 B23 B13 W12 W23 W13

Recompute ``R j`` is the stage's exposed recompute for micro-batch j. Without
*recompute-in-wait* it runs inside ``B j``, after the gradient arrived. With it, ``R j`` needs no
gradient, so it starts as soon as the rank is free and the gradient wait overlaps it::

    rank i:   ... F | wait for grad j ......... | R j | B j |        (on demand)
    rank i:   ... F | R j | wait for grad j ... | B j |              (recompute in the wait)

Under a zero-bubble schedule a stage's recompute is split as in HAL: ``recompute_b_s`` (what the
input gradients need) runs in ``B`` as above, ``recompute_w_s`` (activations only the weight
gradients read) runs inside ``W``, which never waits for another rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Action = tuple[str, int, int]
"""``(kind, stage, micro-batch)``; kind ``"F"``, ``"B"`` (input gradients) or ``"W"`` (weights)."""



def schedule_order(schedule: str, num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """Actions of one stage in the order torch's schedule runs them: [("F", j) | ("B", j)]."""
    m = num_microbatches
    if schedule == "GPipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warmup = min(m, num_stages - stage)  # as torch.distributed.pipelining.Schedule1F1B
    order = [("F", j) for j in range(warmup)]
    f = warmup
    for b in range(m):
        order.append(("B", b))
        if f < m:
            order.append(("F", f))
            f += 1
    return order


def simulate_pipeline(forward_s: Sequence[float], backward_s: Sequence[float], recompute_s: Sequence[float],
                      send_s: Sequence[float], schedule: str, num_microbatches: int, *,
                      recompute_in_wait: bool = False) -> float:
    """Step time of a pipeline whose stage i takes ``forward_s[i]`` / ``backward_s[i]`` per
    micro-batch plus ``recompute_s[i]`` of exposed recompute; ``send_s[i]`` is the transfer from
    stage i to i + 1 (activations forward, gradients back)."""
    p, m = len(forward_s), num_microbatches
    orders = [schedule_order("GPipe" if schedule == "GPipe" else "1F1B", p, m, i) for i in range(p)]
    f_end = [[None] * m for _ in range(p)]
    b_end = [[None] * m for _ in range(p)]
    pos, free = [0] * p, [0.0] * p
    done = 0
    total = sum(len(o) for o in orders)
    while done < total:
        progressed = False
        for i in range(p):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                if kind == "F":
                    if i > 0 and f_end[i - 1][j] is None:
                        break
                    ready = f_end[i - 1][j] + send_s[i - 1] if i > 0 else 0.0
                    f_end[i][j] = max(free[i], ready) + forward_s[i]
                    free[i] = f_end[i][j]
                else:
                    if i < p - 1 and b_end[i + 1][j] is None:
                        break
                    grad = b_end[i + 1][j] + send_s[i] if i < p - 1 else f_end[i][j]
                    if recompute_in_wait:
                        recomputed = free[i] + recompute_s[i]
                        b_end[i][j] = max(recomputed, grad) + backward_s[i]
                    else:
                        b_end[i][j] = max(free[i], grad) + recompute_s[i] + backward_s[i]
                    free[i] = b_end[i][j]
                pos[i] += 1
                done += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a bug in schedule_order)")
    return max(free)


@dataclass(frozen=True, kw_only=True)
class PipelineTimeline:
    """One replayed step of ``simulate_actions``."""

    step_s: float
    busy_s: tuple[float, ...]
    """Per rank: seconds spent computing (F, B, W and their recompute)."""
    events: tuple[tuple[int, str, int, int, float, float], ...]
    """``(rank, kind, stage, micro-batch, start, end)`` in the order they ran; kind ``"R"`` is
    recompute run in the gradient wait (``recompute_in_wait``), the rest as ``Action``."""

    @property
    def idle_s(self) -> tuple[float, ...]:
        """Per rank: the step's bubbles (waiting before, between and after its actions)."""
        return tuple(self.step_s - b for b in self.busy_s)

    def table(self) -> str:
        """One line per rank: busy, idle and the idle share of the step."""
        lines = [f"step {self.step_s * 1e3:.2f} ms", "rank  busy ms  idle ms  bubble"]
        for r, (b, i) in enumerate(zip(self.busy_s, self.idle_s)):
            lines.append(f"{r:>4}  {b * 1e3:7.2f}  {i * 1e3:7.2f}  {i / self.step_s if self.step_s else 0.0:6.1%}")
        return "\n".join(lines)


def simulate_actions(orders: Sequence[Sequence[Action]], forward_s: Sequence[float],
                     input_backward_s: Sequence[float], weight_backward_s: Sequence[float],
                     send_s: Sequence[float], *, recompute_b_s: Sequence[float] | None = None,
                     recompute_w_s: Sequence[float] | None = None,
                     recompute_in_wait: bool = False) -> PipelineTimeline:
    """Replay ``orders`` (per rank, its ``Action`` list; every stage's F, B and W of every
    micro-batch exactly once) with stage s taking ``forward_s[s]`` / ``input_backward_s[s]`` /
    ``weight_backward_s[s]`` per micro-batch, plus ``recompute_b_s[s]`` exposed inside B and
    ``recompute_w_s[s]`` inside W (module docstring); ``send_s[s]`` is the transfer between
    stage s and s + 1 when they sit on different ranks. Every micro-batch of a stage costs the
    same; ``replay_actions`` prices each action on its own."""
    p = len(forward_s)
    rec_b = list(recompute_b_s) if recompute_b_s is not None else [0.0] * p
    rec_w = list(recompute_w_s) if recompute_w_s is not None else [0.0] * p

    def seconds(action: Action) -> float:
        kind, s, _ = action
        if kind == "F":
            return forward_s[s]
        if kind == "W":
            return rec_w[s] + weight_backward_s[s]
        return input_backward_s[s] if recompute_in_wait and rec_b[s] else rec_b[s] + input_backward_s[s]

    def before_input(action: Action) -> float:
        kind, s, _ = action
        return rec_b[s] if kind == "B" and recompute_in_wait else 0.0

    return replay_actions(orders, p, seconds, send_s, before_input=before_input)


def replay_actions(orders: Sequence[Sequence[Action]], num_stages: int, seconds: Callable[[Action], float],
                   send_s: Sequence[float], *,
                   before_input: Callable[[Action], float] | None = None) -> PipelineTimeline:
    """Replay ``orders`` (as ``simulate_actions``) with action a taking ``seconds(a)`` once its
    input is there, after ``before_input(a)`` seconds of work that needs no input (recompute in
    the gradient wait, an ``"R"`` event; default none): it starts when the rank is free and
    overlaps the wait. Dependencies: F of stage s waits for F of s - 1, B for B of s + 1 (the
    last stage's for its own F), W for its own B; ``send_s[min(src, dst)]`` is added between
    stages on different ranks. The one replay loop behind every per-action pricing."""
    p = num_stages
    rank_of = _check_orders(orders, p)
    end: dict[Action, float] = {}

    def arrival(kind: str, src: int, dst: int, j: int) -> float | None:
        done = end.get((kind, src, j))
        if done is None:
            return None
        return done + (0.0 if rank_of[src] == rank_of[dst] else send_s[min(src, dst)])

    def ready(kind: str, s: int, j: int) -> float | None:
        if kind == "F":
            return 0.0 if s == 0 else arrival("F", s - 1, s, j)
        if kind == "B":
            return end.get(("F", s, j)) if s == p - 1 else arrival("B", s + 1, s, j)
        return end.get(("B", s, j))

    pos, free, busy = [0] * len(orders), [0.0] * len(orders), [0.0] * len(orders)
    events: list[tuple[int, str, int, int, float, float]] = []
    left = sum(len(o) for o in orders)
    while left:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                action = order[pos[r]]
                kind, s, j = action
                t = ready(kind, s, j)
                if t is None:
                    break
                early = before_input(action) if before_input is not None else 0.0
                if early:
                    events.append((r, "R", s, j, free[r], free[r] + early))
                    start = max(free[r] + early, t)
                else:
                    start = max(free[r], t)
                work = seconds(action)
                end[action] = free[r] = start + work
                busy[r] += work + early
                events.append((r, kind, s, j, start, free[r]))
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked: an action waits for one that its rank runs later")
    return PipelineTimeline(step_s=max(free), busy_s=tuple(busy), events=tuple(events))


def held_microbatches(orders: Sequence[Sequence[Action]]) -> dict[int, tuple[tuple[int, int], ...]]:
    """Per stage, what its memory holds as its rank runs ``orders``: after each of the stage's
    actions, ``(f, w)`` = micro-batches between their F and their B (activations kept) and
    between their B and their W (W's carry, ``runtime.weight_split``). A stage's actions all run
    on one rank, in that rank's order, so the counts are exact whatever the timing. Returned are
    the pairs no other pair of the stage dominates (both counts at least as large), largest
    ``f`` first: the peak of ``f x kept + w x carry`` for any non-negative sizes is at one of
    them, so it is the joint maximum over the step, not the sum of the two counts' maxima::

        stage 1 of ZBV, 2 ranks, 4 micro-batches (rank 1: F10 F20 F11 F21 B20 W20 F12 B10 ...):
        F10 (1,0) F11 (2,0) F12 (3,0) B10 (2,1) W10 (2,0) F13 (3,0) B11 (2,1) W11 (2,0)
        B12 (1,1) B13 (0,2) W12 (0,1) W13 (0,0)                 -> ((3, 0), (2, 1), (0, 2))
    """
    held: dict[int, list[int]] = {}
    seen: dict[int, set[tuple[int, int]]] = {}
    for order in orders:
        for kind, s, _ in order:
            f, w = held.setdefault(s, [0, 0])
            f, w = {"F": (f + 1, w), "B": (f - 1, w + 1), "W": (f, w - 1)}[kind]
            held[s] = [f, w]
            seen.setdefault(s, set()).add((f, w))
    out = {}
    for s, pairs in seen.items():
        top = [p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pairs)]
        out[s] = tuple(sorted(top, reverse=True))
    return out


def _check_orders(orders: Sequence[Sequence[Action]], p: int) -> dict[int, int]:
    """Each stage's rank; raises ValueError unless every (kind, stage, micro-batch) appears once
    and each stage's actions sit on one rank."""
    rank_of: dict[int, int] = {}
    seen: set[Action] = set()
    for r, order in enumerate(orders):
        for action in order:
            kind, s, j = action
            if kind not in ("F", "B", "W") or not 0 <= s < p or action in seen or rank_of.setdefault(s, r) != r:
                raise ValueError(f"action {action} on rank {r}: unknown kind, stage out of range, repeated, "
                                 "or a stage on two ranks")
            seen.add(action)
    mbs = {j for _, _, j in seen}
    if len(seen) != 3 * p * len(mbs):
        raise ValueError(f"the orders hold {len(seen)} actions, not F, B and W of {p} stages x "
                         f"{len(mbs)} micro-batches")
    return rank_of
