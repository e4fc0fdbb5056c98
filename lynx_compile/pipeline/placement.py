"""Which rank holds which pipeline stage, per schedule, and torch's class for each schedule.

Loop placement (GPipe, 1F1B, the interleaved schedules): stage ``i`` on rank ``i % ranks``, so
with 4 stages on 2 ranks rank 0 holds stages 0 and 2. V placement (``ZBVZeroBubble``, exactly
two stages per rank): rank ``r`` holds stages ``r`` and ``2 * ranks - 1 - r``, so rank 0 holds
the first and the last stage, and the two middle stages share the last rank (torch's
``generate_stage_to_rank_mapping(style="v")``)::

    loop, 4 stages / 2 ranks:  rank 0: 0 . 2 .     V, 4 stages / 2 ranks:  rank 0: 0 . . 3
                               rank 1: . 1 . 3                             rank 1: . 1 2 .

Pure (no torch): the planner and ``lynx train`` use it before anything is built.
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
