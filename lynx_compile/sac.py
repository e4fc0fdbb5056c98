"""Export a lynx plan as a ``torch.utils.checkpoint`` selective-checkpoint policy.

For users who do not compile: wrap each block in non-reentrant checkpointing with the policy
lynx planned for it (compile-time recomputation policies, applied eagerly)::

    plan = lynx_compile.planning.plan_model(model, (x,), memory_budget=0.5)[0].plan
    policies = sac_policies(plan)                       # block path -> context_fn
    for path, block in blocks:                          # e.g. ("blocks.0", model.blocks[0])
        y = checkpoint(block, y, use_reentrant=False, context_fn=policies[path])

The plan records, per block, the forward aten ops in order with lynx's decision for each
(``RecomputePlan.block_ops``). During the eager forward SAC asks the policy about every op the
block runs; the policy matches the k-th call of an op to the k-th node of that op in the plan
and answers MUST_SAVE for kept tensors and PREFER_RECOMPUTE for recomputed ones. Ops the plan
does not list, and in-place ops, are recomputed: checkpointing replays them exactly (RNG state
included), so a mismatch between the traced and the eager op stream can cost time or memory,
never correctness.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lynx_compile.recompute_plan import RecomputePlan


#: Ops that aot_autograd traces as one node but eager autograd runs as several (measured on
#: torch 2.13 CPU: ``F.dropout`` in a checkpointed block dispatches these four), with whether
#: each follows the traced op's decision. The mask buffer is filled in place, so it is never
#: cached (SAC refuses mutated cache entries); the replayed RNG regenerates it exactly.
EAGER_EXPANSIONS = {
    "aten.native_dropout.default": (("aten.empty_like.default", False), ("aten.bernoulli_.float", False),
                                    ("aten.div_.Scalar", False), ("aten.mul.Tensor", True)),
}


def _policy_for(ops: list[tuple[str, str]]) -> Callable:
    by_op: dict[str, list[str]] = defaultdict(list)
    for op, decision in ops:
        for eager_op, follows in EAGER_EXPANSIONS.get(op, ((op, True),)):
            by_op[eager_op].append(decision if follows else "recompute")
    seen: dict[tuple[bool, str], int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        key = (ctx.is_recompute, str(func))
        k = seen[key]
        seen[key] += 1
        decisions = by_op.get(str(func), [])
        decision = decisions[k % len(decisions)] if decisions else "recompute"
        if decision == "keep" and not _mutates(func):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _mutates(func) -> bool:
    """In-place ops (their schema writes an argument): SAC may not cache their outputs."""
    schema = getattr(func, "_schema", None)
    return bool(schema and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))


def sac_policies(plan: RecomputePlan) -> dict[str, Callable]:
    """Block path → ``context_fn`` for ``torch.utils.checkpoint.checkpoint``.

    Each call of a ``context_fn`` starts a fresh op counter, as one checkpointed forward (and
    its recomputation) needs."""
    if not plan.block_ops:
        raise ValueError(f"plan with policy {plan.policy!r} carries no per-op decisions; "
                         "plan with policy 'lynx' to export a checkpoint policy")

    def context_fn_for(ops):
        return lambda: create_selective_checkpoint_contexts(_policy_for(ops))

    return {path: context_fn_for(ops) for path, ops in plan.block_ops.items()}
