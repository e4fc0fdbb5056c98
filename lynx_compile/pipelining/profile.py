"""``profile_pipeline``: the :class:`PipelineCosts` of a model, from one plan-only lynx trace.

The whole model (one micro-batch) is traced by a plan-only lynx backend: its joint graph gives
per-block forward / backward seconds (the cost model: analytic or measured) and its
``RematProblem`` (the units each block could keep or recompute). Each block's recompute curve
comes from Lynx-HEU solves of that problem at a ladder of budgets: at each budget, the bytes a
block keeps and the seconds of its recompute left on the critical path (recompute the plan
hides in communication windows counts as free).

Two more passes over the model complete the costs, each in its own module:
``forward_census`` (one forward: each segment's parameter bytes, by module path and call order,
and the weight-gradient share of its backward, ``SegmentCost.weight_backward_s``) and
``weight_split_census`` (the traced backward: the bytes a micro-batch holds from B to W,
``SegmentCost.carry_bytes``; only when the stages split B from W).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .forward_census import forward_census
from .pipeline_costs import PipelineCosts, SegmentCost
from .recompute_curve import RecomputeCurve
from .weight_split_census import weight_split_census

log = logging.getLogger("lynx_compile")
BUDGET_LADDER = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1)


def profile_pipeline(module: nn.Module, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                     *, state_bytes_per_param_byte: float = 4.0) -> tuple[PipelineCosts, list[str]]:
    """Costs of ``module`` (whose forward returns the tensor the last stage hands to the loss)
    for one micro-batch ``example_inputs``; also returns the block module paths in order."""
    from lynx_compile.planning import plan_model
    from lynx_compile.solver.heuristic import solve_heu
    from lynx_compile.solver.problem import InfeasibleBudget

    opts = {k: v for k, v in (options or {}).items()
            if k in ("cost_source", "hardware", "link", "measure_repeats", "windows", "compiler", "offload")}
    records = plan_model(module, tuple(example_inputs), policy="lynx", check_plan_agreement=False, **opts)
    record = records[0]
    problem, seg = record.problem, record.segment_costs
    if not record.blocks:
        raise ValueError("lynx found no transformer blocks in this model, so it cannot cut it into "
                         "pipeline stages: put the layers in an nn.ModuleList (paths like layers.3)")
    n = len(record.blocks)
    points: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    by_id = {u.id: u for u in problem.units}
    readers = _unit_readers(problem)

    def saved(keep, recomputed: set[int]) -> list[int]:
        """Per block, the bytes of the kept units a stage saves: those the backward reads, and
        those a recomputed unit reads (an intermediate no op reads otherwise is not saved)."""
        out = [0] * n
        for uid in keep:
            u = by_id[uid]
            if u.block is not None and (u.first_use is not None or any(r in recomputed for r in readers.get(uid, ()))):
                out[u.block] += u.nbytes
        return out

    full = dict(enumerate(saved([u.id for u in problem.units], set())))
    for b in range(n):
        points[b].append((full[b], 0.0))
    solutions = [None]  # per point; None: the first point, nothing recomputed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for frac in BUDGET_LADDER[1:]:
            try:
                sol = solve_heu(problem, int(frac * problem.reference_peak))
            except InfeasibleBudget:
                break
            solutions.append(sol)
            kept = saved(sol.keep, set(sol.demand) | {uid for uid, _ in sol.window})
            exposed = [0.0] * n
            for uid in sol.demand:
                u = by_id[uid]
                if u.block is not None:
                    exposed[u.block] += u.compute_s
            for uid in sol.offload:  # option offload: on the host, not kept; its copies' exposed time
                u = by_id[uid]
                if u.block is not None:
                    exposed[u.block] += u.offload_exposed_s
            for b in range(n):
                points[b].append((kept[b], exposed[b]))
    block_fw = [u.fw_pos for u in problem.units if u.block is not None]
    first_fw = min(block_fw) if block_fw else 0
    outside = [u for u in problem.units if u.block is None and u.first_use is not None]  # saved, nothing recomputed
    pre_act = sum(u.nbytes for u in outside if u.fw_pos < first_fw)
    post_act = sum(u.nbytes for u in outside if u.fw_pos >= first_fw)
    working = max(0, problem.reference_peak - sum(full.values()) - pre_act - post_act)
    params, share = forward_census(module, example_inputs, record.blocks)
    outputs = _block_output_bytes(problem, n)
    split = _splits_weights(options or {})
    carry, carry_saved, w_only, read_in_b = (weight_split_census(module, example_inputs, record.blocks) if split
                                             else ([0] * (n + 1), [0] * (n + 1), frozenset(), frozenset()))
    exposed_w = (_weight_only_exposed(problem, solutions, w_only, read_in_b, n, readers) if split
                 else [[] for _ in range(n)])
    blocks = tuple(SegmentCost(
        name=path, forward_s=seg["blocks"].get(b, [0.0, 0.0])[0], backward_s=seg["blocks"].get(b, [0.0, 0.0])[1],
        weight_backward_s=share[path] * seg["blocks"].get(b, [0.0, 0.0])[1],
        param_bytes=params[path], activation_bytes=full[b],
        curve=RecomputeCurve(kept_bytes=tuple(p[0] for p in points[b]), exposed_s=tuple(p[1] for p in points[b]),
                             exposed_w_s=tuple(exposed_w[b])),
        output_bytes=outputs[b], carry_bytes=carry[b], carry_saved_bytes=carry_saved[b])
        for b, path in enumerate(record.blocks))
    pre = SegmentCost(name="<pre>", forward_s=seg["pre"][0], backward_s=seg["pre"][1],
                      weight_backward_s=share["<pre>"] * seg["pre"][1],
                      param_bytes=params["<pre>"], activation_bytes=pre_act)
    post = SegmentCost(name="<post>", forward_s=seg["post"][0], backward_s=seg["post"][1],
                       weight_backward_s=share["<post>"] * seg["post"][1],
                       param_bytes=params["<post>"], activation_bytes=post_act, carry_bytes=carry[n],
                       carry_saved_bytes=carry_saved[n])
    costs = PipelineCosts(blocks=blocks, pre=pre, post=post, working_bytes=working,
                          state_bytes_per_param_byte=state_bytes_per_param_byte,
                          p2p_bytes_per_s=_p2p_bandwidth(options or {}),
                          microbatch_size=int(example_inputs[0].shape[0]) if example_inputs else 1,
                          pinned_cuts=tuple(sorted(set(seg.get("pipe_splits", ())))), weight_split=split)
    return costs, list(record.blocks)


def _unit_readers(problem) -> dict[int, list[int]]:
    """Unit id -> the ids of the units whose recomputation reads it (``Unit.inputs`` inverted)."""
    readers: dict[int, list[int]] = {}
    for u in problem.units:
        for i in u.inputs:
            readers.setdefault(i, []).append(u.id)
    return readers


def _weight_only_exposed(problem, solutions: Sequence[Any], w_only: frozenset[str], read_in_b: frozenset[str],
                         n: int, readers: dict[int, list[int]]) -> list[list[float]]:
    """Per block, per curve point (``solutions``: the HEU solution of each, None for the first),
    the exposed recompute seconds of units only W needs: a unit whose every storage the traced
    backward reads only in W (``w_only``; none in ``read_in_b``; from ``weight_split_census``), or an intermediate
    (read by no backward op, only by recomputed units) whose every reader (``readers``,
    ``_unit_readers``) is such a unit."""
    units = {u.id: u for u in problem.units}

    def mine(keys, u) -> bool:
        return any(k == u.name or k.startswith(u.name + "[") for k in keys)

    only_w = {u.id for u in problem.units if u.first_use is not None and mine(w_only, u) and not mine(read_in_b, u)}
    changed = True
    while changed:  # intermediates whose readers are all W's
        changed = False
        for u in problem.units:
            if u.id not in only_w and u.first_use is None and readers.get(u.id) and \
                    all(r in only_w for r in readers[u.id]):
                only_w.add(u.id)
                changed = True
    out = [[] for _ in range(n)]
    for sol in solutions:
        per_block = [0.0] * n
        for uid in (sol.demand if sol is not None else ()):
            u = units[uid]
            if u.block is not None and uid in only_w:
                per_block[u.block] += u.compute_s
        for b in range(n):
            out[b].append(per_block[b])
    return out


def _splits_weights(options: dict[str, Any]) -> bool:
    """Whether stages compiled with ``options`` split B from W (``runtime.weight_split``: the
    eager compiler, or Inductor with ``weight_split``; no side stream)."""
    from lynx_compile.config import LynxConfig

    compiler = options.get("compiler", LynxConfig.__dataclass_fields__["compiler"].default)
    return (compiler == "eager" or bool(options.get("weight_split"))) and not options.get("side_stream", False)


def _block_output_bytes(problem, n: int) -> list[int]:
    """Bytes of each block's last forward unit (the activation a stage boundary would send)."""
    out = [0] * n
    last: dict[int, int] = {}
    for u in problem.units:
        if u.block is not None and u.fw_pos >= last.get(u.block, -1):
            last[u.block] = u.fw_pos
            out[u.block] = u.nbytes
    return out


def _p2p_bandwidth(options: dict[str, Any]) -> float:
    """Bandwidth of the named ``link`` option, else of the hardware profile's default link."""
    from lynx_compile.costs import LINKS, get_profile

    link = options.get("link", "auto")
    if link in LINKS:
        return LINKS[link].bandwidth_bytes_per_s
    return LINKS[get_profile(options.get("hardware", "auto")).default_link].bandwidth_bytes_per_s


def output_selector(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """For zoo-style models with ``logits(idx)``: the loss-free forward a pipeline should cut."""
