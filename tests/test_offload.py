"""Activation offload combined with recompute (issue 15 part 1): the decision, the graph rewrite,
the simulator, and the optimizer's choice among keep / demand / window / offload."""
import copy

import numpy as np
import pytest
import torch

import lynx_compile
from lynx_compile.costs import hardware
from lynx_compile.decisions import DEMAND, OFFLOAD, Decisions
from lynx_compile.models import build_model, example_batch
from lynx_compile.solver import RematProblem, Unit
from lynx_compile.solver.evaluate import evaluate
from lynx_compile.solver.heuristic import solve_heu
from lynx_compile.solver.milp import solve_milp
from lynx_compile.runtime.offload_ops import OFFLOAD as OFFLOAD_OP
from lynx_compile.runtime.offload_ops import RELOAD, offload_reference, reload_reference

MS = 1e-3


def test_offload_decision_round_trips_and_counts():
    d = Decisions.make("lynx", {"a": OFFLOAD, "b": DEMAND, "c": OFFLOAD})
    assert Decisions.from_dict(d.to_dict()) == d
    assert d.counts()["offload"] == 2 and sorted(d.offloaded()) == ["a", "c"]
    assert [n for n, _ in d.recomputed()] == ["b"]  # offloaded units are not recomputed


def test_ops_match_their_references():
    x = torch.randn(9, 41)
    host = torch.ops.lynx.offload(x)
    assert host.data_ptr() != x.data_ptr() and torch.equal(host, offload_reference(x))
    torch.ops.lynx.offload_wait(host, x)
    back = torch.ops.lynx.reload(host, x.device)
    torch.ops.lynx.reload_wait(back)
    assert torch.equal(back, reload_reference(host, x.device)) and torch.equal(back, x)


def toy():
    # big: 100 B, 10 ms to recompute, read at backward event 2; its copy (1 ms) is done by forward
    # event 0 and reloaded from backward event 1, 0.5 ms exposed. small: 10 B, 1 ms, live at
    # forward event 1 whatever happens. Budget 105: keeping both peaks at 110 (forward event 1).
    # demand big: 10 ms, peak 100; offload big: 0.5 ms, peak 100 (bw event 1); recomputing small
    # does not help (it is live at forward event 1 anyway). Optimum: offload big, 0.5 ms.
    big = Unit(id=0, name="big", nbytes=100, compute_s=10 * MS, fw_pos=0, fw_last=0, first_use=2,
               need_start=2, need_end=2, offload_s=1 * MS, offload_exposed_s=0.5 * MS,
               offload_fw_end=0, offload_bw_start=1)
    small = Unit(id=1, name="small", nbytes=10, compute_s=1 * MS, fw_pos=1, fw_last=1, first_use=0,
                 need_start=0, need_end=0)
    return RematProblem(units=(big, small), num_fw_events=3, num_bw_events=3, fw_base=(0, 0, 0),
                        bw_base=(0, 0, 0), reference_peak=110)


@pytest.mark.parametrize("solve", [lambda p, b: solve_milp(p, b, solver="highs"),
                                   lambda p, b: solve_milp(p, b, solver="glpk"),
                                   lambda p, b: solve_heu(p, b)], ids=["opt-highs", "opt-glpk", "heu"])
def test_toy_optimum_is_offload(solve):
    problem = toy()
    sol = solve(problem, 105)
    assert sol.offload == (0,) and sol.keep == (1,)
    assert sol.exposed_s == pytest.approx(0.5 * MS) and sol.offload_exposed_s == pytest.approx(0.5 * MS)
    ev = evaluate(problem, sol)
    assert ev.peak_bytes == sol.peak_bytes == 100 and not ev.violations
    assert RematProblem.from_json(problem.to_json()) == problem


def _fast_host_link(monkeypatch):
    prof = hardware.get_profile("auto")
    monkeypatch.setitem(hardware._cpu_profiles, hardware._cpu_key(),
                        hardware.with_overrides(prof, host_link_bytes_per_s=1e15))


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _gpt_tiny_with_eager_step():
    """(eager gpt-tiny after one backward, its untouched copy, the batch, eager's loss)."""
    torch.manual_seed(0)
    eager = build_model("gpt-tiny", dropout=0.0)
    twin = copy.deepcopy(eager)
    # batch 16: the step's peak counts the parameter gradients (issue M); at batch 4 they set it
    # at 0.65 and offloading an activation lowers nothing
    x = example_batch(eager, 16, generator=torch.Generator().manual_seed(7))
    ref = eager(x).loss
    ref.backward()
    return eager, twin, x, ref


def _assert_equal_to_eager(loss, ref, eager, twin):
    assert _rel(loss.detach(), ref.detach()) <= 1e-5
    for (name, p), (_, q) in zip(eager.named_parameters(), twin.named_parameters()):
        assert _rel(q.grad, p.grad) <= 1e-5, name


@pytest.mark.parametrize("solver", ["auto", "heu"])
def test_gpt_tiny_offload_trains_like_eager(monkeypatch, solver):
    _fast_host_link(monkeypatch)
    eager, twin, x, ref = _gpt_tiny_with_eager_step()
    backend = lynx_compile.backend(policy="lynx", memory_budget=0.65, offload=True, compiler="eager",
                                   solver=solver, plan_cache=False)
    loss = torch.compile(twin, backend=backend)(x).loss
    loss.backward()
    _assert_equal_to_eager(loss, ref, eager, twin)
    record = backend.records[-1]
    plan = record.plan
    assert plan.decisions.counts()["offload"] > 0 and plan.peak_bytes <= plan.budget_bytes
    assert record.stats["offload"]["bytes"] > 0
    assert plan.offload_bytes == record.stats["offload"]["bytes"]
    assert plan.offload_copy_s > 0 and plan.offload_exposed_s >= 0


def test_simulated_peak_of_an_offload_plan_is_within_the_model(monkeypatch):
    """gpt-tiny: the all-kept plan's simulated peak equals the optimizer's evaluation; an
    offload-only plan (every offloadable unit inside the blocks) is rewritten with the offload /
    reload ops and its exact simulated peak is at most the model's (the model reloads at the
    unit's earliest possible need, the graph at its first actual use)."""
    from lynx_compile.recompute.apply import realize
    from lynx_compile.recompute.problem_from_graph import unit_decisions
    from lynx_compile.solver.evaluate import KEEP, OFFLOAD as OFF, problem_arrays
    from lynx_compile.solver.heuristic import initial_state
    from lynx_compile.solver.problem import RematSolution
    _fast_host_link(monkeypatch)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, 16)
    backend = lynx_compile.backend(policy="lynx", memory_budget=0.65, offload=True, compiler="eager",
                                   solver="heu", plan_cache=False)
    captured = {}
    import lynx_compile.recompute.optimize as optimize
    real = optimize.realize

    def spy(joint, ctx, decisions, kw, **k):
        captured.setdefault("args", (joint, ctx, kw))
        return real(joint, ctx, decisions, kw, **k)
    monkeypatch.setattr(optimize, "realize", spy)
    torch.compile(model, backend=backend)(x).loss.backward()
    joint, ctx, kw = captured["args"]
    problem, index = ctx.record.problem, ctx.record.unit_index
    arr = problem_arrays(problem)
    state, win = initial_state(arr)
    state = np.where(arr.needed | arr.must, KEEP, 0).astype(np.int8)   # what the backward reads, kept
    keep, demand, window = arr.to_sets(state, win)
    kept = realize(joint, ctx, unit_decisions(problem, index, RematSolution(keep=keep, demand=demand)), kw)
    assert kept.mem.peak_bytes == evaluate(problem, (keep, demand)).peak_bytes
    state[arr.can_off & ~arr.must] = OFF      # every offloadable unit inside the blocks
    assert (state == OFF).any() and (state == KEEP).any()
    keep, demand, window = arr.to_sets(state, win)
    sol = RematSolution(keep=keep, demand=demand, window=window, offload=arr.offloaded(state))
    ev = evaluate(problem, sol)
    applied = realize(joint, ctx, unit_decisions(problem, index, sol), kw)
    assert any(n.target is OFFLOAD_OP for n in applied.fw.graph.nodes)
    assert any(n.target is RELOAD for n in applied.bw.graph.nodes)
    assert applied.mem.peak_bytes <= ev.peak_bytes < kept.mem.peak_bytes


def test_offload_under_inductor_trains_like_eager_and_waits_before_each_use(monkeypatch):
    # offload under the default compiler: the copies are extern calls in Inductor's generated
    # code; every reader of a reloaded tensor comes after its reload_wait (declared as writing it:
    # on CUDA the copy runs on a copy stream), and the gradients equal eager's
    import re

    from torch._inductor.utils import run_and_get_code

    _fast_host_link(monkeypatch)
    eager, twin, x, ref = _gpt_tiny_with_eager_step()
    # (0.65: on torch 2.11, which holds the output gradients through the backward, 0.6 is below
    # what the optimizer reaches and a baseline seed without offload wins)
    backend = lynx_compile.backend(policy="lynx", memory_budget=0.65, offload=True, solver="heu", plan_cache=False)
    assert backend.config.compiler == "inductor"
    compiled = torch.compile(twin, backend=backend)

    def step():
        loss = compiled(x).loss
        loss.backward()
        return loss

    loss, codes = run_and_get_code(step)
    _assert_equal_to_eager(loss, ref, eager, twin)
    assert backend.records[-1].plan.decisions.counts()["offload"] > 0
    backward = next(c for c in codes if "lynx.reload.default" in c)
    lines = [ln.strip() for ln in backward.splitlines()]
    waits = 0
    for i, ln in enumerate(lines):
        m = re.match(r"torch\.ops\.lynx\.reload_wait\.default\((buf\d+)\)", ln)
        if not m:
            continue
        waits += 1
        buf = m.group(1)
        (made,) = [j for j, other in enumerate(lines) if other.startswith(f"{buf} = ")]
        readers = [j for j, other in enumerate(lines) if j > made and re.search(rf"\b{buf}\b", other)
                   and not other.startswith(("assert_", "del ", "#")) and j != i]
        assert all(j > i for j in readers), (buf, lines[min(readers)])
        assert readers, f"{buf} is never read"
    assert 0 < waits <= backend.records[-1].stats["offload"]["tensors"]


def test_lynx_train_offload_flag_trains_like_one_process_and_reports_offload(monkeypatch):
    # `lynx train --offload` (one process): the backend option reaches policy lynx, the losses
    # equal the same steps trained without lynx, and the plan line says how many units went to host
    import argparse

    from lynx_compile.tools.train import add_train_arguments, train

    _fast_host_link(monkeypatch)
    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args(["--model", "gpt-tiny", "--steps", "2", "--batch-size", "16", "--dropout", "0",
                         "--memory-budget", "0.65", "--offload", "--check", "--solver", "heu", "--compiler", "eager"])
    lines = []
    result = train(args, say=lines.append)
    assert result.losses == pytest.approx(result.reference_losses, rel=1e-5)
    assert result.plans and all(p["offloaded"] > 0 for p in result.plans), result.plans
    assert any(line.startswith("plan 0:") and line.endswith("offloaded to host") for line in lines), lines


def test_offload_under_inductor_reaches_below_the_recompute_floor_within_the_budget():
    """gpt-tiny (4 layers) compiled whole under Inductor, ``.grad`` allocated (as the peers are
    measured): without offload 0.3 is refused (recompute alone stops near 0.35 of torch.compile's
    step, eager full checkpointing's 0.351); with ``offload=True`` it is accepted and every step
    measures within it (+2%), counting device bytes only (a CPU's "host" copies live outside the
    allocator the measure reads), gradients Inductor's own bit for bit. Until session 21 the
    offload waits read a value Inductor computes inside its GELU kernel, which it then wrote out:
    0.341 of the step at 0.3. Reference: torch.compile's measured step."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _steps import measured_steps
    from lynx_compile.config import make_config
    from lynx_compile.decisions import BudgetError
    from lynx_compile.compiler.dynamo_backend import LynxBackend, find_backend_error

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def run(backend):
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            return measured_steps(model, backend, "whole", steps=2)

        ref_peaks, ref_grads = run("inductor")
        with pytest.raises(Exception) as refused:
            run(LynxBackend(make_config({"memory_budget": 0.3, "plan_cache": False})))
        assert find_backend_error(refused.value, BudgetError) is not None, refused.value
        backend = LynxBackend(make_config({"memory_budget": 0.3, "offload": True, "plan_cache": False}))
        peaks, grads = run(backend)
    finally:
        torch.set_num_threads(threads)
    assert backend.records[0].stats["offload"]["tensors"] > 0
    for got, want in zip(peaks, ref_peaks):
        assert got <= 0.3 * 1.02 * want, [round(p / r, 4) for p, r in zip(peaks, ref_peaks)]
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
