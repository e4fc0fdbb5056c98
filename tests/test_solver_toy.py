"""Toy recompute problems with hand-computed optima, solved by Lynx-OPT (HiGHS, GLPK) and HEU.

Units are in ms and bytes small enough to do the arithmetic in the comments. Forward events
produce one unit each and backward
event 0 carries a large `bw_base`, so the budget binds there: what is kept is live at event 0,
what is recomputed on demand is live only from its first use."""
import pytest

from lynx_compile.solver import CommWindow, InfeasibleBudget, RematProblem, Unit
from lynx_compile.solver.evaluate import evaluate
from lynx_compile.solver.heuristic import solve_heu
from lynx_compile.solver.milp import smallest_peak, solve_milp

MS = 1e-3
SOLVERS = [pytest.param(lambda p, b: solve_milp(p, b, solver="highs"), id="opt-highs"),
           pytest.param(lambda p, b: solve_milp(p, b, solver="glpk"), id="opt-glpk"),
           pytest.param(lambda p, b: solve_heu(p, b), id="heu")]


def _unit(i, nbytes, ms, use, *, inputs=(), fw_last=None, direct=True, block=None):
    return Unit(id=i, name=f"u{i}", nbytes=nbytes, compute_s=ms * MS, inputs=tuple(inputs), block=block,
                fw_pos=i, fw_last=i if fw_last is None else fw_last, first_use=use if direct else None,
                need_start=use, need_end=use)


def independent():
    # a: 4 B, 1 ms; b: 3 B, 2 ms; c: 2 B, 3 ms; used at backward events 1, 2, 3.
    # Budget 15 with 10 B of backward base at event 0: at most 5 B may be kept.
    # keep {b, c} = 5 B -> recompute a: 1 ms  (keep {a}: 5 ms; keep {b}: 4 ms; {a, c} = 6 B no)
    units = (_unit(0, 4, 1, 1), _unit(1, 3, 2, 2), _unit(2, 2, 3, 3))
    return RematProblem(units=units, num_fw_events=3, num_bw_events=4, fw_base=(0, 0, 0),
                        bw_base=(10, 0, 0, 0), reference_peak=19)


def chain():
    # a (4 B, 5 ms) feeds b (6 B, 1 ms); only b is read by the backward (event 2).
    # Budget 14, base 10 at event 0: keeping b (6 B) does not fit; recompute b needs a:
    # keep a (4 B fits) + recompute b = 1 ms;  recompute both = 6 ms.  Optimum: 1 ms.
    a = _unit(0, 4, 5, 2, fw_last=1, direct=False)
    b = _unit(1, 6, 1, 2, inputs=(0,))
    return RematProblem(units=(a, b), num_fw_events=2, num_bw_events=3, fw_base=(0, 0),
                        bw_base=(10, 0, 0), reference_peak=16)


def window():
    # x 1.5 ms, y 1 ms, z 1 ms, 1 B each, used at events 3, 4, 5; nothing can be kept (base 10 =
    # budget at event 0). One 2 ms window over events 1..2: {y, z} fill it exactly and x is exposed
    # (1.5 ms); {x} alone leaves y + z exposed (2 ms). Optimum: 1.5 ms.
    units = (_unit(0, 1, 1.5, 3), _unit(1, 1, 1, 4), _unit(2, 1, 1, 5))
    return RematProblem(units=units, num_fw_events=3, num_bw_events=6, fw_base=(0, 0, 0),
                        bw_base=(10, 0, 0, 0, 0, 0), windows=(CommWindow(id=0, start=1, end=2, duration_s=2 * MS),),
                        reference_peak=13)


@pytest.mark.parametrize("solve", SOLVERS)
def test_independent_units(solve):
    sol = solve(independent(), 15)
    assert sol.exposed_s == pytest.approx(1 * MS)
    assert sorted(sol.keep) == [1, 2] and list(sol.demand) == [0]


@pytest.mark.parametrize("solve", SOLVERS)
def test_chain_keeps_the_input_of_a_recompute(solve):
    sol = solve(chain(), 14)
    assert sol.exposed_s == pytest.approx(1 * MS)
    assert list(sol.keep) == [0] and list(sol.demand) == [1]


@pytest.mark.parametrize("solve", SOLVERS)
def test_window_takes_the_right_units(solve):
    sol = solve(window(), 10)
    assert sol.exposed_s == pytest.approx(1.5 * MS)
    # (x, y, z all in the window, overflowing by 1.5 ms, ties with {y, z} in it and x on demand)


@pytest.mark.parametrize("solve", SOLVERS)
def test_infeasible_budget_names_the_smallest_peak(solve):
    # independent(): nothing kept leaves 10 B at event 0; in the forward each unit alone is
    # live when produced (4 B at most); in the backward a recomputed unit alone (4 B): 10 B.
    assert smallest_peak(independent()) == 10
    with pytest.raises(InfeasibleBudget) as info:
        solve(independent(), 9)
    assert info.value.smallest == 10


def test_evaluator_agrees_with_hand_arithmetic():
    ev = evaluate(independent(), {"keep": (1, 2), "demand": (0,), "window": ()})
    # event 0: 10 + 3 + 2 = 15; event 1: a recomputed (4) + b, c still kept (3 + 2) = 9
    assert ev.peak_bytes == 15 and ev.exposed_s == pytest.approx(1 * MS)


def test_identical_blocks_heu_equals_opt():
    # two copies of independent() as blocks 0 and 1; budget 20 over base 10: 10 B kept in all,
    # i.e. 5 per block: each block keeps {b, c} and recomputes a -> 2 ms in total.
    base = independent().units
    units = tuple(_unit(k * 3 + u.id, u.nbytes, u.compute_s / MS, u.need_start, block=k) for k in (0, 1) for u in base)
    p = RematProblem(units=units, num_fw_events=6, num_bw_events=4, fw_base=(0,) * 6, bw_base=(10, 0, 0, 0),
                     block_groups=((0, 1),), reference_peak=28)
    opt, heu = solve_milp(p, 20, solver="highs"), solve_heu(p, 20)
    assert opt.exposed_s == pytest.approx(2 * MS) and heu.exposed_s == pytest.approx(opt.exposed_s)
