"""``device_budget`` in a step of compiled pieces: what the device holds besides the step as the
recorded step starts (parameters, gradients, the optimizer's state created by the first
``optimizer.step()``, after the pieces compiled), and the whole graphs' plans checked again
against it."""
from __future__ import annotations

import logging
from typing import Any

import torch

from lynx_compile.budget import budget_error, format_bytes
from lynx_compile.decisions import BudgetError, CandidateKey
from lynx_compile.memory import optimizer_state

log = logging.getLogger("lynx_compile")


def resident_bytes(pieces: list[Any], device_type: str, step: int) -> tuple[int, str]:
    """What ``device_budget`` holds besides the step, as step ``step`` starts: CUDA's
    ``memory_allocated`` (at the first piece's forward: the embedding's output is in it);
    elsewhere the largest of the pieces' own readings (``backend.resident_bytes``) without the
    optimizer state they saw, plus the optimizer state of every piece's parameters now
    (``memory.optimizer_state``: AdamW's, created by the first ``optimizer.step()``, after the
    pieces compiled). Returns (bytes, where they were read)."""
    if device_type == "cuda":
        return int(torch.cuda.memory_allocated()), "torch.cuda.memory_allocated() as the recorded step started"
    read = [p for p in pieces if p.record.plan is not None and p.record.plan.resident_bytes is not None]
    if not read:
        return 0, "nothing read"
    best = max(read, key=lambda p: p.record.plan.resident_bytes - p.state_at_compile)
    state, what = optimizer_state.state_bytes(t for p in pieces for t in p.params())
    source = best.record.plan.resident_source.replace(optimizer_state.COUNTED_LATER, "")
    if state:
        source += f"; with the optimizer state as step {step} started ({what})"
    return best.record.plan.resident_bytes - best.state_at_compile + state, source


def recheck(pieces: list[Any], budget: Any, device_type: str, step: int) -> None:
    """As step ``step`` starts, graphs compiled whole only: ``device_budget`` checked again on
    what is resident now. The optimizer's state (AdamW: two tensors per parameter) is created by
    the first ``optimizer.step()``, after lynx read the resident bytes; a plan whose peak no
    longer fits beside it is planned again within what is left (and swapped in for this step),
    or refused naming the smallest ``device_budget`` reachable."""
    if budget is None or budget.device_nbytes is None:
        return
    resident, source = resident_bytes(pieces, device_type, step)
    room = budget.device_nbytes - resident
    for piece in pieces:
        plan = piece.record.plan
        # (the compiled code's peak: the plan's, plus what Inductor's buffer reuse held)
        if plan is None or plan.resident_bytes is None or piece.record.compiled_peak_bound <= room:
            continue
        now = budget.with_resident(resident, source)  # (a BudgetError when nothing is left)
        why = (f"what is resident grew from {format_bytes(plan.resident_bytes)} when graph "
               f"{piece.record.graph_id} compiled to {format_bytes(resident)} as step {step} started")
        try:
            piece.compiled, piece.record = piece.rebuild(piece.record, CandidateKey("plan", nbytes=room))
        except BudgetError as e:
            raise budget_error(now, plan.reference_peak_bytes, e.smallest_bytes, why) from None
        note = (f"device_budget: {why} ({source}); graph {piece.record.graph_id} planned again within the "
                f"{format_bytes(room)} left for its step (was {format_bytes(plan.peak_bytes)})")
        piece.record.notes.append(note)
        log.warning("lynx: %s", note)
