"""simulate_actions over torch's zero-bubble orders, against hand-drawn timelines (unit times)."""
import itertools
import random

import pytest
import torch

from lynx_compile.pipelining.pipeline_costs import PipelineCosts, SegmentCost
from lynx_compile.pipelining.placement import in_flight, zero_bubble_orders
from lynx_compile.pipelining.plan_stages import plan_stages
from lynx_compile.pipelining.schedule_sim import simulate_actions, simulate_pipeline
from lynx_compile.pipelining.step_time import WEIGHT_SHARE, stage_times


def zb(schedule, ranks, stages, m, F=1.0, B=1.0, W=1.0, s=0.0, **kw):
    orders = zero_bubble_orders(schedule, ranks, stages, m)
    return simulate_actions(orders, [F] * stages, [B] * stages, [W] * stages, [s] * stages, **kw)


def one_f_one_b(p, m, F, B, R=0.0, s=0.0, wait=False):
    return simulate_pipeline([F] * p, [B] * p, [R] * p, [s] * p, "1F1B", m, recompute_in_wait=wait)


def text(orders):
    return [" ".join(f"{k}{s}{j}" for k, s, j in rank) for rank in orders]


def test_zbv_orders_p2_s4_m4():
    # torch's ScheduleZBVZeroBubble, rank r holding stages r and 3 - r (I named B, bubbles dropped):
    # rank 0 warms up with 2P - 1 = 3 forwards of stage 0; rank 1 with F1 F2 F1 F2
    assert text(zero_bubble_orders("ZBVZeroBubble", 2, 4, 4)) == [
        "F00 F01 F02 F30 B30 W30 F31 B31 W31 F03 B00 W00 F32 B32 W32 B01 W01 F33 B33 W33 B02 W02 B03 W03",
        "F10 F20 F11 F21 B20 W20 F12 B10 W10 F22 B21 W21 F13 B11 W11 F23 B22 W22 B12 B23 B13 W12 W23 W13"]


@pytest.mark.parametrize("schedule,ranks,local,m", [("ZBVZeroBubble", 2, 2, 4), ("ZBVZeroBubble", 3, 2, 7),
                                                    ("ZBVZeroBubble", 4, 2, 16),
                                                    ("InterleavedZeroBubble", 2, 2, 4),
                                                    ("InterleavedZeroBubble", 4, 2, 8),
                                                    ("InterleavedZeroBubble", 2, 3, 6)])
def test_orders_are_torchs(schedule, ranks, local, m):
    # torch's own tool for drawing a schedule (it refuses one stage per rank, lynx's path does not)
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    want = [[("B" if a.computation_type.value == "I" else a.computation_type.value, a.stage_index,
              a.microbatch_index) for a in rank if a is not None]
            for rank in vis.get_schedule_ops(schedule, ranks, m, local)]
    assert [list(r) for r in zero_bubble_orders(schedule, ranks, ranks * local, m)] == want


def test_zbv_hand_timeline_p2_s4_m4():
    """F = B = W = 1, free sends. Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.

    t    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
    r0  F00 F01 F02 F30 B30 W30 F31 B31 W31 F03 B00 W00 F32 B32 W32 B01 W01 F33 B33 W33 B02 W02 B03 W03
    r1   .  F10 F20 F11 F21 B20 W20 F12 B10 W10 F22 B21 W21 F13 B11 W11 F23 B22 W22 B12 B23 B13 W12 W23 W13

    Every input is ready when its rank reaches it: F30 at 3 needs F20 (ends 3); B20 at 5 needs
    B30 (ends 5); B00 at 10 needs B10 (ends 9); F32 at 12 needs F22 (ends 11); B01 at 15 needs
    B11 (ends 15); F33 at 17 needs F23 (ends 17); B02 at 20 needs B12 (ends 20); B03 at 22 needs
    B13 (ends 22). Rank 1's F10 waits one unit for F00, then rank 1 needs B23 at 20 (B33 ended
    19), B13 at 21 (B23 ended 21). Neither rank waits after its start: step = 1 + 24 = 25, each
    rank busy 24 (2 stages x 4 micro-batches x 3), idle 1. 1F1B on 2 ranks with the same work
    (F = 2, B = 4 per stage): (m + p - 1)(F + B) = 5 x 6 = 30.
    """
    t = zb("ZBVZeroBubble", 2, 4, 4)
    assert t.step_s == 25.0 and t.busy_s == (24.0, 24.0) and t.idle_s == (1.0, 1.0)
    starts = {(k, s, j): a for _, k, s, j, a, _ in t.events}
    assert [starts["F", 3, j] for j in range(4)] == [3, 6, 12, 17]
    assert [starts["B", 0, j] for j in range(4)] == [10, 15, 20, 22]
    assert [starts["W", 1, j] for j in range(4)] == [9, 15, 22, 24]
    assert one_f_one_b(2, 4, 2.0, 4.0) == 30.0
    assert "bubble" in t.table()


def test_zbv_hand_timeline_without_w():
    """F = B = 1, W = 0 (a W takes no time; drawn as ``.``), free sends::

        t    0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
        r0  F00 F01 F02 F30 B30 F31 B31 F03 B00 F32 B32  .  B01 F33 B33 B02  .  B03
        r1   .  F10 F20 F11 F21 B20 F12 B10 F22 B21 F13 B11 F23 B22 B12 B23 B13

    Rank 0 waits at 11 for B11 (rank 1 ends it at 12) and at 16 for B13 (ends 17): step 18.
    This is the V's lower bound: rank P - 1 (the tip, stages P - 1 and P) cannot start before
    (P - 1)F, holds 2m(F + B) of work and ends with B of stage P - 1, micro-batch m - 1, whose
    gradient still crosses P - 1 stages: 2m(F + B) + (P - 1)(F + B) = 16 + 2 = 18.
    """
    t = zb("ZBVZeroBubble", 2, 4, 4, W=0.0)
    assert t.step_s == 18.0 and t.busy_s == (16.0, 16.0)
    starts = {(k, s, j): a for _, k, s, j, a, _ in t.events}
    assert starts["B", 0, 1] == 12 and starts["B", 0, 3] == 17


@pytest.mark.parametrize("P", [2, 3, 4])
def test_zbv_without_w_meets_the_v_bound(P):
    # the bound above holds for any F, B; with F = B the tip never waits and the step meets it
    # (2P - 1 warm-up forwards on rank 0 are exactly what the tip needs to start its stage P)
    for m, F, B in itertools.product([2 * P, 2 * P + 1, 4 * P], [0.5, 1.0, 2.0], [0.5, 1.0, 2.0]):
        bound = 2 * m * (F + B) + (P - 1) * (F + B)
        step = zb("ZBVZeroBubble", P, 2 * P, m, F=F, B=B, W=0.0).step_s
        assert step >= bound - 1e-9
        if F == B:
            assert step == pytest.approx(bound)


def test_zb_h1_without_w_is_1f1b():
    """InterleavedZeroBubble with one stage per rank is ZB-H1: torch builds it with 1F1B's
    warm-up (P - 1 - r forwards, then F, I pairs, so P - r forwards before the first backward
    on rank r, as ``schedule_order``) and puts a W after I's. A W of zero seconds never delays
    anything (it waits only for a B its own rank already ran), so with W = 0 every rank runs
    1F1B's F/B sequence at the same times: the step equals 1F1B's, whatever the stage times,
    sends and recompute (on demand or in the wait)."""
    rng = random.Random(0)
    for _ in range(60):
        p = rng.randint(2, 5)
        m = p * rng.randint(1, 3)
        F = [rng.uniform(0.1, 2) for _ in range(p)]
        B = [rng.uniform(0.1, 2) for _ in range(p)]
        R = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(p)]
        s = [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(p)]
        orders = zero_bubble_orders("InterleavedZeroBubble", p, p, m)
        for wait in (False, True):
            got = simulate_actions(orders, F, B, [0.0] * p, s, recompute_b_s=R, recompute_in_wait=wait).step_s
            assert got == pytest.approx(simulate_pipeline(F, B, R, s, "1F1B", m, recompute_in_wait=wait), abs=1e-12)


@pytest.mark.parametrize("schedule,local", [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 1),
                                            ("InterleavedZeroBubble", 2), ("InterleavedZeroBubble", 3)])
def test_zero_bubble_beats_1f1b_with_the_same_work(schedule, local):
    # P ranks; 1F1B runs one stage of (local x F, local x (B + W)) per rank, the zero-bubble
    # schedule ``local`` stages of (F, B, W): the same work per rank. With W > 0 and free sends
    # the W's fill the bubbles, so ZB is never slower (strictly faster on every shape here).
    for P in (2, 3, 4):
        S = local * P
        for m in (S, S + P, 2 * S, 3 * S + P):
            if schedule == "InterleavedZeroBubble" and m % max(1, m // P):
                continue  # torch runs micro-batches in rounds of P
            for F, B, W in itertools.product((0.5, 1.0, 2.0), (0.5, 1.0, 2.0), (0.25, 1.0, 2.0)):
                step = zb(schedule, P, S, m, F=F, B=B, W=W).step_s
                assert step < one_f_one_b(P, m, local * F, local * (B + W)), (P, m, F, B, W)


def test_recompute_runs_inside_b_and_w():
    # on demand, recompute is part of the action it serves: R_b = 1 prices as B = 2, R_w = 1 as W = 2
    base = zb("ZBVZeroBubble", 2, 4, 4, B=2.0, W=2.0)
    both = zb("ZBVZeroBubble", 2, 4, 4, recompute_b_s=[1.0] * 4, recompute_w_s=[1.0] * 4)
    assert both.step_s == base.step_s and both.busy_s == base.busy_s
    # W's recompute never waits for another rank: in the wait changes nothing for it
    w_only = zb("ZBVZeroBubble", 2, 4, 4, recompute_w_s=[1.0] * 4)
    assert zb("ZBVZeroBubble", 2, 4, 4, recompute_w_s=[1.0] * 4, recompute_in_wait=True).step_s == w_only.step_s


def test_recompute_hand_p2_s4_m4():
    """F = B = W = 1, free sends, R_b = 1 on stage 0 only: each B0j is 2 long. Nothing waits
    for stage 0's gradients and rank 0 never waited in the timeline above, so its 24 + 4 = 28
    units run back to back; rank 1 still ends at 25: step 28. In the wait changes nothing: rank
    0 never waits for a gradient, so R0j has no wait to hide in."""
    kw = dict(recompute_b_s=[1.0, 0.0, 0.0, 0.0])
    assert zb("ZBVZeroBubble", 2, 4, 4, **kw).step_s == 28.0
    assert zb("ZBVZeroBubble", 2, 4, 4, recompute_in_wait=True, **kw).step_s == 28.0


def test_recompute_in_the_wait_hand_with_sends():
    """F = B = 1, W = 0, every send 1, R_b = 1 on stage 0. On demand rank 0 waits for B10's
    gradient (B10 ends at 11 on rank 1, arrives at 12), then runs R00 B00 over [12, 14]; the last
    backward B03 waits for B13 (arrives at 24) and ends at 26. In the wait, R00 runs over
    [10, 11] inside that wait and B00 ends at 13; likewise R03 runs before B13's gradient
    arrives (23) and the step ends at 24."""
    kw = dict(F=1.0, B=1.0, W=0.0, s=1.0, recompute_b_s=[1.0, 0.0, 0.0, 0.0])
    on_demand = zb("ZBVZeroBubble", 2, 4, 4, **kw)
    in_wait = zb("ZBVZeroBubble", 2, 4, 4, recompute_in_wait=True, **kw)
    end = {(k, s, j): (a, b) for _, k, s, j, a, b in on_demand.events}
    assert end["B", 0, 0] == (12.0, 14.0) and end["B", 0, 3] == (24.0, 26.0) and on_demand.step_s == 26.0
    end = {(k, s, j): (a, b) for _, k, s, j, a, b in in_wait.events}
    assert end["R", 0, 0] == (10.0, 11.0) and end["B", 0, 0] == (12.0, 13.0) and in_wait.step_s == 24.0
    assert in_wait.busy_s == on_demand.busy_s == (20.0, 16.0)


def test_recompute_in_the_wait_never_slower():
    for schedule, P, local in [("ZBVZeroBubble", 2, 2), ("ZBVZeroBubble", 3, 2), ("InterleavedZeroBubble", 2, 2),
                               ("InterleavedZeroBubble", 3, 1)]:
        S = P * local
        for m, R, s in itertools.product([S, 2 * S], [0.5, 2.0], [0.0, 0.3]):
            rec = [R * (i % 2) for i in range(S)]
            slow = zb(schedule, P, S, m, B=1.5, W=0.5, s=s, recompute_b_s=rec).step_s
            fast = zb(schedule, P, S, m, B=1.5, W=0.5, s=s, recompute_b_s=rec, recompute_in_wait=True).step_s
            assert fast <= slow + 1e-12


def test_sends_cost_only_between_ranks():
    # ZBV on 2 ranks: stages 1 and 2 share rank 1, so send_s[1] (between them) costs nothing;
    # send_s[0] (stage 0 on rank 0 -> stage 1 on rank 1) does
    orders = zero_bubble_orders("ZBVZeroBubble", 2, 4, 4)
    free_mid = simulate_actions(orders, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0, 5.0, 0.0, 0.0])
    assert free_mid.step_s == 25.0
    assert simulate_actions(orders, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.5, 0.0, 0.0, 0.0]).step_s > 25.0


def test_orders_must_hold_f_b_w_once():
    orders = [list(r) for r in zero_bubble_orders("ZBVZeroBubble", 2, 4, 4)]
    orders[0].remove(("W", 0, 3))
    with pytest.raises(ValueError, match="not F, B and W"):
        simulate_actions(orders, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4)
    orders[0].append(("W", 1, 3))  # stage 1 lives on rank 1
    with pytest.raises(ValueError, match="two ranks"):
        simulate_actions(orders, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 4)
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        zero_bubble_orders("ZBVZeroBubble", 2, 2, 4)


@pytest.mark.parametrize("schedule,local", [("ZBVZeroBubble", 2), ("InterleavedZeroBubble", 1),
                                            ("InterleavedZeroBubble", 2), ("InterleavedZeroBubble", 3)])
def test_in_flight_matches_torchs_order(schedule, local):
    # the planner's memory model: micro-batches a stage holds between its F and its B, replayed
    # from the order the simulator runs (W's carry from B is not counted, as in ``in_flight``)
    for P in (2, 3, 4):
        S = local * P
        for m in (S, 2 * S, 3 * S):
            held, peak = [0] * S, [0] * S
            for rank in zero_bubble_orders(schedule, P, S, m):
                for kind, s, _ in rank:
                    held[s] += {"F": 1, "B": -1, "W": 0}[kind]
                    peak[s] = max(peak[s], held[s])
            assert peak == [in_flight(schedule, S, m, i, P) for i in range(S)]


def blocks(n, F, B, W=None):
    return tuple(SegmentCost(name=f"blocks.{i}", forward_s=F, backward_s=B, weight_backward_s=W) for i in range(n))


def test_plan_stages_prices_zbv_with_w():
    ms = 1e-3
    # four blocks of F = 1, backward 2 of which W = 1 (given, or WEIGHT_SHARE = 0.5 of it): the
    # hand timeline above in ms; 1F1B on 2 ranks with two blocks per stage: 30 ms
    for W in (1 * ms, None):
        costs = PipelineCosts(blocks=blocks(4, 1 * ms, 2 * ms, W))
        plan = plan_stages(costs, 4, 4, schedule="ZBVZeroBubble", ranks=2)
        assert plan.predicted_step_s == pytest.approx(25 * ms) == plan.predicted_step_in_wait_s
    assert WEIGHT_SHARE == 0.5
    plan = plan_stages(PipelineCosts(blocks=blocks(4, 1 * ms, 2 * ms)), 2, 4, schedule="1F1B")
    assert plan.predicted_step_s == pytest.approx(30 * ms)
    # W = 0: B carries the whole backward, the V bound 2m(F + B) + (P - 1)(F + B) with F = 1, B = 2
    # is not met (F != B): the simulated step is at least 2*4*3 + 3 = 27 ms
    plan = plan_stages(PipelineCosts(blocks=blocks(4, 1 * ms, 2 * ms, 0.0)), 4, 4, schedule="ZBVZeroBubble")
    assert plan.predicted_step_s >= 27 * ms - 1e-12


def test_stage_times_split_w_from_segments():
    costs = PipelineCosts(blocks=blocks(2, 1.0, 2.0, 0.5),
                          pre=SegmentCost(name="<pre>", forward_s=0.1, backward_s=0.2, weight_backward_s=0.2),
                          post=SegmentCost(name="<post>", forward_s=0.3, backward_s=0.4))
    plan = plan_stages(costs, 2, 2)
    fwd, bwd, wgt, send = stage_times(plan.stages, costs)
    assert fwd == pytest.approx([1.1, 1.3]) and bwd == pytest.approx([2.2, 2.4])
    assert wgt == pytest.approx([0.7, 0.5 + WEIGHT_SHARE * 0.4]) and send == [0.0, 0.0]


def test_census_weight_share_of_a_gpt_block():
    from lynx_compile.models import build_model, example_batch
    from lynx_compile.pipelining.forward_census import forward_census, param_bytes

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    paths = [f"model.blocks.{i}" for i in range(2)]

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, idx):
            return self.model.logits(idx)

    params, share = forward_census(Logits(), (example_batch(model, 2),), paths)
    h, s = 64, 32  # gpt-tiny: linears 24Bsh^2, attention scores 4Bs^2h -> W share 3h / (6h + s)
    assert share["model.blocks.0"] == pytest.approx(3 * h / (6 * h + s)) == share["model.blocks.1"]
    assert share["<pre>"] == 0.0  # the embedding's gradient is a scatter-add, no matmul
    assert share["<post>"] == pytest.approx(0.5)  # the tied LM head: dx and dW, one matmul each
    assert params == param_bytes(Logits(), (example_batch(model, 2),), paths)
