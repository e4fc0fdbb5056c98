"""Per-layer costs of a paper-scale GPT for the step simulator, from lynx's own planning trace.

``profile_layer(model, hardware=, link=, tp=, microbatch=)`` builds a two-block copy of the
model on the meta device in bf16 (no memory), shards it tensor-parallel over a *fake* process
group of ``tp`` ranks (``torch.testing._internal.distributed.fake_pg``: collectives trace but move
nothing), and plans it with lynx (``plan_model``, analytic costs on ``hardware``, collectives
priced on ``link``). Blocks are identical, so one block's numbers stand for every layer:

- ``forward_s`` / ``backward_s``: the block's compute without its collectives; ``comm_s``: its
  tensor-parallel collectives (Megatron: two all-reduces each way), from the backward windows
  of lynx's remat problem;
- one ``LayerPoint`` (bytes kept per micro-batch, exposed recompute, recompute inside each
  window, recomputed bytes live in the backward) per strategy and budget: ``none``, ``full``,
  ``selective`` (plan-only traces with those policies), ``torch`` (torch's min-cut at a ladder of
  ``activation_memory_budget``), and from lynx's remat problem solved at a ladder of budgets:
  ``lynx-heu`` (heuristic), ``lynx-opt`` (MILP, HiGHS), ``checkmate`` (MILP with the windows
  removed: optimal recompute without overlap), with the time each solve took.

Everything is JSON-serializable (``to_dict`` / ``from_dict``) so a benchmark profiles once.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from typing import Any

LADDER = 8
"""Budgets per solver: evenly spaced from the smallest reachable peak to the no-recompute one."""
TORCH_BUDGETS = (0.55, 0.7, 0.85)


@dataclass(frozen=True, kw_only=True)
class LayerPoint:
    """One layer under one recompute decision, per micro-batch."""

    label: str
    kept_bytes: int
    demand_s: float = 0.0
    """Recompute on the critical path before the layer's backward."""
    window_s: tuple[float, ...] = ()
    """Recompute inside backward collective w of the layer (empty: none)."""
    transient_bytes: int = 0
    """Recomputed bytes live during the layer's backward."""


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    model: str
    hardware: str
    link: str
    tp: int
    microbatch: int
    seq_len: int
    hidden: int
    vocab: int
    n_layers: int
    forward_s: float
    backward_s: float
    comm_s: tuple[float, ...]
    pre_s: tuple[float, float]
    post_s: tuple[float, float]
    pre_bytes: int
    """Activations the embedding keeps per micro-batch."""
    post_bytes: int
    """Activations the final norm + LM head + loss keep per micro-batch (the logits dominate)."""
    layer_param_bytes: int
    pre_param_bytes: int
    post_param_bytes: int
    points: dict[str, tuple[LayerPoint, ...]] = field(default_factory=dict)
    solve_s: dict[str, float] = field(default_factory=dict)
    """Mean seconds per solve of the layer problem, per method."""
    profile_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerProfile":
        d = dict(d)
        d["points"] = {k: tuple(LayerPoint(**{**p, "window_s": tuple(p["window_s"])}) for p in v)
                       for k, v in d["points"].items()}
        for key in ("comm_s", "pre_s", "post_s"):
            d[key] = tuple(d[key])
        return cls(**d)


def profile_layer(model: str, *, hardware: str, link: str, tp: int, microbatch: int,
                  solvers: tuple[str, ...] = ("heu", "highs")) -> LayerProfile:
    """Trace, plan and solve as in the module docstring. Needs no GPU; a few seconds each."""
    from lynx_compile.models.presets import get_config

    start = time.perf_counter()
    cfg = get_config(model)
    common = dict(hardware=hardware, link=link, check_plan_agreement=False, plan_cache=False)
    try:
        rec = _plan(model, tp, microbatch, policy="lynx", memory_budget=0.999, solver="heu", **common)
    except Exception as e:  # noqa: BLE001 - dynamo wraps the BudgetError
        from lynx_compile.compiler.dynamo_backend import find_backend_error
        from lynx_compile.decisions import BudgetError

        if find_backend_error(e, BudgetError) is None:
            raise
        # the two-block graph's peak is its working set (the embedding's gradient at a large
        # vocabulary over tp ranks), which no recompute lowers: the problem at the full peak
        rec = _plan(model, tp, microbatch, policy="lynx", memory_budget=1.0, solver="heu", **common)
    problem = rec.problem
    blocks = rec.segment_costs["blocks"]
    per_layer = len(problem.windows) // 2
    comm = tuple(w.duration_s for w in problem.windows[:per_layer])
    fw, bw = (sum(blocks[b][i] for b in (0, 1)) / 2 for i in (0, 1))
    points: dict[str, tuple[LayerPoint, ...]] = {}
    fixed = {policy: _plan(model, tp, microbatch, policy=policy, **common) for policy in ("none", "full", "selective")}
    for policy, r in fixed.items():
        points[policy] = (_policy_point(r, policy),)
    torch_points = []
    for frac in TORCH_BUDGETS:  # fractions of the two-block graph's peak; unreachable ones skipped
        try:
            r = _plan(model, tp, microbatch, policy="torch", memory_budget=frac, **common)
        except Exception as e:  # noqa: BLE001 - dynamo wraps the BudgetError
            from lynx_compile.compiler.dynamo_backend import find_backend_error
            from lynx_compile.decisions import BudgetError

            if find_backend_error(e, BudgetError) is None:
                raise
            continue
        torch_points.append(_policy_point(r, f"torch@{frac}"))
    points["torch"] = tuple(torch_points)
    solve_s: dict[str, float] = {}
    for name, solver, windows in (("lynx-heu", "heu", True), ("lynx-opt", "highs", True),
                                  ("checkmate", "highs", False), ("lynx-opt-glpk", "glpk", True)):
        if solver not in solvers and name != "lynx-heu":
            continue
        pts, secs = _ladder(problem if windows else dataclasses.replace(problem, windows=()), solver, per_layer)
        if name != "lynx-opt-glpk":
            points[name] = pts
        solve_s[name] = secs
    base = points["none"][0].kept_bytes
    outside = max(0, fixed["none"].plan.saved_bytes - 2 * base)
    h, s, V = cfg.hidden, cfg.seq_len, cfg.vocab_size
    pre_bytes = microbatch * s * h * 2
    return LayerProfile(
        model=model, hardware=hardware, link=link, tp=tp, microbatch=microbatch, seq_len=s, hidden=h,
        vocab=V, n_layers=cfg.n_layers, forward_s=max(fw - sum(comm), 0.0), backward_s=max(bw - sum(comm), 0.0),
        comm_s=comm, pre_s=tuple(rec.segment_costs["pre"]), post_s=tuple(rec.segment_costs["post"]),
        pre_bytes=pre_bytes, post_bytes=max(outside - pre_bytes, 0),
        layer_param_bytes=2 * (12 * h * h // tp + 13 * h), pre_param_bytes=2 * (V + s) * h,
        post_param_bytes=2 * (V * h + 2 * h), points=points, solve_s=solve_s,
        profile_s=time.perf_counter() - start)


def plan_search_time(model: str, *, hardware: str, link: str, tp: int, solver: str,
                     memory_budget: float = 0.6) -> dict[str, float]:
    """lynx's own plan of the whole ``model`` (every layer; micro-batch 1) on ``tp`` fake ranks:
    the seconds inside the solver and for the whole planning step (extract, solve, check), as a
    user pays them at compile time. Needs no GPU."""
    start = time.perf_counter()
    rec = _plan(model, tp, 1, layers=None, policy="lynx", memory_budget=memory_budget, solver=solver,
                hardware=hardware, link=link, check_plan_agreement=False, plan_cache=False)
    return {"solve_s": rec.plan.solve_s, "plan_time_s": rec.plan.plan_time_s,
            "trace_and_plan_s": time.perf_counter() - start, "budget": memory_budget,
            "status": rec.plan.solver_status, "notes": list(rec.plan.notes)}


def _plan(model: str, tp: int, microbatch: int, layers: int | None = 2, **options):
    """The lynx record of a ``layers``-block copy of ``model`` (None: all) sharded over ``tp``
    fake ranks."""
    import torch

    from lynx_compile.models.presets import build_model, example_batch
    from lynx_compile.planning import plan_model

    group = _fake_group(tp)
    torch.manual_seed(0)
    depth = {} if layers is None else {"n_layers": layers}
    net = build_model(model, device="meta", dtype=torch.bfloat16, dropout=0.0, **depth)
    if tp > 1:
        from lynx_compile.distributed.tensor_parallel import tensor_parallelize

        tensor_parallelize(net, group)
    x = example_batch(net, microbatch).to("meta")
    return plan_model(net, (x,), **options)[0]


def _fake_group(tp: int):
    """The default group: a fake one of ``tp`` ranks (re-created when the size differs)."""
    import torch.distributed as dist

    from lynx_compile import _compat

    if dist.is_initialized() and dist.get_world_size() != tp:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=tp, store=_compat.fake_store())
    return dist.group.WORLD


def _policy_point(rec, label: str) -> LayerPoint:
    """Block 0 of a plan made by a fixed policy."""
    plan = rec.plan
    block = next(b for b in plan.blocks if b.block == 0)
    transient = sum(t.nbytes for t in plan.recomputed if t.block == 0)
    return LayerPoint(label=label, kept_bytes=block.saved_bytes, demand_s=block.recompute_s,
                      transient_bytes=transient)


def _ladder(problem, solver: str, per_layer: int) -> tuple[tuple[LayerPoint, ...], float]:
    """Solve ``problem`` at ``LADDER`` budgets; one point per feasible budget (block 0's view of
    the two blocks, averaged) and the mean solve time."""
    from lynx_compile.solver.problem import InfeasibleBudget
    from lynx_compile.solver.solve import solve_remat

    ref = problem.reference_peak
    try:
        solve_remat(problem, 0, solver="heu")
        smallest = 0
    except InfeasibleBudget as e:
        smallest = e.smallest
    points, times = [], []
    for k in range(LADDER):
        budget = int(smallest + (ref - smallest) * k / (LADDER - 1))
        try:
            t0 = time.perf_counter()
            sol = solve_remat(problem, max(budget, smallest), solver=solver, time_limit_s=60.0)
            times.append(time.perf_counter() - t0)
        except InfeasibleBudget:
            continue
        points.append(_solution_point(problem, sol, per_layer, f"{solver}@{k}"))
    return tuple(points), sum(times) / max(len(times), 1)


def _solution_point(problem, sol, per_layer: int, label: str) -> LayerPoint:
    units = {u.id: u for u in problem.units}
    blocks = sorted({u.block for u in problem.units if u.block is not None})
    n = max(len(blocks), 1)
    kept = sum(units[i].nbytes for i in sol.keep if units[i].block is not None) / n
    demand = sum(units[i].compute_s for i in sol.demand if units[i].block is not None) / n
    window = [0.0] * per_layer
    for i, w in sol.window:
        if per_layer:
            window[w % per_layer] += units[i].compute_s / n
    recomputed = [i for i in sol.demand] + [i for i, _ in sol.window]
    transient = sum(units[i].nbytes for i in recomputed if units[i].block is not None) / n
    return LayerPoint(label=label, kept_bytes=int(kept), demand_s=demand,
                      window_s=tuple(window) if any(window) else (), transient_bytes=int(transient))
