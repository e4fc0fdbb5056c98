"""Lynx-HEU: replication over identical blocks (2 and 48 blocks), its gap to Lynx-OPT on a
4-block one, the greedy path without highspy, determinism."""
import numpy as np
import pytest

from lynx_compile.solver import InfeasibleBudget, RematProblem, Unit
from lynx_compile.solver import heuristic
from lynx_compile.solver.evaluate import evaluate
from lynx_compile.solver.heuristic import heuristic_bound, solve_heu
from lynx_compile.solver.milp import smallest_peak, solve_milp
from lynx_compile.solver.synthetic import synthetic_problem

MS = 1e-3


def two_blocks() -> RematProblem:
    # (f) per block k: a_k (4 B, 5 ms, intermediate) -> b_k (6 B, 1 ms), and c_k (2 B, 2 ms).
    # The backward runs block 1 (b1 at event 1, c1 at 2) then block 0 (b0 at 3, c0 at 4).
    # Budget 22 over a base of 10 at event 0: 12 B kept in all, 6 per block. Per block:
    # keep a + c (6 B), recompute b: 1 ms  | keep b, recompute c: 2 ms | keep c, recompute a, b: 6 ms
    # -> 1 ms per block, 2 ms in all, the same decision in both blocks (what HEU replicates).
    # Event 1: a0 + c0 + a1 + c1 kept (12) + b1 recomputed (6) = 18 <= 22.
    units = []
    for k, (tb, tc) in enumerate(((3, 4), (1, 2))):
        i = 3 * k
        units += [Unit(id=i, name=f"a{k}", nbytes=4, compute_s=5 * MS, block=k, fw_pos=i, fw_last=i + 1,
                       need_start=tb, need_end=tb),
                  Unit(id=i + 1, name=f"b{k}", nbytes=6, compute_s=1 * MS, inputs=(i,), block=k, fw_pos=i + 1,
                       fw_last=i + 1, first_use=tb, need_start=tb, need_end=tb),
                  Unit(id=i + 2, name=f"c{k}", nbytes=2, compute_s=2 * MS, block=k, fw_pos=i + 2,
                       fw_last=i + 2, first_use=tc, need_start=tc, need_end=tc)]
    return RematProblem(units=tuple(units), num_fw_events=6, num_bw_events=5, fw_base=(0,) * 6,
                        bw_base=(10, 0, 0, 0, 0), block_groups=((0, 1),), reference_peak=26)


def test_f_identical_blocks_heu_equals_opt():
    p = two_blocks()
    heu = solve_heu(p, 22)
    for solver in ("highs", "glpk"):
        opt = solve_milp(p, 22, solver=solver)
        assert opt.exposed_s == pytest.approx(2 * MS)
        assert (heu.keep, heu.demand, heu.window) == (opt.keep, opt.demand, opt.window) == ((0, 2, 3, 5), (1, 4), ())
    assert heu.status == "heuristic" and "replicated" in " ".join(heu.notes)


def test_i_48_blocks_replicates_representative_runs(monkeypatch):
    # 48 identical blocks: HEU solves representative blocks exactly and replicates them: once
    # every block alike, once per ``CHUNKS`` entry in that many runs of consecutive blocks (the
    # k-th unit of every block of a run shares one decision), then repairs, hides and refills
    # unit by unit. The plan fits, decides every block, and exposes no more than the all-alike
    # replication alone. Tests assert behaviour, not time: HEU's search time is reported by
    # benchmarks/bench_remat.py (plan search table).
    from lynx_compile.solver import heuristic

    p = synthetic_problem(48, 40, 2, 0)               # 1924 units, 3848 events, 97 windows
    budget = int(0.6 * p.reference_peak)
    sol = solve_heu(p, budget)
    ev = evaluate(p, sol)
    assert ev.violations == () and ev.peak_bytes <= budget
    assert ev.exposed_s == pytest.approx(sol.exposed_s)
    assert "replicated" in " ".join(sol.notes)
    keep, demand = set(sol.keep), set(sol.demand)
    window = {u for u, _ in sol.window}
    decisions: dict[int, list[str]] = {}
    for u in sorted(p.units, key=lambda u: u.id):
        if u.block is not None:
            decisions.setdefault(u.block, []).append(
                "keep" if u.id in keep else "demand" if u.id in demand else "window" if u.id in window else "unused")
    assert sorted(decisions) == list(range(48))
    monkeypatch.setattr(heuristic, "CHUNKS", (1,))
    alike = solve_heu(p, budget)
    assert sol.exposed_s <= alike.exposed_s * (1 + 1e-9)


def test_i_4_blocks_close_to_opt():
    # 4 blocks x 40 units, where HiGHS proves the optimum in about a second. Measured on the
    # sweep in the solver report: HEU is typically 2-10 % above OPT on these 4-block problems
    # (boundary blocks differ from the interior that replication assumes), worse on some.
    p = synthetic_problem(4, 40, 1, 0)
    budget = int(0.6 * p.reference_peak)
    opt = solve_milp(p, budget, solver="highs", time_limit_s=60)
    heu = solve_heu(p, budget)
    gap = heu.exposed_s / opt.exposed_s - 1
    print(f"\nOPT {opt.exposed_s * 1e3:.4f} ms ({opt.status}, {opt.solve_s:.1f} s), "
          f"HEU {heu.exposed_s * 1e3:.4f} ms ({heu.solve_s * 1e3:.0f} ms): {gap:+.1%}")
    assert opt.status == "optimal"
    assert opt.exposed_s <= heu.exposed_s * (1 + 1e-9)
    assert gap < 0.10


def test_without_highspy_the_greedy_path_still_fits(monkeypatch):
    monkeypatch.setattr(heuristic, "highs_installed", lambda: False)
    p = synthetic_problem(4, 20, 1, 0)
    budget = int(0.6 * p.reference_peak)
    sol = solve_heu(p, budget)
    ev = evaluate(p, sol)
    assert ev.violations == () and ev.peak_bytes <= budget
    assert "highspy missing" in " ".join(sol.notes)


def test_deterministic():
    p = synthetic_problem(8, 20, 1, 3)
    budget = int(0.55 * p.reference_peak)
    a, b = solve_heu(p, budget), solve_heu(synthetic_problem(8, 20, 1, 3), budget)
    assert (a.keep, a.demand, a.window) == (b.keep, b.demand, b.window)


def test_infeasible_names_a_reachable_peak():
    # below the exact smallest peak (the MILP's) HEU must give up, naming a peak it can reach
    # (its own bound: never below the exact one); at its bound it finds a plan.
    p = synthetic_problem(2, 12, 1, 0)
    exact, bound = smallest_peak(p), heuristic_bound(p)
    assert exact <= bound < p.reference_peak
    with pytest.raises(InfeasibleBudget) as info:
        solve_heu(p, exact - 1)
    assert exact <= info.value.smallest <= bound
    assert evaluate(p, solve_heu(p, bound)).peak_bytes <= bound


def test_no_block_groups_and_unequal_blocks():
    p = synthetic_problem(2, 12, 1, 0)
    ungrouped = RematProblem(**{**p.__dict__, "block_groups": ()})
    sol = solve_heu(ungrouped, int(0.7 * p.reference_peak))
    assert "no block groups" in " ".join(sol.notes) and evaluate(p, sol).violations == ()
    units = tuple(u if u.id != 5 else Unit(**{**u.__dict__, "block": None}) for u in p.units)
    odd = RematProblem(**{**p.__dict__, "units": units})
    sol = solve_heu(odd, int(0.7 * p.reference_peak))
    assert "different unit counts" in " ".join(sol.notes) and evaluate(odd, sol).violations == ()


def test_undominated_drops_only_rows_a_kept_row_implies():
    # Memory rows A[t] x <= rhs[t] (x >= 0). A row may be dropped only when some *kept* row s has
    # A[t] <= A[s] elementwise and rhs[t] >= rhs[s]. Equal neighbouring rows used to imply each
    # other in the two passes and both went (the representative MILP then missed the peak of a
    # traced GPT by up to 1.5 %: the next test).
    from lynx_compile.solver.representative import _undominated

    assert _undominated(np.ones((2, 3)), np.zeros(2)).sum() == 1
    rng = np.random.default_rng(0)
    for _ in range(300):
        E, n = int(rng.integers(2, 12)), int(rng.integers(1, 4))
        steps = rng.integers(0, 3, size=(E, n)) * rng.choice([-1, 0, 1], size=(E, 1))
        A = np.maximum(np.cumsum(steps, axis=0), 0).astype(float)
        rhs = rng.integers(0, 4, size=E).astype(float)
        keep = _undominated(A, rhs)
        for t in np.flatnonzero(~keep):
            assert any(np.all(A[t] <= A[s]) and rhs[t] >= rhs[s] for s in np.flatnonzero(keep)), (A, rhs, keep)


@pytest.fixture(scope="module")
def traced_gpt_problem():
    # the recompute problem of a traced 4-layer gpt-small (meta device, analytic H100 costs)
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.planning import plan_model

    model = build_model("gpt-small", device="meta", n_layers=4, seq_len=512)
    x = example_batch(model, 1, device="meta")
    return plan_model(model, (x,), policy="lynx", solver="heu", memory_budget=1.0, hardware="h100-sxm",
                      plan_cache=False)[0].problem


@pytest.mark.parametrize("frac", [0.6, 0.7])
def test_representative_milp_plan_fits_on_the_exact_model(traced_gpt_problem, frac):
    # the representative MILP is exact on replicated decisions: a plan it finds without slack
    # (feasible budgets) is within the budget on the exact profile (1.0037 / 1.0004 of it before
    # the dominance fix, which the greedy repair then paid for in exposed time)
    from lynx_compile.solver.evaluate import problem_arrays
    from lynx_compile.solver.representative import solve_positions

    p = traced_gpt_problem
    arr = problem_arrays(p)
    positions, _ = heuristic.block_positions(p, arr)
    budget = int(frac * p.reference_peak)
    state, win = heuristic.initial_state(arr)
    state, win, _ = solve_positions(arr, heuristic._rep_positions(arr, positions, 4), budget, state, win)
    assert heuristic._peak(arr, state, win)[2] <= budget


# (0.45, was 0.4: with the parameter gradients in the step's peak, issue M, 0.408 is the least
# this problem reaches)
@pytest.mark.parametrize("frac", [0.45, 0.5, 0.6, 0.7])
def test_heu_within_2_percent_of_opt_on_a_traced_gpt(traced_gpt_problem, frac):
    p = traced_gpt_problem
    budget = int(frac * p.reference_peak)
    opt = solve_milp(p, budget, solver="highs", time_limit_s=60)
    heu = solve_heu(p, budget)
    assert opt.status == "optimal" and evaluate(p, heu).peak_bytes <= budget
    assert opt.exposed_s <= heu.exposed_s * (1 + 1e-9) <= opt.exposed_s * 1.02 + 1e-12
