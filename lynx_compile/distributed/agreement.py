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

import contextlib
import contextvars
import hashlib
import json
from typing import Any, Iterator, Mapping

from lynx_compile.recompute_plan import RecomputePlan

WORLD = "world"
"""Planning group sentinel: every rank of the default group compiles this same graph."""
SOLO = "solo"
"""Planning group sentinel: this rank alone compiles this graph (e.g. a pipeline stage)."""
_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("lynx_planning_group", default=WORLD)


@contextlib.contextmanager
def planning_group(group: Any) -> Iterator[None]:
    """Ranks that compile the same graphs as this one, while planning inside the block:
    ``WORLD`` (default), ``SOLO``, or a process group (a pipeline stage's tensor-parallel group).
    Rank-0 values, plan agreement and link calibration are collectives over it, so ranks that
    compile *different* graphs (pipeline stages) never wait for each other while planning."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def current_planning_group() -> Any:
    """The group (``None`` = WORLD) planning collectives run over, or ``SOLO``."""
    g = _GROUP.get()
    return None if g is WORLD else g


def planning_world_size() -> int:
    import torch.distributed as dist

    g = current_planning_group()
    if g is SOLO or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(g)


class PlanMismatchError(RuntimeError):
    """Ranks planned the same graph differently; running it would deadlock or diverge."""


def plan_fingerprint(plan: RecomputePlan, positions: Mapping[str, int] | None = None) -> str:
    """sha256 (16 hex digits) of what the plan makes the graph *do*: policy, graph hash, saved
    and recomputed tensors, per-unit decisions. Timings and notes are left out.

    With ``positions`` (node name -> its place in the joint graph) a node is named by its place:
    ranks can trace the same graph (equal structural hash: the same ops, shapes and order) with
    its nodes numbered apart, and then agree when their plans save and recompute the same places
    (torchtitan's deepseek_v3 under TP on gloo: the MoE block's ``getitem_30`` on rank 0 is
    ``getitem_31`` on rank 1; its names made every run stop with ``PlanMismatchError``)."""
    def canonical(x: Any) -> Any:
        if positions is None:
            return x
        if isinstance(x, str):
            return f"#{positions[x]}" if x in positions else x
        if isinstance(x, dict):
            return {canonical(k): canonical(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [canonical(v) for v in x]
        return x

    body = {"policy": plan.policy, "graph": plan.graph_hash,
            "saved": [d.name for d in plan.saved], "recomputed": [d.name for d in plan.recomputed],
            "decisions": plan.decisions.to_dict()["units"]}
    return hashlib.sha256(json.dumps(canonical(body), sort_keys=True).encode()).hexdigest()[:16]


def check_plan_agreement(plan: RecomputePlan, graph_id: int, group=None,
                         positions: Mapping[str, int] | None = None) -> str:
    """Collective over ``group`` (default WORLD): all ranks compare ``plan``'s fingerprint
    (its nodes named by ``positions``, see :func:`plan_fingerprint`).

    Returns the fingerprint; raises ``PlanMismatchError`` on every rank when they differ. A no-op
    (returns the fingerprint) when torch.distributed is not initialized or has one rank."""
    import torch.distributed as dist

    mine = plan_fingerprint(plan, positions)
    group = group if group is not None else current_planning_group()
    if group is SOLO or planning_world_size() < 2:
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


def gather_values(value) -> list:
    """``value`` of every rank of the planning group, in rank order (an all-gather; ``[value]``
    with one rank). Every rank must call it at the same point: it is a collective."""
    import torch.distributed as dist

    if planning_world_size() < 2:
        return [value]
    group = current_planning_group()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, value, group=group)
    return everyone


def rank0_value(value):
    """``value`` as rank 0 has it, on every rank (a broadcast; identity with one rank).

    Planning inputs that are *measured* (the calibrated CPU profile, measured node costs) differ
    slightly per rank; planning from rank 0's copy everywhere keeps the plans identical."""
    import torch.distributed as dist

    if planning_world_size() < 2:
        return value
    group = current_planning_group()
    box = [value]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
