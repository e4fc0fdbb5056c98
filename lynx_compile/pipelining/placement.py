"""Which rank holds which pipeline stage, per schedule, and torch's class for each schedule.

Loop placement (GPipe, 1F1B, the interleaved schedules): stage ``i`` on rank ``i % ranks``, so
with 4 stages on 2 ranks rank 0 holds stages 0 and 2. V placement (``ZBVZeroBubble``, exactly
two stages per rank): rank ``r`` holds stages ``r`` and ``2 * ranks - 1 - r``, so rank 0 holds
the first and the last stage, and the two middle stages share the last rank (torch's
``generate_stage_to_rank_mapping(style="v")``)::

    loop, 4 stages / 2 ranks:  rank 0: 0 . 2 .     V, 4 stages / 2 ranks:  rank 0: 0 . . 3
                               rank 1: . 1 . 3                             rank 1: . 1 2 .

Also the micro-batches each stage holds in flight under each schedule (``in_flight``), which
the stage planner budgets. Pure (no torch): the planner and ``lynx train`` use it before
anything is built.
"""
from __future__ import annotations

from functools import lru_cache

MULTI_STAGE_SCHEDULES: frozenset[str] = frozenset({"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that take a list of stages per rank (torch's ``PipelineScheduleMulti``)."""
ZERO_BUBBLE_SCHEDULES: frozenset[str] = frozenset({"InterleavedZeroBubble", "ZBVZeroBubble"})
"""Schedules that split each backward into B (input gradients) and W (weight gradients)."""


def stage_rank(schedule: str, stage: int, num_stages: int, ranks: int) -> int:
    """The rank (in the pipeline group) that holds ``stage``."""
    if schedule == "ZBVZeroBubble":
        return stage if stage < ranks else num_stages - 1 - stage
    return stage % ranks


def local_stages(schedule: str, rank: int, num_stages: int, ranks: int) -> list[int]:
    """The stages ``rank`` holds, in the order torch's schedules take them (ascending)."""
    return [i for i in range(num_stages) if stage_rank(schedule, i, num_stages, ranks) == rank]


def check_placement(schedule: str, num_stages: int, ranks: int) -> str | None:
    """Why ``num_stages`` stages cannot run on ``ranks`` ranks under ``schedule``; None if they can."""
    if num_stages % ranks:
        return f"num_stages={num_stages} is not a multiple of the pipeline group size {ranks}"
    if schedule == "ZBVZeroBubble" and num_stages != 2 * ranks:
        return (f"ZBVZeroBubble runs exactly two stages per rank in V order; use num_stages={2 * ranks} "
                f"on {ranks} ranks (got {num_stages})")
    if num_stages > ranks and schedule not in MULTI_STAGE_SCHEDULES:
        return (f"{num_stages} stages on {ranks} ranks needs one of the schedules {sorted(MULTI_STAGE_SCHEDULES)}; "
                f"{schedule} runs one stage per rank (use num_stages={ranks})")
    return None


def schedule_class(schedule: str):
    """torch.distributed.pipelining's schedule class named ``schedule``."""
    from torch.distributed import pipelining

    return {"GPipe": pipelining.ScheduleGPipe, "1F1B": pipelining.Schedule1F1B,
            "Interleaved1F1B": pipelining.ScheduleInterleaved1F1B,
            "InterleavedZeroBubble": pipelining.ScheduleInterleavedZeroBubble,
            "ZBVZeroBubble": pipelining.ScheduleZBVZeroBubble}[schedule]


@lru_cache(maxsize=64)
def zero_bubble_orders(schedule: str, ranks: int, num_stages: int,
                       num_microbatches: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, its actions under torch's ``schedule`` (``ZBVZeroBubble``,
    ``InterleavedZeroBubble``): torch's own ``pipeline_order``, bubbles dropped (a rank waits
    for its inputs anyway) and ``I`` named ``B``. Raises ValueError when torch cannot place
    ``num_stages`` stages on ``ranks`` ranks."""
    from lynx_compile import _compat

    if schedule not in ZERO_BUBBLE_SCHEDULES:
        raise ValueError(f"{schedule!r} is not a zero-bubble schedule; use one of {sorted(ZERO_BUBBLE_SCHEDULES)}")
    why = check_placement(schedule, num_stages, ranks)
    if why:
        raise ValueError(why)
    raw = _compat.pipeline_schedule_actions(schedule_class(schedule), ranks, num_stages // ranks, num_microbatches)
    return tuple(tuple(("B" if kind == "I" else kind, s, j) for kind, s, j in actions) for actions in raw)


@lru_cache(maxsize=64)
def rank_orders(schedule: str, ranks: int, num_stages: int,
                num_microbatches: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """Per rank, its actions under torch's multi-stage ``schedule`` in torch's order:
    ``zero_bubble_orders`` for the zero-bubble schedules; for ``Interleaved1F1B`` its forwards
    and whole backwards (``B``)."""
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return zero_bubble_orders(schedule, ranks, num_stages, num_microbatches)
    if schedule != "Interleaved1F1B":
        raise ValueError(f"{schedule!r} runs one stage per rank; its order is not needed")
    from lynx_compile import _compat

    why = check_placement(schedule, num_stages, ranks)
    if why:
        raise ValueError(why)
    raw = _compat.pipeline_schedule_actions(schedule_class(schedule), ranks, num_stages // ranks, num_microbatches)
    return tuple(tuple(actions) for actions in raw)


def in_flight(schedule: str, num_stages: int, num_microbatches: int, stage: int, ranks: int | None = None) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak (between a micro-batch's
    forward and its backward, B under the zero-bubble schedules; what a deferred W keeps from B,
    ``runtime.weight_split``'s carry, is counted beside it by ``stage_pricer.StagePricer.held``).

    ``ranks``: the pipeline group size (None: one stage per rank; two for ``ZBVZeroBubble``).
    - GPipe: all m. 1F1B: ``min(p - i, m)``.
    - Interleaved1F1B: priced as 1F1B over all its (virtual) stages, an approximation; its exact
      per-rank warm-up (which holds more chunks on early ranks) is not modelled.
    - ZBVZeroBubble (torch's ``_calculate_single_rank_operations``, rank r holds stages r and
      2P-1-r): rank r runs 2(P-r)-1 + r forwards of stage r before its first B there, then one
      more F before each B, so stage r holds 2P-r; stage 2P-1-r runs r forwards, then F, I, W in
      turn, so it holds r+1 = 2P-(2P-1-r). Both are ``min(num_stages - i, m)``, as 1F1B over the
      2P stages.
    - InterleavedZeroBubble: exact, by replaying torch's order of forwards and B's on the stage's
      rank (``interleaved_in_flight`` with warm-up factor 1)."""
    if schedule == "GPipe":
        return num_microbatches
    if schedule == "InterleavedZeroBubble":
        ranks = ranks or num_stages
        per_rank = interleaved_in_flight(ranks, num_stages // ranks, num_microbatches, stage % ranks, 1)
        return per_rank[stage // ranks]
    return min(num_stages - stage, num_microbatches)


def interleaved_in_flight(ranks: int, local: int, num_microbatches: int, rank: int, warmup_factor: int) -> list[int]:
    """Peak micro-batches in flight (forward done, backward not) on each of ``rank``'s ``local``
    stages under torch's interleaved schedules (``_get_warmup_ops`` / ``_get_1f1b_rank_ops``):
    ``warmup`` forwards, then one forward and one backward per step, then the remaining
    backwards; forwards walk the local stages in rounds of ``mpr`` micro-batches from the first,
    backwards from the last. ``warmup_factor``: 2 for Interleaved1F1B, 1 for InterleavedZeroBubble."""
    m, v = num_microbatches, local
    mpr = m // max(1, m // ranks)  # micro-batches per round
    warmup = min((v - 1) * mpr + warmup_factor * (ranks - 1 - rank), m * v)
    held, peak = [0] * v, [0] * v
    for op in range(m * v + warmup):
        if op < m * v:  # a forward
            chunk = (op // mpr) % v
            held[chunk] += 1
            peak[chunk] = max(peak[chunk], held[chunk])
        if op >= warmup:  # a backward
            held[v - 1 - ((op - warmup) // mpr) % v] -= 1
    return peak


def default_ranks(schedule: str, num_stages: int, ranks: int | None) -> int:
    """The pipeline group size: ``ranks`` when given, else one stage per rank (ZBV: two)."""
    if ranks is not None:
        return ranks
    return max(1, num_stages // 2) if schedule == "ZBVZeroBubble" else num_stages
