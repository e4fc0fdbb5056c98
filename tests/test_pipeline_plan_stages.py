"""plan_stages against hand-computed references (bytes in MiB, times in ms)."""
import itertools
import json

import pytest

from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
from lynx_compile.pipelining.placement import in_flight
from lynx_compile.pipelining.plan_stages import plan_stages, uniform_cuts
from lynx_compile.pipelining.recompute_curve import RecomputeCurve, allocate, allocate_with_transient, transient_bytes
from lynx_compile.pipelining.stage_plan import StagePlanError
from lynx_compile.pipelining.stage_pricer import StagePricer

MiB, ms = 2**20, 1e-3


def curve(*pts):  # (MiB, ms) pairs
    return RecomputeCurve(kept_bytes=tuple(int(x * MiB) for x, _ in pts), exposed_s=tuple(y * ms for _, y in pts))


def block(i, f=1.0, b=2.0, cv=None, param_mib=0.0):
    return SegmentCost(name=f"blocks.{i}", forward_s=f * ms, backward_s=b * ms, curve=cv,
                       param_bytes=int(param_mib * MiB))


def starts(plan):
    return [s.blocks[0] for s in plan.stages[1:]]


A = curve((0, 10), (1, 8), (2, 3), (3, 3.5), (4, 0))  # hull (0,10) (2,3) (4,0): slopes 3.5, 1.5 ms/MiB
B = curve((1, 6), (3, 0))                             # slope 3 ms/MiB over 2 MiB
C = curve((0, 4), (4, 0))                             # slope 1 ms/MiB over 4 MiB


def test_hull_drops_dominated_and_non_convex_points():
    # (3, 3.5) is above (2, 3): dominated. (1, 8) lies above the chord (0,10)-(2,3) (at x=1: 6.5 < 8).
    assert A.hull() == ((0, 10 * ms), (2 * MiB, 3 * ms), (4 * MiB, 0.0))
    # duplicate byte count: the cheaper point wins; unsorted input is fine
    d = RecomputeCurve(kept_bytes=(2 * MiB, 0, 0), exposed_s=(0.0, 5 * ms, 7 * ms))
    assert d.hull() == ((0, 5 * ms), (2 * MiB, 0.0))
    assert (A.min_bytes, A.max_bytes, B.min_bytes) == (0, 4 * MiB, MiB)


def test_allocate_two_curves_fractional_last_segment():
    # least kept 0 + 1 = 1 MiB, exposed 10 + 6 = 16 ms; room 4 MiB leaves 3 MiB:
    # A seg 1 (3.5 ms/MiB, 2 MiB) -> 9 ms, 1 MiB left; B (3 ms/MiB) half taken -> 9 - 3 = 6 ms
    kept, exposed, fits = allocate([A, B], 4 * MiB)
    assert (kept, fits) == (4 * MiB, True) and exposed == pytest.approx(6 * ms)
    # everything fits: 4 + 3 MiB, nothing exposed
    kept, exposed, fits = allocate([A, B], 100 * MiB)
    assert (kept, fits) == (7 * MiB, True) and exposed == pytest.approx(0.0)


def test_allocate_three_curves():
    # least 1 MiB, 20 ms; room 8 MiB -> 7 MiB to spend: A1 2 MiB (-7), B 2 MiB (-6), A2 2 MiB (-3),
    # C 1 of 4 MiB (-1): 20 - 17 = 3 ms
    kept, exposed, fits = allocate([A, B, C], 8 * MiB)
    assert (kept, fits) == (8 * MiB, True) and exposed == pytest.approx(3 * ms)


def test_allocate_below_minimum_does_not_fit():
    kept, exposed, fits = allocate([A, B], MiB - 1)
    assert (kept, fits) == (MiB, False) and exposed == pytest.approx(16 * ms)
    assert allocate([A, B], MiB)[2] is True


def test_transient_and_fixed_point():
    X = curve((1, 4), (3, 0))  # 1..3 MiB, slope 2 ms/MiB; two of them: least 2 MiB at 8 ms, all 6 MiB
    # T = largest max_bytes - kept / n, clamped at 0
    assert transient_bytes([], 5 * MiB) == 0
    assert transient_bytes([X, X], 2 * MiB) == 2 * MiB and transient_bytes([X, X], 5 * MiB) == MiB // 2
    assert transient_bytes([X, X], 6 * MiB) == 0 == transient_bytes([X, X], 8 * MiB)
    assert transient_bytes([A, B], 4 * MiB) == 2 * MiB  # largest 4 MiB (A) minus 4 / 2
    # room 7: T0 = 3 - 2/2 = 2 -> allocate 5 (exposed 8 - 2*3 = 2 ms); implied T = 3 - 5/2 = 0.5 ->
    # allocate 6.5 -> keeps all 6, implied T = 0 -> allocate 7 -> 6, T stays 0: done
    kept, exposed, fits, t = allocate_with_transient([X, X], 7 * MiB)
    assert (kept, fits, t) == (6 * MiB, True, 0) and exposed == pytest.approx(0.0)
    # the old reserve (the largest block at full size) leaves 7 - 3 = 4 MiB: 8 - 2*2 = 4 ms exposed
    kept, exposed, fits = allocate([X, X], 7 * MiB - X.max_bytes)
    assert (kept, fits) == (4 * MiB, True) and exposed == pytest.approx(4 * ms)
    # room 4: T0 = 2 leaves 2 = the least (8 ms) and implies T = 2 again: fits at full recompute,
    # where the old reserve (4 - 3 = 1 < 2) did not fit at all
    kept, exposed, fits, t = allocate_with_transient([X, X], 4 * MiB)
    assert (kept, fits, t) == (2 * MiB, True, 2 * MiB) and exposed == pytest.approx(8 * ms)
    assert allocate([X, X], 4 * MiB - X.max_bytes)[2] is False
    kept, exposed, fits, t = allocate_with_transient([X, X], 4 * MiB - 1)
    assert (kept, fits, t) == (2 * MiB, False, 2 * MiB)
    # room 5.5: kept + 3 - kept/2 <= 5.5 -> kept* = 5; rounds 3.5, 4.25, 4.625, ... halve the gap
    # (1.5 MiB) 8 times: kept within 1.5 MiB / 256 below 5, and kept + its T always within room
    kept, exposed, fits, t = allocate_with_transient([X, X], 11 * MiB // 2)
    assert fits and 5 * MiB - 1.5 * MiB / 256 - 2 <= kept <= 5 * MiB and kept + t <= 11 * MiB // 2
    assert t >= transient_bytes([X, X], kept) and exposed == pytest.approx((8 - 2 * (kept / MiB - 2)) * ms)


def test_in_flight():
    assert [in_flight("1F1B", 4, 8, i) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", 4, 2, i) for i in range(4)] == [2, 2, 2, 1]
    assert [in_flight("Interleaved1F1B", 3, 5, i) for i in range(3)] == [3, 2, 1]
    assert [in_flight("GPipe", 4, 8, i) for i in range(4)] == [8, 8, 8, 8]


def test_uniform_cuts():
    assert uniform_cuts(8, 4) == [2, 4, 6]
    assert uniform_cuts(10, 4) == [2, 4, 7]  # sizes 2, 2, 3, 3
    assert uniform_cuts(3, 3) == [1, 2] and uniform_cuts(5, 1) == []


def compute_costs(pre=(0, 0), post=(0, 0), n=7):
    return PipelineCosts(blocks=tuple(block(i) for i in range(n)),
                         pre=SegmentCost(name="<pre>", forward_s=pre[0] * ms, backward_s=pre[1] * ms),
                         post=SegmentCost(name="<post>", forward_s=post[0] * ms, backward_s=post[1] * ms))


@pytest.mark.parametrize("method", ["compute", "lynx"])
def test_no_memory_limit_balances_compute(method):
    # 7 blocks of 3 ms + post 6 ms = 27 ms: the only split with max 9 ms is 3 | 3 | 1 + post
    plan = plan_stages(compute_costs(post=(2, 4)), 3, 3, method=method)
    assert plan.layers_per_stage == (3, 3, 1) and plan.cuts == ("blocks.3", "blocks.6")
    assert [s.time_s for s in plan.stages] == pytest.approx([9 * ms] * 3)
    # every stage has F = 3, B = 6: uniform 1F1B, (m + p - 1)(F + B) = 5 * 9 = 45 ms
    assert plan.predicted_step_s == pytest.approx(45 * ms) == plan.predicted_step_in_wait_s
    # heavy pre: mirror image
    assert plan_stages(compute_costs(pre=(2, 4)), 3, 3, method=method).layers_per_stage == (1, 3, 3)
    # 4 blocks + post 6 ms, p = 2: 3 | 1 + post gives 9 | 9
    assert plan_stages(compute_costs(post=(2, 4), n=4), 2, 2, method=method).layers_per_stage == (3, 1)


def memory_costs():
    # blocks 3 ms, curve: keeps 2 MiB at 4 ms exposed, 3 MiB at 0. 1F1B p=2, m=2: in flight 2, 1.
    return PipelineCosts(blocks=tuple(block(i, cv=curve((2, 4), (3, 0))) for i in range(4)))


def test_memory_bound_lynx_shifts_blocks_to_late_stages():
    costs, mem = memory_costs(), 10 * MiB
    # No params, no working bytes: a stage's room is mem / k (stage 0: 5 MiB, stage 1: 10 MiB) and must
    # hold kept + T, T = 3 - kept / n (n blocks; the largest block minus its share of the kept bytes).
    # The fixed point starts at T0 = 3 - 2 = 1 (every block at its least 2 MiB).
    # 2|2: stage 0 allocates 5 - 1 = 4 = its least (full recompute): 6 + 2 * 4 = 14 ms; implied
    #      T = 3 - 4/2 = 1, no smaller: done (kept 4 + T 1 = 5). Stage 1 allocates 10 - 1 = 9 >= 6:
    #      keeps all, T -> 3 - 6/2 = 0: 6 ms.                                      bottleneck 14
    # 1|3: stage 0 allocates 5 - 1 = 4 >= 3: keeps all, 3 ms (T -> 0);
    #      stage 1 allocates 10 - 1 = 9 = all 3 blocks, T -> 3 - 9/3 = 0: 9 ms.    bottleneck 9
    # 3|1: stage 0's least 6 MiB > 5 - 1: does not fit.
    lynx = plan_stages(costs, 2, 2, mem)
    comp = plan_stages(costs, 2, 2, mem, method="compute")
    uni = plan_stages(costs, 2, 2, mem, method="uniform")
    assert comp.layers_per_stage == uni.layers_per_stage == (2, 2)
    assert lynx.layers_per_stage == (1, 3)
    assert lynx.layers_per_stage[0] < comp.layers_per_stage[0]
    assert lynx.bottleneck_s == pytest.approx(9 * ms) and comp.bottleneck_s == pytest.approx(14 * ms)
    assert lynx.bottleneck_s <= uni.bottleneck_s and lynx.bottleneck_s <= comp.bottleneck_s
    s0 = comp.stages[0]  # budget = allowance mem / k = 5 MiB; kept 4 MiB + T 1 MiB fill it
    assert (s0.in_flight, s0.budget_bytes, s0.kept_bytes, s0.recompute_s) == (2, 5 * MiB, 4 * MiB, pytest.approx(8 * ms))
    assert s0.peak_bytes == 9 * MiB  # 0 + 2*4 + 0 + 1
    # peak = static + k * kept + working + T: stage 0 0 + 2*3 + 0 + 0 = 6, stage 1 0 + 1*9 + 0 + 0 = 9 MiB
    assert [s.peak_bytes for s in lynx.stages] == [6 * MiB, 9 * MiB]
    assert lynx.fits and all(s.peak_bytes <= mem for s in lynx.stages)


def brute_costs():
    fs = [1.0, 2.0, 1.5, 1.0, 3.0, 1.0]
    pts = [((1, 3), (3, 0)), ((1, 5), (2, 1), (4, 0)), ((2, 2), (3, 0)), ((1, 6), (2, 2), (3, 0)),
           ((1, 1), (5, 0)), ((1, 4), (4, 0))]
    blocks = tuple(block(i, f, 2 * f, curve(*pts[i]), param_mib=0.25 * (i % 3)) for i, f in enumerate(fs))
    return PipelineCosts(blocks=blocks, working_bytes=MiB // 2, post=SegmentCost(name="<post>", forward_s=ms,
                         backward_s=2 * ms, activation_bytes=MiB))


@pytest.mark.parametrize("schedule,m", [("1F1B", 3), ("1F1B", 5), ("GPipe", 2)])
# least (static + k * (least kept + working + T at least kept)): 15 (1F1B, split 1|2|3+post: stage 1
# 1 + 2 MiB static + 2 * (3 + 0.5 + (4 - 3/2))), just under 17 1/3 (GPipe, 3|2|1+post: stage 0
# 3 + 2 * (4 + 0.5 + int(4 - 4/3 MiB)))
@pytest.mark.parametrize("mem_mib", [8, 14.5, 15, 17, 17.5, 24, 40])
def test_lynx_matches_brute_force(schedule, m, mem_mib):
    costs, p, mem = brute_costs(), 3, int(mem_mib * MiB)
    pr = StagePricer(costs, p, m, mem, schedule)
    best = least = float("inf")
    for cuts in itertools.combinations(range(1, 6), p - 1):
        ranges = list(enumerate(zip((0, *cuts), (*cuts, 6))))
        infos = [pr.price(i, s, e) for i, (s, e) in ranges]
        best = min(best, max(x.time_s if x.fits else float("inf") for x in infos))
        least = min(least, max(pr.min_memory(i, s, e) for i, (s, e) in ranges))
    assert (best < float("inf")) == (least <= mem)
    if best == float("inf"):
        with pytest.raises(StagePlanError, match=rf"needs {least} B"):
            plan_stages(costs, p, m, mem, schedule)
        return
    plan = plan_stages(costs, p, m, mem, schedule)
    assert plan.fits and plan.bottleneck_s == pytest.approx(best)
    comp = plan_stages(costs, p, m, mem, schedule, method="compute")
    if comp.fits:  # a split that does not fit is priced at full recompute: not comparable
        assert plan.bottleneck_s <= comp.bottleneck_s + 1e-12


def test_errors():
    costs = compute_costs(n=3)
    with pytest.raises(StagePlanError, match=r"num_stages <= 3"):
        plan_stages(costs, 4, 8)
    with pytest.raises(StagePlanError, match=r"use num_microbatches >= 3"):
        plan_stages(costs, 3, 2)
    plan_stages(costs, 3, 2, schedule="GPipe")  # GPipe needs no fill
    with pytest.raises(StagePlanError, match=r"schedule='ZB'.*choose one of"):
        plan_stages(costs, 2, 2, schedule="ZB")
    with pytest.raises(StagePlanError, match=r"method='greedy'.*choose one of"):
        plan_stages(costs, 2, 2, method="greedy")
    with pytest.raises(StagePlanError, match=r"pinned cuts \[3\]"):
        plan_stages(costs, 2, 2, pinned_cuts=[3])


def test_memory_too_small_names_least_memory():
    # 4 blocks: 1 MiB params (x4 state = 4 MiB static), min kept 1 MiB, max 2 MiB; working 0.5 MiB;
    # 1F1B p=2, m=2 (k = 2, 1). At full recompute T = 2 - (n * 1) / n = 1 MiB for every stage.
    # static + k * (min + working + T):  1|3: 4 + 2*2.5 = 9,     12 + 1*4.5 = 16.5 -> 16.5
    #                                    2|2: 8 + 2*3.5 = 15,     8 + 1*3.5 = 11.5 -> 15   <- least
    #                                    3|1: 12 + 2*4.5 = 21,    4 + 1*2.5 = 6.5  -> 21
    blocks = tuple(block(i, cv=curve((1, 4), (2, 0)), param_mib=1) for i in range(4))
    costs = PipelineCosts(blocks=blocks, working_bytes=MiB // 2)
    pr = StagePricer(costs, 2, 2, None, "1F1B")  # brute force over the three splits agrees
    assert min(max(pr.min_memory(0, 0, c), pr.min_memory(1, c, 4)) for c in (1, 2, 3)) == 15 * MiB
    with pytest.raises(StagePlanError, match=rf"needs {15 * MiB} B \(15\.00MiB\)"):
        plan_stages(costs, 2, 2, 15 * MiB - 1)
    # at 15 MiB only 2|2 fits: stage 0 allowance (15 - 8) / 2 = 3.5, room 3.5 - 0.5 = 3, minus T0 = 1
    # leaves 2 = its least; implied T = 2 - 2/2 = 1, no smaller. (1|3: stage 1 room 15 - 12 - 0.5 = 2.5
    # < 3 + 1; 3|1: stage 0 room (15 - 12) / 2 - 0.5 = 1 < 3 + 1.)
    plan = plan_stages(costs, 2, 2, 15 * MiB)
    assert plan.layers_per_stage == (2, 2) and plan.fits
    assert plan.stages[0].kept_bytes == 2 * MiB and plan.stages[0].recompute_s == pytest.approx(8 * ms)
    # peak = static + k * kept + working + T = 8 + 2*2 + 0.5 + 1 = 13.5 (the fit test is stricter: 8 + 2*3.5)
    assert plan.stages[0].peak_bytes == 27 * MiB // 2
    # compute/uniform do not raise; they say what does not fit
    bad = plan_stages(costs, 2, 2, 10 * MiB, method="uniform")
    assert not bad.fits and "do not fit" in bad.notes[0]


def test_pinned_cuts():
    costs = compute_costs(post=(2, 4))
    fixed = plan_stages(costs, 3, 3, pinned_cuts=[2, 1])
    assert fixed.layers_per_stage == (1, 1, 5) and "pinned cuts at blocks [1, 2]" in fixed.notes
    # free optimum is [3, 6]; a pin at 4 forbids stages straddling it: [4, 5] and [4, 6] give 12 ms
    # (12 | 3 | 12, 12 | 6 | 9), anything with a stage spanning 0..4+ or 4 on the last is worse
    pinned = plan_stages(costs, 3, 3, pinned_cuts=[4])
    assert 4 in starts(pinned) and pinned.bottleneck_s == pytest.approx(12 * ms)
    assert all(not (s.blocks[0] < 4 < s.blocks[1]) for s in pinned.stages)


def test_json_round_trips():
    costs = brute_costs()
    plan = plan_stages(costs, 3, 3, 24 * MiB)
    d = json.loads(plan.to_json())
    assert d["layers_per_stage"] == list(plan.layers_per_stage) and d["cuts"] == list(plan.cuts)
    assert json.loads(plan_stages(costs, 3, 3).to_json())["stages"][0]["budget_bytes"] is None
    assert PipelineCosts.from_dict(costs.to_dict()) == costs
    assert PipelineCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    assert "stage 0" in plan.table()


def test_param_bytes_follow_blocks_traced_through_a_bound_forward():
    """The pipeline traces ``model.logits`` through a wrapper, so dynamo names the blocks
    ``_fn.__self__.blocks.N`` while the wrapper's modules are ``model.blocks.N``: each block
    still gets its own parameters (it once charged every weight to the stage before the blocks)."""
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.pipelining.local_pipeline import _Forward
    from lynx_compile.pipelining.forward_census import param_bytes

    model = build_model("gpt-tiny")
    paths = [f"_fn.__self__.blocks.{i}" for i in range(len(model.blocks))]
    got = param_bytes(_Forward(model, model.logits), (example_batch(model, 1),), paths)
    for i, path in enumerate(paths):
        assert got[path] == sum(p.numel() * p.element_size() for p in model.blocks[i].parameters())
    outside = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
    assert 0 < got["<pre>"] <= outside and got["<post>"] <= outside


def test_weight_share_interpolates_and_zero_bubble_runs_it_in_w():
    from lynx_compile.pipelining.recompute_curve import weight_share

    # exposed 10 ms at 0 MiB (4 of them W's), 2 ms at 2 MiB (all W's), 0 at 4 MiB
    c = RecomputeCurve(kept_bytes=(0, 2 * MiB, 4 * MiB), exposed_s=(10 * ms, 2 * ms, 0.0),
                       exposed_w_s=(4 * ms, 2 * ms, 0.0))
    assert c.weight_share(0) == pytest.approx(0.4)
    assert c.weight_share(MiB) == pytest.approx(3 / 6)        # (4 + 2) / 2 of (10 + 2) / 2
    assert c.weight_share(2 * MiB) == pytest.approx(1.0)
    assert c.weight_share(4 * MiB) == 0.0                     # nothing exposed
    assert curve((0, 10), (4, 0)).weight_share(0) == 0.0      # not known: all B
    # two blocks keeping 2 MiB together: 1 MiB each, 6 ms exposed each, half of it W's
    assert weight_share([c, c], 2 * MiB) == pytest.approx(0.5)
    # a ZBV stage plan prices the W part in W: the same costs with the share unknown put it all
    # in B, and B is what the previous stage waits for
    blocks = tuple(SegmentCost(name=f"blocks.{i}", forward_s=1 * ms, backward_s=2 * ms, curve=c,
                               weight_backward_s=1 * ms, carry_bytes=0) for i in range(4))
    costs = PipelineCosts(blocks=blocks)
    mem = 4 * 2 * MiB  # stage 0 holds 4 micro-batches: 2 MiB each, 1 MiB per block
    plan = plan_stages(costs, 4, 4, mem, "ZBVZeroBubble", ranks=2, pinned_cuts=[1, 2, 3])
    unknown = plan_stages(PipelineCosts(blocks=tuple(
        SegmentCost(name=b.name, forward_s=b.forward_s, backward_s=b.backward_s, weight_backward_s=b.weight_backward_s,
                    curve=RecomputeCurve(kept_bytes=c.kept_bytes, exposed_s=c.exposed_s)) for b in blocks)),
        4, 4, mem, "ZBVZeroBubble", ranks=2, pinned_cuts=[1, 2, 3])
    s0 = plan.stages[0]
    assert s0.recompute_s > 0 and s0.recompute_w_s == pytest.approx(s0.recompute_s * weight_share([c], s0.kept_bytes))
    assert unknown.stages[0].recompute_w_s == 0.0
    # stages 0-2 keep nothing (10 ms exposed, 4 of it W's): the step falls from 114 to 105 ms
    assert plan.predicted_step_s < unknown.predicted_step_s
