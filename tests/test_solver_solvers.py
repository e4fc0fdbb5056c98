"""Lynx-OPT (HiGHS and GLPK through Pyomo) and Lynx-HEU on toy problems with hand-computed
optima, the MILP against the evaluator on random problems, time limits, solver selection.

Toy conventions: bytes small enough for mental arithmetic, times in ms; forward event i
produces unit i; a unit's backward need interval is [need_start, need_end]."""
import logging
import shutil

import pyomo.environ as pyo
import pytest

from lynx_compile.solver import CommWindow, InfeasibleBudget, RematProblem, Unit
from lynx_compile.solver import milp, milp_solvers
from lynx_compile.solver.evaluate import evaluate, problem_arrays
from lynx_compile.solver.heuristic import heuristic_bound, solve_heu
from lynx_compile.solver.milp import build_model, extract_state, smallest_peak, solve_milp
from lynx_compile.solver.milp_solvers import available_solvers, pick_solver, run_solver
from lynx_compile.solver.solve import solve_remat
from lynx_compile.solver.synthetic import compare_solvers, synthetic_problem

MS = 1e-3
SOLVERS = [pytest.param(lambda p, b, **kw: solve_milp(p, b, solver="highs", **kw), id="opt-highs"),
           pytest.param(lambda p, b, **kw: solve_milp(p, b, solver="glpk", **kw), id="opt-glpk"),
           pytest.param(lambda p, b, **kw: solve_heu(p, b, **kw), id="heu")]


def U(i, nbytes, ms, ns, ne=None, *, inputs=(), fw_last=None, direct=True, block=None):
    return Unit(id=i, name=f"u{i}", nbytes=nbytes, compute_s=ms * MS, inputs=tuple(inputs), block=block,
                fw_pos=i, fw_last=i if fw_last is None else fw_last, first_use=ns if direct else None,
                need_start=ns, need_end=ns if ne is None else ne)


def three_units():
    # (a) a 2 B / 4 ms, b 2 B / 3 ms, c 2 B / 1 ms, read at backward events 1, 2, 3. Backward
    # event 0 holds 10 B of base: budget 14 leaves 4 B for kept units, i.e. two of three.
    # Keep the two with most ms per byte: {a, b} -> recompute c: 1 ms
    # ({a, c}: 3 ms, {b, c}: 4 ms, all three: 6 B > 4). Peak 10 + 4 = 14 at bw:0.
    return RematProblem(units=(U(0, 2, 4, 1), U(1, 2, 3, 2), U(2, 2, 1, 3)), num_fw_events=3,
                        num_bw_events=4, fw_base=(0, 0, 0), bw_base=(10, 0, 0, 0), reference_peak=16)


def chain():
    # (b) a (4 B, 5 ms, intermediate) -> b (6 B, 1 ms, read at event 2); a must exist when b is
    # recomputed (need [2, 2]). Base 10 at event 0.
    # Budget 14: keep b (6) no; keep a (4) + recompute b: 1 ms; recompute both: 6 ms -> 1 ms.
    # Budget 13: keep a (14 > 13) no; recompute both: 6 ms (a, b live at 2: 10 B <= 13).
    # Without the input rule budget 13 would give 1 ms (b alone): the rule is what costs 5 ms.
    a = U(0, 4, 5, 2, fw_last=1, direct=False)
    b = U(1, 6, 1, 2, inputs=(0,))
    return RematProblem(units=(a, b), num_fw_events=2, num_bw_events=3, fw_base=(0, 0),
                        bw_base=(10, 0, 0), reference_peak=16)


def window_choice():
    # (c) x (1 B, 1.5 ms, read at 3), y (1 B, 1 ms, read at 4); a window over events 1..2 of
    # 2 ms, kappa 1.2 (x costs 1.8 ms in it, y 1.2 ms: either fits, not both).
    # Base: 10 at event 0 (= budget: nothing kept), 9 at events 1..2 (one window recompute).
    # x in the window + y on demand: 1 ms; y in the window + x on demand: 1.5 ms; neither: 2.5.
    x, y = U(0, 1, 1.5, 3), U(1, 1, 1, 4)
    return RematProblem(units=(x, y), num_fw_events=2, num_bw_events=5, fw_base=(0, 0),
                        bw_base=(10, 9, 9, 0, 0), windows=(CommWindow(id=0, start=1, end=2, duration_s=2 * MS),),
                        kappa=1.2, reference_peak=12)


def backward_peak():
    # (d) the peak is backward event 2 (base 20). u (5 B, 1 ms) is needed over [1, 3]: live at
    # event 2 whether kept or recomputed. v (5 B, 3 ms) is needed over [3, 4]: kept it is live
    # at 2, recomputed it is not. Budget 25: 20 + u + v = 30 > 25, so v is recomputed although
    # u is cheaper: 3 ms, peak 25 at bw:2. Smallest reachable peak: 25 (u is always live at 2).
    u, v = U(0, 5, 1, 1, 3), U(1, 5, 3, 3, 4)
    return RematProblem(units=(u, v), num_fw_events=2, num_bw_events=5, fw_base=(0, 0),
                        bw_base=(0, 0, 20, 0, 0), reference_peak=30)


@pytest.mark.parametrize("solve", SOLVERS)
def test_a_keeps_the_most_seconds_per_byte(solve):
    sol = solve(three_units(), 14)
    assert sol.keep == (0, 1) and sol.demand == (2,) and sol.exposed_s == pytest.approx(1 * MS)
    ev = evaluate(three_units(), sol)
    assert (ev.peak_bytes, ev.peak_event) == (14, "bw:0") and sol.peak_bytes == 14


@pytest.mark.parametrize("solve", SOLVERS)
def test_b_chain_input_rule(solve):
    sol = solve(chain(), 14)
    assert sol.keep == (0,) and sol.demand == (1,) and sol.exposed_s == pytest.approx(1 * MS)
    sol = solve(chain(), 13)
    assert sol.keep == () and sol.demand == (0, 1) and sol.exposed_s == pytest.approx(6 * MS)


@pytest.mark.parametrize("solve", SOLVERS)
def test_c_window_takes_the_right_unit(solve):
    sol = solve(window_choice(), 10)
    assert sol.window == ((0, 0),) and sol.demand == (1,) and sol.exposed_s == pytest.approx(1 * MS)
    assert sol.recompute_s == pytest.approx(2.5 * MS) and sol.peak_bytes == 10


@pytest.mark.parametrize("solve", SOLVERS)
def test_d_backward_peak_recomputes_the_unit_that_frees_it(solve):
    sol = solve(backward_peak(), 25)
    assert sol.keep == (0,) and sol.demand == (1,) and sol.exposed_s == pytest.approx(3 * MS)
    assert evaluate(backward_peak(), sol).peak_event == "bw:2"


@pytest.mark.parametrize("solve", SOLVERS)
def test_e_infeasible_budget_names_the_smallest_peak(solve):
    assert smallest_peak(backward_peak()) == 25 and heuristic_bound(backward_peak()) == 25
    with pytest.raises(InfeasibleBudget, match="smallest reachable peak is 25 B") as info:
        solve(backward_peak(), 24)
    assert (info.value.budget, info.value.smallest, info.value.reference) == (24, 25, 30)


@pytest.mark.timeout(120)  # a hang guard, not a timing: the limit is the solver's to keep
def test_g_time_limit_returns_the_incumbent():
    p = synthetic_problem(4, 40, 2, 1)                 # HiGHS needs > 15 s to prove optimality
    budget = int(0.6 * p.reference_peak)
    sol = solve_milp(p, budget, solver="highs", time_limit_s=1.0)
    assert sol.status in ("feasible", "optimal") and sol.peak_bytes <= budget
    if sol.status == "feasible":
        assert any("time limit" in n for n in sol.notes) and sol.gap is not None
    assert evaluate(p, sol).violations == ()


@pytest.mark.timeout(120)
def test_g_glpk_time_limit_does_not_hang():
    p = synthetic_problem(4, 40, 2, 1)
    budget = int(0.6 * p.reference_peak)
    try:
        sol = solve_milp(p, budget, solver="glpk", time_limit_s=1.0)
        assert sol.status in ("feasible", "optimal") and sol.peak_bytes <= budget
    except RuntimeError as e:                          # no incumbent within glpsol's 1 s
        assert "without a feasible plan" in str(e)


def _random_problems():
    for seed in range(8):
        yield seed, synthetic_problem(2, 6 + seed % 5, 1 + seed % 2, seed, seq=256, hidden=256, heads=4)


@pytest.mark.parametrize("seed,problem", list(_random_problems()))
def test_h_milp_rows_and_objective_match_the_evaluator(seed, problem):
    arr = problem_arrays(problem)
    lo, hi = smallest_peak(problem), problem.reference_peak
    budget = lo + (hi - lo) * (seed % 4 + 1) // 5
    M = build_model(problem, budget)
    assert run_solver(M, "highs", 30.0, 0.0, None).status == "optimal"
    state, win = extract_state(M, arr)
    keep, demand, window = arr.to_sets(state, win)
    ev = evaluate(problem, (keep, demand, window))
    assert ev.violations == () and ev.peak_bytes <= budget
    rows = [(ev.fw_memory[t]) for t in M.fw_events] + [(ev.bw_memory[t]) for t in M.bw_events]
    for con, mem in zip(M.memory.values(), rows):
        assert pyo.value(con.body) * M.scale == pytest.approx(mem, rel=1e-9)
    T = float(arr.c[M.free].sum()) or 1.0
    R = float(max(arr.reference, int(arr.m.sum()), 1))
    kept = sum(u.nbytes for u in problem.units if u.id in keep and not u.must_keep)
    assert pyo.value(M.obj) == pytest.approx(ev.exposed_s / T + milp.TIE_BREAK * kept / R, rel=1e-6, abs=1e-12)
    sol = solve_milp(problem, budget, solver="highs", mip_gap=0.0)
    assert sol.exposed_s == pytest.approx(ev.exposed_s, rel=1e-6, abs=1e-12)
    assert sol.peak_bytes == evaluate(problem, sol).peak_bytes <= budget


@pytest.mark.parametrize("seed,problem", list(_random_problems())[:3])
def test_h_glpk_and_highs_agree(seed, problem):
    budget = (smallest_peak(problem) + problem.reference_peak) // 2
    a = solve_milp(problem, budget, solver="highs", mip_gap=0.0)
    b = solve_milp(problem, budget, solver="glpk", mip_gap=0.0)
    assert a.status == b.status == "optimal"
    assert a.exposed_s == pytest.approx(b.exposed_s, rel=1e-6, abs=1e-12)


def test_j_missing_glpsol_names_the_install_command(monkeypatch):
    real = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "glpsol" else real(name, *a, **k))
    with pytest.raises(RuntimeError, match="apt-get install -y glpk-utils"):
        solve_milp(three_units(), 14, solver="glpk")
    with pytest.raises(RuntimeError, match="apt-get install -y glpk-utils"):
        solve_remat(three_units(), 14, solver="glpk")
    assert "glpk" not in available_solvers()


def test_j_missing_highspy_names_the_install_command(monkeypatch):
    monkeypatch.setattr(milp_solvers, "highs_installed", lambda: False)
    with pytest.raises(RuntimeError, match="pip install highspy"):
        solve_milp(three_units(), 14, solver="highs")
    assert pick_solver("auto").name == "glpk" and available_solvers() == ["glpk", "heu"]


def test_auto_without_any_milp_solver_warns_and_uses_heu(monkeypatch):
    monkeypatch.setattr(milp_solvers, "highs_installed", lambda: False)
    monkeypatch.setattr(milp_solvers, "glpk_installed", lambda: False)
    choice = pick_solver("auto")
    assert choice.name == "heu" and "pip install highspy" in choice.reason
    with pytest.warns(UserWarning, match="no MILP solver"):
        sol = solve_remat(three_units(), 14)
    assert sol.solver == "heu" and sol.exposed_s == pytest.approx(1 * MS)
    with pytest.raises(RuntimeError, match="needs a MILP solver"):
        solve_milp(three_units(), 14, solver="auto")


def test_milp_failure_falls_back_to_heu_saying_why(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("solver exploded")
    monkeypatch.setattr(milp, "run_solver", boom)
    with pytest.warns(UserWarning, match="solver exploded"):
        sol = solve_remat(three_units(), 14, solver="highs")
    assert sol.solver == "heu" and "solver exploded" in sol.notes[0]
    with pytest.raises(InfeasibleBudget):               # never papered over by the fallback
        solve_remat(backward_peak(), 24, solver="heu")


def test_pick_solver():
    assert pick_solver("auto").name == "highs"         # highspy is a test dependency
    assert available_solvers()[-1] == "heu"
    with pytest.raises(ValueError, match="unknown remat solver"):
        pick_solver("cplex")


@pytest.mark.parametrize("solver,marker", [("highs", "HiGHS"), ("glpk", "GLPSOL")])
def test_progress_gets_lynx_lines_and_the_solver_log_goes_to_its_logger(solver, marker, caplog):
    lines = []
    with caplog.at_level(logging.DEBUG, logger="lynx_compile.solver"):
        solve_milp(three_units(), 14, solver=solver, progress=lines.append)
    assert lines[-1].startswith(f"lynx-opt[{solver}]: optimal")
    assert all(line.startswith(f"lynx-opt[{solver}]: ") for line in lines)  # never the solver's own log
    # the model's size is a detail: the solver's log (verbose), not a progress line
    assert not any("binaries" in line for line in lines)
    solver_log = [r.getMessage() for r in caplog.records if r.name == "lynx_compile.solver"]
    assert any(marker in line for line in solver_log)
    assert any(line.startswith(f"lynx-opt[{solver}]: ") and "binaries" in line for line in solver_log)


def test_tie_break_prefers_less_memory():
    # a (4 B, 1 ms, read at 3), b (2 B, 1 ms, read at 4); budget 16 over a base of 10 fits both
    # kept: 0 ms. A 1 ms window over events 1..2 can also hide a: 0 ms as well, with 2 B kept
    # instead of 6 B. Among equal-time plans the tie-break takes the one keeping fewer bytes.
    a, b = U(0, 4, 1, 3), U(1, 2, 1, 4)
    p = RematProblem(units=(a, b), num_fw_events=2, num_bw_events=5, fw_base=(0, 0),
                     bw_base=(10, 0, 0, 0, 0), windows=(CommWindow(id=0, start=1, end=2, duration_s=1 * MS),),
                     reference_peak=16)
    for solver in ("highs", "glpk"):
        sol = solve_milp(p, 16, solver=solver)
        assert sol.exposed_s == 0 and sol.window == ((0, 0),) and sol.keep == (1,)


def test_benchmark_helper_runs():
    rows = compare_solvers([(2, 12, 1)], budget_frac=0.7, time_limit_s=5.0, out=None)
    assert {r["solver"] for r in rows} == {"highs", "glpk", "heu"}
    assert all(r["exposed_ms"] >= 0 and r["binaries"] > 0 for r in rows)


def test_units_subset_and_trivial_problems():
    p = synthetic_problem(2, 12, 1, 0)
    budget = int(0.8 * p.reference_peak)
    block0 = [u.id for u in p.units if u.block == 0]
    sol = solve_milp(p, budget, units=block0)
    moved = set(sol.demand) | {a for a, _ in sol.window}
    assert moved and moved <= set(block0) and evaluate(p, sol).violations == ()
    assert sol.exposed_s >= solve_milp(p, budget).exposed_s - 1e-12   # fewer choices, no better
    with pytest.raises(InfeasibleBudget) as info:                      # smallest with block 0 only
        solve_milp(p, int(0.3 * p.reference_peak), units=block0)
    assert info.value.smallest > smallest_peak(p)
    empty = RematProblem(units=(), num_fw_events=1, num_bw_events=1, fw_base=(5,), bw_base=(7,))
    assert solve_milp(empty, 7).status == "optimal" and smallest_peak(empty) == 7
    for solve in (solve_milp, solve_heu):
        with pytest.raises(InfeasibleBudget):
            solve(empty, 6)
