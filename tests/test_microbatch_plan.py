"""plan_microbatches (a recompute variant per stage and micro-batch) against independent references:
simulate_actions and an interval count of what is alive (replay), brute force over every choice
(the MILP's optimum), and a hand-drawn ZBV timeline (which micro-batches recompute)."""
import importlib.util
import itertools
import random
import shutil

import pytest

from lynx_compile.pipelining.microbatch_milp import smallest_peaks
from lynx_compile.pipelining.microbatch_plan import MicrobatchPlanError, plan_microbatches
from lynx_compile.pipelining.microbatch_replay import StageVariant, replay
from lynx_compile.pipelining.placement import zero_bubble_orders
from lynx_compile.pipelining.schedule_sim import held_microbatches, simulate_actions


def var(name, F, B, W, held, carry, fresh=None):
    return StageVariant(name=name, forward_s=F, input_backward_s=B, weight_backward_s=W, held_bytes=held,
                        carry_bytes=carry, fresh_bytes=fresh)


def alive_reference(order, held, carry, fresh=None):
    """Peak of one rank by intervals over its action positions: micro-batch (s, j) holds
    ``held[s]`` from its F to its B (both included: B reads what F kept), ``fresh[s]`` (default
    ``carry[s]``) at its B (what B creates of the carry; the rest is held bytes) and ``carry[s]``
    after its B until its W (W excluded: the carry dies as W ends, and nothing is counted inside W)."""
    fresh = carry if fresh is None else fresh
    at = {a: k for k, a in enumerate(order)}
    total = [0] * len(order)
    for (kind, s, j), k in at.items():
        if kind == "F":
            for t in range(k, at["B", s, j] + 1):
                total[t] += held[s]
        elif kind == "B":
            total[k] += fresh[s]
            for t in range(k + 1, at["W", s, j]):
                total[t] += carry[s]
    return max(total, default=0)


# ---------------------------------------------------------------- 1. replay is the reference


@pytest.mark.parametrize("schedule,ranks,stages,m", [("ZBVZeroBubble", 2, 4, 4), ("ZBVZeroBubble", 3, 6, 6),
                                                     ("InterleavedZeroBubble", 2, 4, 4),
                                                     ("InterleavedZeroBubble", 3, 3, 6)])
def test_replay_with_one_variant_is_simulate_actions(schedule, ranks, stages, m):
    orders = zero_bubble_orders(schedule, ranks, stages, m)
    rng = random.Random(stages * m)
    for _ in range(5):
        F, B, W, send = ([rng.uniform(0.1, 2.0) for _ in range(stages)] for _ in range(4))
        held, carry = [rng.randint(0, 50) for _ in range(stages)], [rng.randint(0, 50) for _ in range(stages)]
        fresh = [rng.randint(0, c) for c in carry]
        variants = [[var("only", F[s], B[s], W[s], held[s], carry[s])] for s in range(stages)]
        step, peaks = replay(orders, variants, tuple((0,) * m for _ in range(stages)), send)
        assert step == simulate_actions(orders, F, B, W, send).step_s  # the same loop, bit for bit
        assert peaks == tuple(alive_reference(order, held, carry) for order in orders)
        variants = [[var("only", F[s], B[s], W[s], held[s], carry[s], fresh[s])] for s in range(stages)]
        _, peaks = replay(orders, variants, tuple((0,) * m for _ in range(stages)), send)
        assert peaks == tuple(alive_reference(order, held, carry, fresh) for order in orders)


def test_peak_against_held_microbatches():
    """One stage per rank (ZB-H1): the walk's after-F points are held_microbatches' after-F
    pairs, its B point is the after-B pair plus the micro-batch B still reads. So with no carry
    the peak is max f x held over the pairs, with no held bytes max w x carry; in general it lies
    between max(f x held + w x carry) and that plus one held."""
    p, m = 4, 8
    orders = zero_bubble_orders("InterleavedZeroBubble", p, p, m)
    pairs = held_microbatches(orders)
    keep = tuple((0,) * m for _ in range(p))
    for h, c in [(7, 0), (0, 5), (7, 5), (3, 11)]:
        variants = [[var("only", 1.0, 1.0, 1.0, h, c)] for _ in range(p)]
        _, peaks = replay(orders, variants, keep, [0.0] * p)
        for s in range(p):  # stage s sits on rank s
            joint = max(f * h + w * c for f, w in pairs[s])
            assert joint <= peaks[s] <= joint + h
            if c == 0 or h == 0:
                assert peaks[s] == joint


def test_peak_zbv_rank_0_by_hand():
    """ZBV, 2 ranks, 4 micro-batches; rank 0 holds stages 0 (held h0, carry c0) and 3 (h3, c3):

        F00 F01 F02 | F30 B30 W30 F31 B31 W31 | F03 B00 W00 | F32 B32 W32 B01 ...
        h0 2h0 3h0  | 3h0+h3, at B30 3h0+h3+c3  | 4h0, at B00 4h0+c0 | 3h0+h3+c3 at B32 ...

    later points hold less (B01: 3h0 + c0, B33: 2h0 + h3 + c3). Peak: max(4h0 + c0, 3h0 + h3 + c3).
    When a B creates only f of its carry (the rest is held bytes W reads), f replaces c at the B
    points: max(4h0 + f0, 3h0 + h3 + f3)."""
    orders = zero_bubble_orders("ZBVZeroBubble", 2, 4, 4)
    keep = tuple((0,) * 4 for _ in range(4))
    for (h0, c0, h3, c3), want in [((3, 2, 5, 4), 18), ((3, 2, 1, 1), 14)]:
        variants = [[var("a", 1, 1, 1, h0, c0)], [var("b", 1, 1, 1, 0, 0)], [var("c", 1, 1, 1, 0, 0)],
                    [var("d", 1, 1, 1, h3, c3)]]
        assert replay(orders, variants, keep, [0.0] * 4)[1][0] == want == max(4 * h0 + c0, 3 * h0 + h3 + c3)
    for (h0, c0, f0, h3, c3, f3), want in [((3, 2, 1, 5, 4, 0), 14), ((3, 2, 2, 1, 1, 0), 14), ((3, 9, 0, 1, 1, 1), 12)]:
        variants = [[var("a", 1, 1, 1, h0, c0, f0)], [var("b", 1, 1, 1, 0, 0)], [var("c", 1, 1, 1, 0, 0)],
                    [var("d", 1, 1, 1, h3, c3, f3)]]
        assert replay(orders, variants, keep, [0.0] * 4)[1][0] == want == max(4 * h0 + f0, 3 * h0 + h3 + f3)


# ---------------------------------------------------------------- 2. brute force


def two_variants(stages, seed, fresh=False):
    """keep, and recompute-w: W longer, held and carry smaller (as dropping what only W reads).
    ``fresh``: each B creates only part of its carry (the rest is held bytes)."""
    rng = random.Random(seed)
    out = []
    for _ in range(stages):
        F, B, W = rng.choice([0.5, 1.0, 1.5]), rng.choice([0.5, 1.0, 1.5]), rng.choice([0.0, 0.5, 1.0])
        h, c = rng.randint(6, 12), rng.randint(3, 8)
        W2, h2, c2 = W + rng.choice([0.25, 0.5, 1.0]), h - rng.randint(2, 5), c - rng.randint(1, 3)
        f, f2 = (rng.randint(0, c), rng.randint(0, c2)) if fresh else (None, None)
        out.append([var("keep", F, B, W, h, c, f), var("recompute-w", F, B, W2, h2, c2, f2)])
    return out


def three_variants(stages, seed):
    """keep, recompute-b (B longer, less held, same carry), recompute-w (W longer, less carry,
    more held than recompute-b): no variant is smallest in both held and carry."""
    rng = random.Random(seed)
    out = []
    for _ in range(stages):
        F, B, W = 1.0, rng.choice([0.5, 1.0]), rng.choice([0.5, 1.0])
        out.append([var("keep", F, B, W, 10, 6), var("recompute-b", F, B + 0.5, W, 4, 6),
                    var("recompute-w", F, B, W + 0.5, 7, 2)])
    return out


CASES = {
    "zbv-2x4-m3": (("ZBVZeroBubble", 2, 4, 3), two_variants(4, 1), [0.1, 0.0, 0.25, 0.0]),
    "zbv-2x4-m2-w-free": (("ZBVZeroBubble", 2, 4, 2), two_variants(4, 2), [0.0] * 4),
    "izb-2x4-m2": (("InterleavedZeroBubble", 2, 4, 2), two_variants(4, 3), [0.2] * 4),
    "zbv-2x4-m2-three": (("ZBVZeroBubble", 2, 4, 2), three_variants(4, 4), [0.1] * 4),
    "zbv-2x4-m3-fresh": (("ZBVZeroBubble", 2, 4, 3), two_variants(4, 5, fresh=True), [0.1, 0.0, 0.25, 0.0]),
}


def brute(orders, variants, send, m):
    keys = [(s, j) for s in range(len(variants)) for j in range(m)]
    out = {}
    for pick in itertools.product(*(range(len(variants[s])) for s, _ in keys)):
        choice = tuple(tuple(pick[s * m + j] for j in range(m)) for s in range(len(variants)))
        out[choice] = replay(orders, variants, choice, send)
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    (schedule, ranks, stages, m), variants, send = CASES[request.param]
    orders = zero_bubble_orders(schedule, ranks, stages, m)
    every = brute(orders, variants, send, m)
    smallest = tuple(min(p[r] for _, p in every.values()) for r in range(ranks))
    largest = tuple(max(p[r] for _, p in every.values()) for r in range(ranks))
    return orders, variants, send, every, smallest, largest


def best_within(every, limit):
    fit = [step for step, peaks in every.values() if all(p <= l for p, l in zip(peaks, limit))]
    return min(fit) if fit else None


def test_milp_equals_brute_force(case):
    pytest.importorskip("highspy")
    orders, variants, send, every, smallest, largest = case
    mid = tuple((a + b) // 2 for a, b in zip(smallest, largest))
    limits = {smallest, largest, mid, (smallest[0], largest[1]), (mid[0], smallest[1] + 1)}
    for limit in sorted(limits):
        want = best_within(every, limit)
        plan = plan_microbatches(orders, variants, send, limit)
        assert plan.step_s == pytest.approx(want, rel=1e-9, abs=0), limit
        assert plan.status == "optimal" and all(p <= l for p, l in zip(plan.peak_bytes, limit))
        assert (plan.step_s, plan.peak_bytes) == replay(orders, variants, plan.choice, send)
        # the least-work pass: no choice as fast and within the limit does less work
        work = lambda c: sum(variants[s][v].work_s for s, row in enumerate(c) for v in row)  # noqa: E731
        assert work(plan.choice) <= min(work(c) for c, (st, pk) in every.items() if st <= plan.step_s
                                        and all(p <= l for p, l in zip(pk, limit))) + 1e-9
        assert "stage 0" in plan.table(variants)


def test_infeasible_names_the_smallest_peak(case):
    pytest.importorskip("highspy")
    orders, variants, send, every, smallest, largest = case
    limit = (largest[0], smallest[1] - 1)
    with pytest.raises(MicrobatchPlanError, match=rf"rank 1: smallest reachable peak {smallest[1]} B > limit "
                       rf"{smallest[1] - 1} B") as err:
        plan_microbatches(orders, variants, send, limit)
    assert err.value.smallest == smallest and isinstance(err.value, ValueError)
    assert smallest_peaks(orders, variants)[0] == smallest


def test_greedy_fits_or_refuses(case):
    orders, variants, send, every, smallest, largest = case
    mid = tuple((a + b) // 2 for a, b in zip(smallest, largest))
    for limit in (smallest, mid, largest):
        plan = plan_microbatches(orders, variants, send, limit, solver="heu")
        assert plan.solver == "heu" and plan.status == "feasible" and plan.gap is None
        assert all(p <= l for p, l in zip(plan.peak_bytes, limit))
        assert plan.step_s >= best_within(every, limit) - 1e-12
    dominated = all(any(v.held_bytes == min(x.held_bytes for x in vs)
                        and v.carry_bytes == min(x.carry_bytes for x in vs) for v in vs) for vs in variants)
    if dominated or importlib.util.find_spec("highspy"):  # else nothing can name the smallest
        with pytest.raises(MicrobatchPlanError, match=f"smallest reachable peak {smallest[0]} B"):
            plan_microbatches(orders, variants, send, (smallest[0] - 1, largest[1]), solver="heu")


def test_glpk_agrees(case):
    if not shutil.which("glpsol"):
        pytest.skip("GLPK (glpsol) is not installed")
    orders, variants, send, every, smallest, largest = case
    mid = tuple((a + b) // 2 for a, b in zip(smallest, largest))
    plan = plan_microbatches(orders, variants, send, mid, solver="glpk")
    assert plan.solver == "glpk" and plan.step_s == pytest.approx(best_within(every, mid), rel=1e-9, abs=0)


# ---------------------------------------------------------------- 3. recompute lands in bubbles


@pytest.mark.parametrize("unit", [1, 2**30 + 7, 3 * 2**32 + 5])
def test_recompute_goes_where_w_sits_in_a_bubble(unit):
    """ZBV, 2 ranks, 4 micro-batches, F = B = 1, W = 0, free sends (the W-free timeline of
    test_sim_zero_bubble): rank 0 runs

        t   0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
        r0 F00 F01 F02 F30 B30 F31 B31 F03 B00 F32 B32  .  B01 F33 B33 B02  .  B03     step 18

    waiting at 11 for B11 (ends 12) and at 16 for B13 (ends 17). Stage 0's recompute-w variant
    makes W 1 long: W00 (at 9, after B00) pushes F32 B32 to [10, 12), still before B01 may start;
    W02 (at 16) fills the wait for B13. W01 (at 13) pushes F33 B33 B02 and so the step to 19;
    W03 is the last action: 19. Memory (stage 0 keep: held 4, carry 4; recompute-w: 1, 1; stage 3:
    1, 1), the walk's largest points on rank 0:

        B00: h00 + h01 + h02 + h03 + c00 = 20        B01: h01 + h02 + h03 + c01 = 16

    At 13 bytes B00 needs 7 fewer: one recompute lowers it by 6 at most (mb 0: 14), so two are
    needed. Recomputing mb 0 and 2: B00 = 1 + 4 + 1 + 4 + 1 = 11, B01 = 4 + 1 + 4 + 4 = 13. Step 18
    (both W's in waits), the step of keeping everything; any pair with mb 1 or 3 is 19.
    Bytes are in ``unit``s (one, a GiB and 7 bytes, 12 GiB and 5: one byte short of a peak must count)."""
    pytest.importorskip("highspy")
    u = unit
    orders = zero_bubble_orders("ZBVZeroBubble", 2, 4, 4)
    keep1 = var("keep", 1.0, 1.0, 0.0, u, u)
    variants = [[var("keep", 1.0, 1.0, 0.0, 4 * u, 4 * u), var("recompute-w", 1.0, 1.0, 1.0, u, u)], [keep1], [keep1],
                [keep1]]
    everything = tuple((0,) * 4 for _ in range(4))
    assert replay(orders, variants, everything, [0.0] * 4) == (18.0, (20 * u, 5 * u))
    plan = plan_microbatches(orders, variants, [0.0] * 4, [13 * u, 5 * u])
    assert plan.choice[0] == (1, 0, 1, 0) and plan.step_s == 18.0 and plan.peak_bytes == (13 * u, 5 * u)
    for worse in [(1, 1, 0, 0), (1, 0, 0, 1), (0, 1, 1, 0)]:
        assert replay(orders, variants, (worse,) + everything[1:], [0.0] * 4)[0] == 19.0
    assert "recompute-w: mb 0 2" in plan.table(variants)
    # at 16 units one recompute is enough, and the least-work pass keeps it to one (mb 2 also
    # fits the W wait, but mb 0's alone lowers B00 enough: 1 + 4 + 4 + 4 + 1 = 14, B01 16)
    plan = plan_microbatches(orders, variants, [0.0] * 4, [16 * u, 5 * u])
    assert plan.choice[0] == (1, 0, 0, 0) and plan.step_s == 18.0 and plan.peak_bytes == (16 * u, 5 * u)
    # a byte short of 13 units, no pair fits: then mb 0 and 1 (B00 = 1 + 1 + 4 + 4 + 1 = 11,
    # B01 = 1 + 4 + 4 + 1 = 10, B02 = h02 + h03 + c02 = 12), step 19 (W01 is not in a wait);
    # (1, 0, 1, 1) is as fast but recomputes three
    plan = plan_microbatches(orders, variants, [0.0] * 4, [13 * u - 1, 5 * u])
    assert plan.choice[0] == (1, 1, 0, 0) and plan.step_s == 19.0 and plan.peak_bytes == (12 * u, 5 * u)
    assert (plan.solver, plan.status) == ("highs", "optimal")   # not the greedy's fallback


# ---------------------------------------------------------------- 4. progress, time limit


def test_progress_lines(monkeypatch):
    pytest.importorskip("highspy")
    from lynx_compile.solver import milp_solvers

    monkeypatch.setattr(milp_solvers, "PROGRESS_EVERY_S", 0.0)
    (schedule, ranks, stages, m), variants, send = CASES["zbv-2x4-m3"]
    orders = zero_bubble_orders(schedule, ranks, stages, m)
    lines = []
    plan_microbatches(orders, variants, send, [10**6, 10**6], progress=lines.append)
    assert lines[0].startswith("lynx-microbatch[highs]: ") and "binaries" in lines[0]
    assert any(line.startswith("lynx-opt[highs]: ") for line in lines)
    assert lines[-1].startswith("lynx-microbatch[highs]: step ")


def test_time_limit_gives_a_feasible_choice():
    """ZBV 4 ranks, 16 micro-batches, 256 binaries: HiGHS needs ~0.3 s; stopped at 0.01 s it returns
    its incumbent or nothing (then the greedy's choice): either way "feasible", within the limit."""
    pytest.importorskip("highspy")
    rng = random.Random(0)
    orders = zero_bubble_orders("ZBVZeroBubble", 4, 8, 16)
    variants = []
    for _ in range(8):
        F, B, W, h, c = rng.uniform(0.8, 1.2), rng.uniform(0.8, 1.2), rng.uniform(0.5, 1.0), rng.randint(80, 120), \
            rng.randint(40, 60)
        variants.append([var("keep", F, B, W, h, c), var("recompute-w", F, B, W + 0.4 * F, h // 2, c // 3)])
    _, peaks = replay(orders, variants, tuple((0,) * 16 for _ in range(8)), [0.01] * 8)
    limit = [int(0.75 * p) for p in peaks]
    plan = plan_microbatches(orders, variants, [0.01] * 8, limit, time_limit_s=0.01)
    assert plan.status == "feasible" and plan.solver in ("highs", "heu") and plan.notes
    assert all(p <= l for p, l in zip(plan.peak_bytes, limit))


def test_bad_input():
    orders = zero_bubble_orders("ZBVZeroBubble", 2, 4, 2)
    ok = [[var("keep", 1, 1, 1, 1, 1)]] * 4
    with pytest.raises(ValueError, match="at least one"):
        plan_microbatches(orders, ok[:3] + [[]], [0.0] * 4, [10, 10], solver="heu")
    with pytest.raises(ValueError, match="memory_limit has 1"):
        plan_microbatches(orders, ok, [0.0] * 4, [10], solver="heu")
    with pytest.raises(ValueError, match=">= 0"):
        plan_microbatches(orders, ok[:3] + [[var("bad", 1, -1, 1, 1, 1)]], [0.0] * 4, [10, 10], solver="heu")


def test_stage_variants_priced_from_the_curves_by_hand():
    # one block per stage, ZBV, 4 stages on 2 ranks, 4 micro-batches; each block: F 1 ms, backward
    # 3 ms of which W 1 ms; curve: 4 MiB kept exposes 0, 2 MiB 2 ms (1 of it W's), 0 MiB 6 ms
    # (2 of it W's); no working, static or traced carry bytes
    from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
    from lynx_compile.pipelining.plan_stages import plan_stages
    from lynx_compile.pipelining.recompute_curve import RecomputeCurve
    from lynx_compile.pipelining.stage_variants import stage_variants

    MiB, ms = 2**20, 1e-3
    c = RecomputeCurve(kept_bytes=(4 * MiB, 2 * MiB, 0), exposed_s=(0.0, 2 * ms, 6 * ms),
                       exposed_w_s=(0.0, 1 * ms, 2 * ms))
    blocks = tuple(SegmentCost(name=f"blocks.{i}", forward_s=1 * ms, backward_s=3 * ms, weight_backward_s=1 * ms,
                               curve=c, activation_bytes=4 * MiB) for i in range(4))
    costs = PipelineCosts(blocks=blocks)
    plan = plan_stages(costs, 4, 4, 10 * MiB, "ZBVZeroBubble", ranks=2, pinned_cuts=[1, 2, 3])
    sv = stage_variants(plan, costs, ranks=2)
    for s, vs in enumerate(sv.variants):
        by = {v.name: v for v in vs}
        # keep: 4 MiB, B = 3 - 1 = 2 ms, W = 1 ms; the first stage's B computes no input
        # gradient, so its W carries all it keeps (its output's gradient is 0 B here)
        keep = by["keep"]
        assert (keep.held_bytes, keep.input_backward_s, keep.weight_backward_s) == (4 * MiB, 2 * ms, 1 * ms)
        assert keep.carry_bytes == (4 * MiB if s == 0 else 0)
        for v in vs:
            # on the curve's lower segment (0..2 MiB) k MiB kept expose 6 - 2k ms, 2 - k/2 of them W's
            k = v.held_bytes / MiB
            if k <= 2:
                exposed, in_w = (6 - 2 * k) * ms, (2 - k / 2) * ms
                assert v.input_backward_s == pytest.approx(2 * ms + exposed - in_w)
                assert v.weight_backward_s == pytest.approx(1 * ms + in_w)
        # the least point: nothing kept, B 2 + 4 ms, W 1 + 2 ms
        assert any(v.held_bytes == 0 and v.input_backward_s == pytest.approx(6 * ms) for v in vs)
    for vs in sv.variants:  # no variant matched or beaten in held, carry, B and W at once
        keys = [(v.held_bytes, v.carry_bytes, v.input_backward_s, v.weight_backward_s) for v in vs]
        assert len(set(keys)) == len(keys)
        assert not any(a != b and all(x <= y for x, y in zip(a, b)) for a in keys for b in keys)
    # the ranks' limits: 10 MiB less the largest transient, a whole block (4 MiB) brought back
    # while the least variant's backward runs
    assert sv.memory_limit == (6 * MiB, 6 * MiB)
