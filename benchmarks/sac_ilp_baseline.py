"""Planning-only baseline: PyTorch's own selective-activation-checkpointing MILP.

    python benchmarks/sac_ilp_baseline.py        # gpt-small, batch 4, budgets 0.3 / 0.5 / 0.7

Runs the workflow of ``torch.distributed._tools`` (see PyTorch's
``test/distributed/_tools/test_sac_ilp.py``) on a fake copy of the model:

1. one training step (two, the first only to create Adam state) under ``MemTracker``;
2. one step under ``RuntimeEstimator``; one forward under ``SACEstimator``;
3. ``aggregate_stats`` -> ``ModuleInfo`` -> ``parse_module_info`` -> ``Graph``;
4. ``sac_milp(graph, memory_budget=<GiB>, world_size=1, ac_units=<block fqns>)``.

Nothing is executed for real: all three passes run under ``FakeTensorMode`` on fake copies of
the parameters, so this only *plans* (it neither applies the plan nor measures it).

Runtime estimation on CPU. Both of PyTorch's estimate modes need CUDA:
``"operator-level-cost-model"`` asserts ``torch.cuda.is_available()`` (it reads GPU peak
FLOP/s and DRAM bandwidth) and ``"operator-level-benchmark"`` times kernels with
``torch.cuda.Event``. So on a CPU-only build (``runtime_mode="auto"`` without CUDA) this
module substitutes an operator-level roofline with the same structure as PyTorch's cost model
(FLOPs from ``torch.utils.flop_counter.flop_registry``, bytes read + written by each aten op,
view/creation ops free) but with lynx's calibrated CPU profile
(``lynx_compile.costs.hardware.get_profile("cpu")``) and lynx's ``roofline_time``. The result
reports which mode ran in ``"runtime_mode"``. On a CUDA machine ``runtime_mode="auto"`` uses
PyTorch's native ``"operator-level-cost-model"`` with the fake tensors on ``cuda``.

Dependencies (benchmark-only, imported lazily): ``pulp`` (with its bundled CBC; needed by
``sac_ilp``) and ``pwlf`` (needed by ``SACEstimator.pwlf_sac_tradeoff_curve``, which
``aggregate_stats`` calls). A missing one raises RuntimeError naming the ``pip install``.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
import time
from typing import Any, Callable

import torch

GIB = 2**30
_DEPENDENCIES = ("pulp", "pwlf")


def _require_dependencies() -> None:
    missing = [name for name in _DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        cmd = "pip install " + " ".join(missing)
        raise RuntimeError(
            f"sac_ilp_baseline needs {', '.join(missing)} (benchmark-only dependencies); "
            f"run `{cmd}` (pulp ships the CBC solver that torch's sac_milp uses)."
        )


def _default_loss(out: Any) -> torch.Tensor:
    """lynx models return ``LMOutput`` (``.loss``); plain tensors are summed."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out.sum()
    raise TypeError(f"cannot derive a scalar loss from model output of type {type(out).__name__}")


def _block_fqns(model: torch.nn.Module) -> list[str]:
    """The transformer blocks as ModTracker names them: ``<ClassName>.blocks.<i>``."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError("model has no `blocks` ModuleList; pass ac_units explicitly")
    root = type(model).__name__
    return [f"{root}.blocks.{i}" for i in range(len(blocks))]


def _fake_copy(
    model: torch.nn.Module, example_input: torch.Tensor, fake_mode: Any, device: torch.device
) -> tuple[torch.nn.Module, torch.Tensor]:
    """A structural copy of ``model`` whose parameters/buffers are fake tensors on ``device``.

    Tied parameters stay tied (``deepcopy`` memo keyed by the original tensor). Works for
    models built on ``device="meta"`` as well: only shapes, strides and dtypes are read.
    """
    memo: dict[int, Any] = {}
    with fake_mode:
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in memo:
                continue
            fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            memo[id(t)] = fake
        fake_model = copy.deepcopy(model, memo)
        fake_model.train(model.training)
        fake_input = torch.zeros(tuple(example_input.shape), dtype=example_input.dtype, device=device)
    return fake_model, fake_input


def _lynx_cpu_roofline(profile: Any = "cpu") -> Callable[..., tuple[Any, float]]:
    """A drop-in for ``RuntimeEstimator._roofline_estimate`` that needs no CUDA.

    Same op-level model as PyTorch's (``torch/distributed/_tools/runtime_estimator.py``):
    view/creation ops cost 0; otherwise max(FLOPs / peak, bytes read+written / bandwidth),
    with FLOPs from ``flop_registry`` (matmul-like ops; others are memory-bound). The peaks and
    per-op overhead come from lynx's hardware profile: a ``HardwareProfile`` or a name
    (``"cpu"`` is measured once per process, so pass the profile lynx used to compare runs).
    Returns milliseconds, as PyTorch's estimators do.
    """
    import torch.utils._pytree as pytree
    from torch.utils._runtime_estimation import _IGNORE_OPS, get_num_bytes
    from torch.utils.flop_counter import flop_registry

    from lynx_compile.costs.analytic import roofline_time
    from lynx_compile.costs.hardware import get_profile

    if isinstance(profile, str):
        profile = get_profile(profile)

    def estimate(func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _IGNORE_OPS:
            return out, 0.0
        flat_in = pytree.tree_leaves((args, kwargs))
        flat_out = pytree.tree_leaves(out)
        nbytes = sum(get_num_bytes(t) for t in (*flat_in, *flat_out) if isinstance(t, torch.Tensor))
        flops, dtype = 0, torch.float32
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            floats = [t.dtype for t in flat_out if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
            dtype = floats[0] if floats else torch.float32
        seconds = roofline_time(flops, nbytes, profile.peak_flops_for(dtype, matmul=True), profile)
        return out, seconds * 1e3

    return estimate


def collect_graph(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    *,
    loss_fn: Callable[[Any], torch.Tensor] = _default_loss,
    runtime_mode: str = "auto",
    device: str | torch.device | None = None,
    with_optimizer: bool = True,
    profile: Any = "cpu",
) -> tuple[Any, str]:
    """Run the three torch trackers on a fake copy and return ``(Graph, runtime_mode_used)``.

    ``runtime_mode``: ``"auto"`` (native cost model when CUDA is available, else the lynx CPU
    roofline), ``"lynx-cpu-roofline"``, or one of PyTorch's ``"operator-level-cost-model"`` /
    ``"operator-level-benchmark"`` (both need CUDA). ``profile``: lynx hardware profile (or
    name) for the CPU roofline.
    """
    import torch.distributed._tools.ilp_utils as ilp_utils
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _ModState
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator
    from torch.distributed._tools.sac_estimator import SACEstimator

    native = ("operator-level-cost-model", "operator-level-benchmark")
    if runtime_mode == "auto":
        runtime_mode = native[0] if torch.cuda.is_available() else "lynx-cpu-roofline"
    if device is None:
        device = "cuda" if runtime_mode in native else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cpu_estimate = _lynx_cpu_roofline(profile) if runtime_mode == "lynx-cpu-roofline" else None
    if cpu_estimate is None and runtime_mode not in native:
        raise ValueError(f"unknown runtime_mode {runtime_mode!r}")

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel, finp = _fake_copy(model, example_input, fake_mode, device)
    with fake_mode:
        opt = torch.optim.Adam(fmodel.parameters(), lr=1e-3) if with_optimizer else None

        def step() -> torch.Tensor:
            loss = loss_fn(fmodel(finp))
            loss.backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                fmodel.zero_grad(set_to_none=True)
            return loss

        # 1. memory: run twice (the first creates optimizer state), keep the second's stats
        mem_tracker = MemTracker()
        mem_tracker.track_external(fmodel, *([opt] if opt is not None else []))
        last_snapshot = None
        with mem_tracker as mt:
            for it in range(2):
                loss = loss_fn(fmodel(finp))
                loss.backward()
                if it == 1:
                    last_snapshot = mt.get_tracker_snapshot("current")
                if opt is not None:
                    opt.step()
                    opt.zero_grad()
                else:
                    fmodel.zero_grad(set_to_none=True)
                if it == 0:
                    mt.reset_mod_stats()
        if last_snapshot is None:
            raise RuntimeError("MemTracker produced no snapshot")
        # as in torch's test: modules whose inputs need no grad get no post-backward hook
        for mod_stats in mem_tracker.memory_tracking.values():
            if _ModState.POST_BW not in mod_stats.snapshots:
                mod_stats.snapshots.setdefault(_ModState.POST_BW, []).append(copy.deepcopy(last_snapshot))

        # 2. runtime of one step (after a warm-up step, as in torch's test)
        step()
        runtime_estimator = RuntimeEstimator()
        if cpu_estimate is not None:
            runtime_estimator._estimate = cpu_estimate
            runtime_estimator._estimate_mode_type = runtime_mode
            ctx = runtime_estimator
        else:
            ctx = runtime_estimator(estimate_mode_type=runtime_mode)
        with contextlib.redirect_stdout(sys.stderr), ctx:
            step()

        # 3. SAC trade-off per non-leaf module (forward only; backward outside the mode)
        sac_estimator = SACEstimator()
        if cpu_estimate is not None:
            sac_estimator._estimate_runtime = cpu_estimate
            sac_ctx = sac_estimator
        else:
            sac_ctx = sac_estimator(estimate_mode_type=runtime_mode)
        with sac_ctx:
            loss = loss_fn(fmodel(finp))
        loss.backward()

        # aggregate_stats fits the trade-off curves with pwlf, whose differential evolution
        # draws from numpy's global RNG: seed it (and restore it) so plans are repeatable
        import numpy as np

        rng_state = np.random.get_state()
        np.random.seed(0)
        try:
            mod_info = ilp_utils.aggregate_stats(fmodel, mem_tracker, runtime_estimator, sac_estimator, device)
        finally:
            np.random.set_state(rng_state)
    return ilp_utils.parse_module_info(mod_info), runtime_mode


def plan_from_graph(
    graph: Any, budget_fraction: float, ac_units: list[str], budget_basis: str = "total"
) -> dict:
    """Solve ``sac_milp`` on a copy of ``graph`` at ``budget_fraction`` of its no-AC peak.

    ``budget_basis="total"``: budget = fraction * baseline peak (params + grads + activations).
    ``"activations"``: budget = params + fraction * (baseline peak - params), i.e. the fraction
    applies to what sits above the parameters at the peak (activations, activation grads and
    any grads accumulated there), closer to lynx's "fraction of peak activation memory".
    """
    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline
    from torch.distributed._tools.sac_ilp import sac_milp

    graph = copy.deepcopy(graph)  # sac_milp edits node stats in place
    baseline_peak, compute_ms = get_peak_memory_runtime_baseline(graph)
    params = graph.nodes[0]["param_per_module"]
    if budget_basis == "total":
        budget_bytes = budget_fraction * baseline_peak
    elif budget_basis == "activations":
        budget_bytes = params + budget_fraction * (baseline_peak - params)
    else:
        raise ValueError(f"budget_basis must be 'total' or 'activations', got {budget_basis!r}")
    t0 = time.perf_counter()
    discard, recompute_ms, peak_bound = sac_milp(
        graph, memory_budget=budget_bytes / GIB, world_size=1, ac_units=ac_units
    )
    plan_s = time.perf_counter() - t0
    root = graph.nodes[0]
    param_grad = root["param_per_module"] + root["grad_per_module"]
    feasible = peak_bound != -1
    discard_bytes, predicted_peak = _solution_memory(graph, discard) if feasible else ({}, -1)
    return {
        "plan_s": plan_s,
        "discard": dict(discard),
        "recompute_s": recompute_ms / 1e3,
        "peak_bytes_bound": int(peak_bound),
        "baseline_peak_bytes": int(baseline_peak),
        "status": "ok" if feasible else "infeasible: sac_milp found no solution under the budget",
        "budget_bytes": int(budget_bytes),
        "predicted_peak_bytes": predicted_peak,
        "discard_bytes": discard_bytes,
        "param_grad_bytes": int(param_grad),
        "baseline_step_s": compute_ms / 1e3,
    }


def _solution_memory(graph: Any, discard: dict[str, float]) -> tuple[dict[str, int], int]:
    """Bytes each AC unit frees and the peak ``max_i m_i`` that ``sac_milp``'s own memory
    constraints give for its solution (``peak_bytes_bound`` is only the variable ``max_m``,
    which the solver may leave anywhere between this and the budget)."""
    d = [0.0] * len(graph.nodes)
    freed: dict[str, int] = {}
    for node in graph.nodes:
        if node["fqn"] in discard:
            acm, ia = node["sac_memory"], node["act_fw_per_module"]
            d[node["index"]] = acm * discard[node["fqn"]] - (acm - ia)
            freed[node["fqn"]] = round(d[node["index"]])
    p1 = graph.nodes[0]["param_per_module"]
    peak = 0.0
    for node in graph.nodes:
        before = sum(d[graph.name2node[f]["index"]] for f in graph.fw_post_order[: node["pos_fw_post_order"]])
        act = node["act_total"] + node["act_grad_per_module"] - before
        peak = max(peak, act + p1 + node["grad_total"])
    return freed, round(peak)


def plan_with_sac_ilp(
    model: torch.nn.Module,
    example_input: torch.Tensor,
    budget_fraction: float,
    *,
    loss_fn: Callable[[Any], torch.Tensor] = _default_loss,
    ac_units: list[str] | None = None,
    runtime_mode: str = "auto",
    profile: Any = "cpu",
    budget_basis: str = "total",
) -> dict:
    """Plan SAC for ``model`` with PyTorch's ``sac_milp`` at ``budget_fraction`` of the no-AC peak.

    Memory accounting (PyTorch's, not lynx's): ``sac_milp`` bounds, for every module i,
    ``m_i = params + grads accumulated so far + activations live at i (incl. the module's
    activation grads) - memory discarded by AC``, with ``world_size=1``. It excludes optimizer
    state and temporary buffers. ``baseline_peak_bytes`` is ``get_peak_memory_runtime_baseline``
    on the same graph (same terms, no AC), so the budget given to the solver is
    ``memory_budget = budget_fraction * baseline_peak_bytes / 2**30`` GiB, *including* params
    and grads. (lynx's "peak activation memory" excludes what was live before the step:
    params, grads, optimizer state, inputs; ``budget_basis="activations"`` applies the fraction
    to the part above the parameters instead, see :func:`plan_from_graph`.)

    Returns a dict:

    - ``plan_s``: seconds spent inside ``sac_milp`` only;
    - ``stats_s``: seconds collecting stats (fake copy, the three trackers, aggregate/parse);
    - ``discard``: ``{module fqn: fraction of its activation memory discarded}`` (AC units only;
      fqns as ModTracker names them, e.g. ``"GPT.blocks.0"``). The fraction is ``sac_milp``'s
      ``r_i``, relative to ``SACEstimator``'s ``sac_memory`` (every op output of the module's
      forward, saved or not), not to the bytes autograd saves; the bytes freed are
      ``r_i * sac_memory - (sac_memory - act_fw_per_module)`` (``discard_bytes``);
    - ``recompute_s``: the solver's predicted recomputation time (seconds; the solver rounds
      it to 0.01 ms);
    - ``peak_bytes_bound``: the ILP's upper bound on peak memory (bytes; -1 if it failed).
      It is the variable ``max_m``, which nothing minimizes, so it is typically the budget;
    - ``baseline_peak_bytes``: no-AC peak per the same stats;
    - ``status``: ``"ok"`` or error text (no exception from the torch tools escapes);
    - extras: ``runtime_mode``, ``budget_bytes``, ``predicted_peak_bytes`` (``max_i m_i`` of the
      solution under the ILP's own memory model; -1 if infeasible), ``discard_bytes``,
      ``param_grad_bytes`` (params + all grads; a fixed part of every bound),
      ``baseline_step_s`` (estimated fw+bw time without AC).

    ``runtime_mode``/``profile``: see :func:`collect_graph`. The lynx ``"cpu"`` profile is
    measured per process and is noisy on a shared machine, so predicted times vary between
    processes; pass a fixed ``HardwareProfile`` to compare. Memory numbers do not depend on it.

    Raises RuntimeError only when ``pulp``/``pwlf`` are missing.
    """
    _require_dependencies()
    result: dict[str, Any] = {
        "plan_s": 0.0, "stats_s": 0.0, "discard": {}, "recompute_s": 0.0,
        "peak_bytes_bound": -1, "baseline_peak_bytes": -1, "status": "",
    }
    t0 = time.perf_counter()
    try:
        units = ac_units if ac_units is not None else _block_fqns(model)
        graph, mode = collect_graph(
            model, example_input, loss_fn=loss_fn, runtime_mode=runtime_mode, profile=profile
        )
        result["runtime_mode"] = mode
    except Exception as e:  # noqa: BLE001 - a baseline must not crash its caller
        result["stats_s"] = time.perf_counter() - t0
        result["status"] = f"stats collection failed: {type(e).__name__}: {e}"
        return result
    result["stats_s"] = time.perf_counter() - t0
    known = {n["fqn"] for n in graph.nodes}
    if not set(units) <= known:
        result["status"] = f"ac_units not in the module graph: {sorted(set(units) - known)}"
        return result
    try:
        result.update(plan_from_graph(graph, budget_fraction, units, budget_basis))
    except Exception as e:  # noqa: BLE001
        result["status"] = f"sac_milp failed: {type(e).__name__}: {e}"
    return result


def main() -> None:
    import json
    import logging

    from lynx_compile.models import build_model, example_batch

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.manual_seed(0)
    model = build_model("gpt-small")
    x = example_batch(model, 4)
    for fraction in (0.3, 0.5, 0.7):
        r = plan_with_sac_ilp(model, x, fraction)
        print(f"gpt-small batch=4 budget_fraction={fraction}")
        print(json.dumps(r, indent=2, default=str))


if __name__ == "__main__":
    main()
