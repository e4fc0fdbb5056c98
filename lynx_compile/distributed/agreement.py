"""Every rank must run the same plan: compare plan fingerprints before the first step.

A plan decides which forward ops re-run in the backward and where (on demand, or inside the
window of collective w). Two ranks with different plans issue their backward collectives in a
different order relative to compute, and a rank that re-issues a forward collective the other
does not deadlocks the group (NCCL hangs; see pytorch PR #147561). Plans are deterministic
given the same graph, costs, link and solver settings, but measured costs, a MILP stopped at
its time limit, or a per-rank option can make them differ. So after planning each graph, every
rank all-gathers a fingerprint of its decisions; on a mismatch every rank raises the same
:class:`PlanMismatchError`, naming which ranks agree with which.
"""
from __future__ import annotations

import hashlib
import json

from lynx_compile.plan import RecomputePlan


class PlanMismatchError(RuntimeError):
    """Ranks planned the same graph differently; running it would deadlock or diverge."""


def plan_fingerprint(plan: RecomputePlan) -> str:
    """sha256 (16 hex digits) of what the plan makes the graph *do*: policy, graph hash, saved
    and recomputed tensors, per-unit decisions. Timings and notes are left out."""
    body = {"policy": plan.policy, "graph": plan.graph_hash,
            "saved": [d.name for d in plan.saved], "recomputed": [d.name for d in plan.recomputed],
            "decisions": sorted(plan.decisions.items())}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def check_plan_agreement(plan: RecomputePlan, graph_id: int, group=None) -> str:
    """Collective over ``group`` (default WORLD): all ranks compare ``plan``'s fingerprint.

    Returns the fingerprint; raises ``PlanMismatchError`` on every rank when they differ. A no-op
    (returns the fingerprint) when torch.distributed is not initialized or has one rank."""
    import torch.distributed as dist

    mine = plan_fingerprint(plan)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return mine
    everyone: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if len(set(everyone)) > 1:
        by_hash: dict[str, list[int]] = {}
        for rank, h in enumerate(everyone):
            by_hash.setdefault(str(h), []).append(rank)
        groups = "; ".join(f"ranks {r} planned {h}" for h, r in by_hash.items())
        raise PlanMismatchError(
            f"lynx: ranks disagree on the recompute plan of graph {graph_id} ({groups}); running "
            "it would deadlock the collectives. Make planning identical on every rank: use "
            "cost_source='analytic' (not 'measured'), the same options and memory_budget on every "
            "rank, a solver that finishes within time_limit_s (or solver='heu'), or plan once "
            "with `lynx plan --out plan.json` and pass plan='plan.json' on every rank.")
    return mine


def rank0_value(value):
    """``value`` as rank 0 has it, on every rank (a broadcast; identity with one rank).

    Planning inputs that are *measured* (the calibrated CPU profile, measured node costs) differ
    slightly per rank; planning from rank 0's copy everywhere keeps the plans identical."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
