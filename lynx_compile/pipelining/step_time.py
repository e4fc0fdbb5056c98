"""A stage plan's step time: each stage priced from ``PipelineCosts`` and replayed by
``schedule_sim`` (``simulate_pipeline`` for GPipe / 1F1B, ``simulate_actions`` over
torch's own order for the zero-bubble schedules, with each backward split into B and W)."""
from __future__ import annotations

from .placement import ZERO_BUBBLE_SCHEDULES, zero_bubble_orders
from .schedule_sim import simulate_actions, simulate_pipeline

WEIGHT_SHARE = 0.5
"""Share of a segment's ``backward_s`` taken as weight gradients when its cost gives none: in a
transformer block the weight-gradient matmuls are 24Bsh^2 of the backward's 48Bsh^2 + 8Bs^2h
FLOPs (each linear's backward is two matmuls of its forward's size, one of them W; attention's
score matmuls have no weights), 3h / (6h + s), 0.47 for GPT-13B at s = 2048."""


def stage_times(stages, costs) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage of a ``StagePlan``, priced from ``PipelineCosts``: forward and backward seconds,
    the backward's weight-gradient part (``SegmentCost.weight_backward_s``, else
    ``WEIGHT_SHARE`` of its backward), and the send to the next stage."""
    p = len(stages)
    fwd, bwd, wgt, send = [], [], [], []
    for st in stages:
        s, e = st.blocks
        segs = list(costs.blocks[s:e]) + ([costs.pre] if st.index == 0 else []) + \
            ([costs.post] if st.index == p - 1 else [])
        fwd.append(sum(g.forward_s for g in segs))
        bwd.append(sum(g.backward_s for g in segs))
        wgt.append(sum(WEIGHT_SHARE * g.backward_s if g.weight_backward_s is None else g.weight_backward_s
                       for g in segs))
        send.append(costs.p2p_s(costs.blocks[e - 1].output_bytes) if st.index < p - 1 else 0.0)
    return fwd, bwd, wgt, send


def simulate_stages(stages, costs, schedule: str, num_microbatches: int, *, recompute_in_wait: bool,
                    ranks: int) -> float:
    """Step time of a ``StagePlan``'s stages priced from ``PipelineCosts``: ``simulate_actions``
    over torch's order for the zero-bubble schedules (``ranks``: the pipeline group size), else
    ``simulate_pipeline``. Each stage's exposed recompute (``StageInfo.recompute_s``) runs in B,
    except, under the zero-bubble schedules, the part only W needs (``StageInfo.recompute_w_s``),
    which runs in W."""
    fwd, bwd, wgt, send = stage_times(stages, costs)
    rec = [st.recompute_s for st in stages]
    if schedule in ZERO_BUBBLE_SCHEDULES:
        orders = zero_bubble_orders(schedule, ranks, len(stages), num_microbatches)
        rec_w = [st.recompute_w_s for st in stages]
        return simulate_actions(orders, fwd, [b - w for b, w in zip(bwd, wgt)], wgt, send,
                                recompute_b_s=[r - w for r, w in zip(rec, rec_w)], recompute_w_s=rec_w,
                                recompute_in_wait=recompute_in_wait).step_s
    return simulate_pipeline(fwd, bwd, rec, send, schedule, num_microbatches, recompute_in_wait=recompute_in_wait)
