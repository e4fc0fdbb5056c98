"""Replay one pipeline step (one stage per rank) from per-stage times; return its length.

Each rank runs its stage's actions in the schedule's order (``schedule_order``): ``F j``
(forward of micro-batch j) waits for the previous stage's ``F j`` plus the point-to-point send;
``B j`` waits for the next stage's ``B j`` plus the send of the gradient (the last stage starts
its backward right after its own forward: the loss is local). A rank does one action at a time.

Recompute ``R j`` is the stage's exposed recompute for micro-batch j. Without
*recompute-in-wait* it runs inside ``B j``, after the gradient arrived. With it, ``R j`` needs no
gradient, so it starts as soon as the rank is free and the gradient wait overlaps it::

    rank i:   ... F | wait for grad j ......... | R j | B j |        (on demand)
    rank i:   ... F | R j | wait for grad j ... | B j |              (recompute in the wait)

Interleaved and zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble) are priced as 1F1B
over all their stages (one stage per rank, the backward whole); the simulation of their
virtual-stage order, and of the W actions that fill a zero-bubble schedule's bubbles, is not built.
"""
from __future__ import annotations

from typing import Sequence


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


def simulate_stages(stages, costs, schedule: str, num_microbatches: int, *, recompute_in_wait: bool) -> float:
    """``simulate_pipeline`` for a ``StagePlan``'s stages priced from ``PipelineCosts``."""
    p = len(stages)
    fwd, bwd, rec, send = [], [], [], []
    for st in stages:
        s, e = st.blocks
        segs = list(costs.blocks[s:e]) + ([costs.pre] if st.index == 0 else []) + \
            ([costs.post] if st.index == p - 1 else [])
        fwd.append(sum(g.forward_s for g in segs))
        bwd.append(sum(g.backward_s for g in segs))
        rec.append(st.recompute_s)
        send.append(costs.p2p_s(costs.blocks[e - 1].output_bytes) if st.index < p - 1 else 0.0)
    return simulate_pipeline(fwd, bwd, rec, send, schedule, num_microbatches, recompute_in_wait=recompute_in_wait)
