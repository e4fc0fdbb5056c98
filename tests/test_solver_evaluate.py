"""The reference evaluator: hand-computed profiles, rule violations, a naive per-event oracle
over random assignments, and its speed on a 48-block problem."""
import time

import numpy as np
import pytest

from lynx_compile.solver import CommWindow, RematProblem, RematSolution, Unit
from lynx_compile.solver.evaluate import evaluate, problem_arrays
from lynx_compile.solver.synthetic import synthetic_problem

MS = 1e-3


def small() -> RematProblem:
    # forward: a (event 0, read until 1), b (event 1), c (event 2, reads b)
    # backward: c read at 1, b at 2..3, a at 3 (c's recompute needs b from event 1: need [1, 3])
    a = Unit(id=0, name="a", nbytes=4, compute_s=1 * MS, fw_pos=0, fw_last=1, first_use=3,
             need_start=3, need_end=3)
    b = Unit(id=1, name="b", nbytes=2, compute_s=2 * MS, fw_pos=1, fw_last=2, first_use=2,
             need_start=1, need_end=3)
    c = Unit(id=2, name="c", nbytes=8, compute_s=3 * MS, inputs=(1,), fw_pos=2, fw_last=2,
             first_use=1, need_start=1, need_end=1)
    return RematProblem(units=(a, b, c), num_fw_events=3, num_bw_events=4, fw_base=(1, 1, 1),
                        bw_base=(5, 0, 0, 0), windows=(CommWindow(id=7, start=0, end=1, duration_s=1 * MS),
                                                      CommWindow(id=8, start=2, end=3, duration_s=1 * MS)),
                        kappa=2.0, reference_peak=19)


def test_memory_profile_by_hand():
    p = small()
    ev = evaluate(p, {"keep": (0,), "demand": (1, 2)})
    # fw: 1 + live-in-forward (a: 0..1, b: 1..2, c: 2) + kept a after its fw_last (event 2)
    assert ev.fw_memory == (1 + 4, 1 + 4 + 2, 1 + 2 + 8 + 4)
    # bw: base + a kept [0, 3] + b demand [1, 3] + c demand [1, 1]
    assert ev.bw_memory == (5 + 4, 4 + 2 + 8, 4 + 2, 4 + 2)
    assert (ev.peak_bytes, ev.peak_event) == (15, "fw:2")
    assert ev.exposed_s == pytest.approx(5 * MS) and ev.recompute_s == pytest.approx(5 * MS)
    assert ev.feasible_inputs and ev.violations == ()


def test_recompute_chain_holds_two_links_at_once_not_all():
    # backward event 1 reads z, whose recompute chain is x -> y -> z (x, y: intermediates
    # nothing else reads); l (need [1, 2]) is recomputed at the chain's start and lives on.
    # Recomputed in forward order, freed after their last reader: computing y holds x and y,
    # computing z holds y and z, the op at 1 holds z: 60 B at most, not 10 + 20 + 40 = 70 B.
    x = Unit(id=0, name="x", nbytes=10, compute_s=MS, fw_pos=0, fw_last=1, need_start=1, need_end=1)
    y = Unit(id=1, name="y", nbytes=20, compute_s=MS, inputs=(0,), fw_pos=1, fw_last=2,
             need_start=1, need_end=1)
    z = Unit(id=2, name="z", nbytes=40, compute_s=MS, inputs=(1,), fw_pos=2, fw_last=2, first_use=1,
             need_start=1, need_end=1)
    l_ = Unit(id=3, name="l", nbytes=5, compute_s=MS, fw_pos=3, fw_last=3, first_use=1, need_start=1,
              need_end=2)
    p = RematProblem(units=(x, y, z, l_), num_fw_events=4, num_bw_events=3, fw_base=(0,) * 4,
                     bw_base=(0, 1, 0), reference_peak=75)
    ev = evaluate(p, {"demand": (0, 1, 2, 3)})
    assert ev.bw_memory == (0, 1 + 5 + 60, 5) and ev.violations == ()
    # z kept: x and y are no longer needed (none), nothing of the chain is live but l
    assert evaluate(p, {"keep": (2,), "demand": (3,)}).bw_memory == (40, 1 + 40 + 5, 5)
    # a kept z and a y recomputed anyway (useless, but the model prices it): y alone
    assert evaluate(p, {"keep": (0, 2), "demand": (1, 3)}).bw_memory == (50, 1 + 50 + 5 + 20, 5)


def test_window_memory_and_overflow():
    p = small()
    # b in window 7 (events 0..1, 1 ms, kappa 2): live from 0; load 2 * 2 ms = 4 ms -> 3 ms over
    ev = evaluate(p, RematSolution(keep=(0, 2), demand=(), window=((1, 7),)))
    assert ev.bw_memory == (5 + 4 + 8 + 2, 4 + 8 + 2, 4 + 2, 4 + 2)
    assert ev.exposed_s == pytest.approx(3 * MS) and ev.recompute_s == pytest.approx(2 * MS)
    assert ev.violations == ()


def test_violations_are_listed_not_raised():
    p = small()
    ev = evaluate(p, ((), (2,), ()))                  # tuple form; a and b nowhere
    assert not ev.feasible_inputs
    text = " | ".join(ev.violations)
    assert "a: read by the backward" in text and "b: read by the backward" in text
    assert "c: recomputed but its input b is not available" in text
    ev = evaluate(p, {"keep": (0, 0, 9), "demand": (1,), "window": ((2, 8), (1, 3))})
    text = " | ".join(ev.violations)
    assert "assigned more than once" in text and "unknown unit/window id" in text
    assert "c: window 8 ends after its need_start" in text


def test_window_input_must_be_kept_or_in_a_window_no_later():
    p = small()
    ev = evaluate(p, {"keep": (0,), "demand": (1,), "window": ((2, 7),)})   # b only on demand
    assert ev.violations == ("c: recomputed but its input b is not available",)
    ev = evaluate(p, {"keep": (0,), "window": ((1, 7), (2, 7))})            # both in window 7
    assert ev.violations == ()


def test_malformed_problem_is_a_value_error():
    p = small()
    bad = RematProblem(units=p.units, num_fw_events=3, num_bw_events=4, fw_base=(1, 1),
                       bw_base=p.bw_base)
    with pytest.raises(ValueError, match="fw_base"):
        evaluate(bad, ((), ()))
    u = Unit(id=0, name="x", nbytes=1, compute_s=0.0, inputs=(5,), fw_pos=0, fw_last=0)
    with pytest.raises(ValueError, match="unknown unit ids"):
        evaluate(RematProblem(units=(u,), num_fw_events=1, num_bw_events=1, fw_base=(0,), bw_base=(0,)), ((), ()))


def _transient(u: Unit) -> bool:
    return u.need_start == u.need_end and not u.must_keep


def _naive_chain(p: RematProblem, demand, t: int) -> int:
    """Largest bytes of demanded one-event units live at once while event t's recompute chain
    runs: the chain computes every unit needing t in forward order; a one-event unit lives from
    its computation to its last consumer in the chain (to the op at t if the backward reads it)."""
    chain = sorted((u for u in p.units if u.need_start == t), key=lambda u: u.fw_pos)
    steps = [u.id for u in chain] + ["op"]
    best = 0
    for k, step in enumerate(steps):
        live = 0
        for j, u in enumerate(chain):
            if u.id not in demand or not _transient(u) or j > k:
                continue
            readers = [i for i, c in enumerate(chain) if u.id in c.inputs]
            last = len(chain) if u.first_use is not None else max(readers + [j])
            live += u.nbytes * (k <= last)
        best = max(best, live)
    return best


def _naive(p: RematProblem, keep, demand, window):
    """Per-event sums straight from the model's formulas (the oracle of the oracle)."""
    wins = {w.id: w for w in p.windows}
    inw = dict(window)
    fw = []
    for t in range(p.num_fw_events):
        fw.append(p.fw_base[t] + sum(u.nbytes * ((u.fw_pos <= t <= u.fw_last) + (u.id in keep) * (t > u.fw_last))
                                     for u in p.units))
    bw = []
    for t in range(p.num_bw_events):
        tot = p.bw_base[t] + _naive_chain(p, demand, t)
        for u in p.units:
            tot += u.nbytes * ((u.id in keep) * (t <= u.need_end)
                               + (u.id in demand and not _transient(u)) * (u.need_start <= t <= u.need_end)
                               + (u.id in inw) * (u.id in inw and wins[inw[u.id]].start <= t <= u.need_end))
        bw.append(tot)
    load = {w: 0.0 for w in wins}
    for a, w in window:
        load[w] += p.kappa * p.units[a].compute_s
    exposed = sum(p.units[a].compute_s for a in demand) + sum(max(0.0, load[w] - wins[w].duration_s) for w in wins)
    return fw, bw, exposed


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_naive_sums_on_random_assignments(seed):
    p = synthetic_problem(2, 12, 2, seed, seq=256, hidden=256, heads=4)
    arr = problem_arrays(p)
    rng = np.random.default_rng(seed)
    for _ in range(5):
        keep, demand, window = set(), set(), []
        for u in p.units:
            r = rng.random()
            elig = arr.win_ids[arr.eligible[arr.index[u.id]]]
            if r < 0.4:
                keep.add(u.id)
            elif r < 0.7:
                demand.add(u.id)
            elif r < 0.9 and elig.size:
                window.append((u.id, int(rng.choice(elig))))
        ev = evaluate(p, (keep, demand, window))
        fw, bw, exposed = _naive(p, keep, demand, window)
        assert ev.fw_memory == tuple(fw) and ev.bw_memory == tuple(bw)
        assert ev.peak_bytes == max(fw + bw)
        assert ev.exposed_s == pytest.approx(exposed, rel=1e-12, abs=1e-15)


def test_fast_on_48_blocks():
    p = synthetic_problem(48, 40, 2, 0)
    assert len(p.units) > 1900 and p.num_fw_events + p.num_bw_events > 3000
    keep = tuple(u.id for u in p.units if u.first_use is not None or u.must_keep)
    evaluate(p, (keep, ()))                            # builds the per-problem arrays once
    times = []
    for _ in range(5):
        t = time.perf_counter()
        ev = evaluate(p, (keep, ()))
        times.append(time.perf_counter() - t)
    print(f"\nevaluate, 48 blocks ({len(p.units)} units): {min(times) * 1e3:.2f} ms")
    assert ev.peak_bytes == p.reference_peak and ev.violations == ()


def test_cache_follows_the_problem_object():
    p = small()
    assert problem_arrays(p) is problem_arrays(p)
    q = small()                                        # equal, but another object: own arrays
    assert problem_arrays(q) is not problem_arrays(p)
