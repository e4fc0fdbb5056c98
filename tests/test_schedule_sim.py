"""simulate_pipeline against closed-form and hand-drawn timelines (times in ms)."""
import itertools
import types

import pytest

from lynx_compile.pipelining.schedule_sim import schedule_order, simulate_pipeline


def sim(p, m, F, B, R=0.0, s=0.0, schedule="1F1B", wait=False):
    return simulate_pipeline([F] * p, [B] * p, [R] * p, [s] * p, schedule, m, recompute_in_wait=wait)


def test_1f1b_hand_timeline_p2_m2():
    # F=1, B=2. stage 0 order F0 F1 B0 B1; stage 1 order F0 B0 F1 B1.
    # s0: F0 [0,1]  F1 [1,2]                      B0 [4,6]        B1 [7,9]
    # s1:           F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    # step 9 = (m + p - 1)(F + B) = 3 * 3
    assert sim(2, 2, 1.0, 2.0) == pytest.approx(9.0)


@pytest.mark.parametrize("p,m,F,B", [(2, 2, 1, 2), (4, 8, 1, 2), (4, 8, 2, 1), (3, 5, 1.5, 2.5), (4, 4, 1, 1),
                                     (1, 3, 1, 2)])
def test_1f1b_uniform_closed_form(p, m, F, B):
    # fill: F0 reaches the last stage at (p-1)F; the last stage then runs F,B back to back m times
    # (no stage ever starves it with zero sends); drain: its last B takes (p-1)B to reach stage 0.
    # (p-1)F + m(F+B) + (p-1)B = (m+p-1)(F+B).   p=4, m=8, F=1, B=2: 3 + 24 + 6 = 33 = 11 * 3
    assert sim(p, m, F, B) == pytest.approx((m + p - 1) * (F + B))


@pytest.mark.parametrize("p,m,F,B", [(2, 2, 1, 2), (4, 8, 1, 2), (3, 2, 2, 1), (4, 1, 1, 3)])
def test_gpipe_uniform_closed_form(p, m, F, B):
    # the last stage ends its m forwards at (m+p-1)F, then m backwards, then (p-1)B of drain.
    # p=2, m=2, F=1, B=2: s1 F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7]; s0 B0 [5,7] B1 [7,9] -> 9 = 3 + 6
    assert sim(p, m, F, B, schedule="GPipe") == pytest.approx((m + p - 1) * F + (m + p - 1) * B)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("wait", [False, True])
def test_single_stage(schedule, wait):
    # nothing to wait for: each micro-batch is F, R, B back to back
    assert sim(1, 5, 1.0, 2.0, R=0.5, schedule=schedule, wait=wait) == pytest.approx(5 * 3.5)


def test_send_time_fill_and_drain_p2_m1():
    # F=1, B=2, s=0.5. s0 F0 [0,1] -send-> s1 F0 [1.5,2.5] B0 [2.5,4.5] -send-> s0 B0 [5,7]
    # = F + s + F + B + s + B = 2(F+B) + 2(p-1)s = 7
    assert sim(2, 1, 1.0, 2.0, s=0.5) == pytest.approx(7.0)
    # p=4, m=1: 4F + 4B + 6s = 15
    assert sim(4, 1, 1.0, 2.0, s=0.5) == pytest.approx(15.0)
    # p=2, m=2 also matches (m+p-1)(F+B) + 2(p-1)s = 9 + 1 = 10:
    # s0 F0 [0,1] F1 [1,2]                        B0 [5,7]          B1 [8,10]
    # s1       F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]
    assert sim(2, 2, 1.0, 2.0, s=0.5) == pytest.approx(10.0)


def test_send_time_also_stalls_the_steady_state():
    # p=2, m=3 (F=1, B=2, s=0.5): stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2.
    # s0: F0 [0,1] F1 [1,2] B0 [5,7] F2 [7,8] B1 [8,10]                 B2 [12,14]
    # s1: F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5] (idle) F2 [8.5,9.5] B2 [9.5,11.5]
    # F2 leaves stage 0 only after B0, whose gradient crossed the link: 14, not 4*3 + 2*0.5 = 13.
    assert sim(2, 3, 1.0, 2.0, s=0.5) == pytest.approx(14.0)
    # steady state: the cycle s0 F_j -> s1 F_j -> ... -> s_last B_j -> ... -> s0 B_j -> s0 F_{j+p}
    # advances p micro-batches per p(F+B) + 2(p-1)s
    for p, m in [(2, 1), (2, 4), (4, 2), (4, 4), (3, 3)]:
        gap = sim(p, m + p, 1.0, 2.0, s=0.5) - sim(p, m, 1.0, 2.0, s=0.5)
        assert gap == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.5)


def test_recompute_in_wait_p2_m2():
    # F=1, B=2, R=1.
    # on demand:  s1 F0 [1,2] RB0 [2,5] F1 [5,6] RB1 [6,9]; s0 RB0 [5,8] RB1 [9,12]   -> 12 = 3 * (F+B+R)
    assert sim(2, 2, 1.0, 2.0, R=1.0) == pytest.approx(12.0)
    # in the wait: s1 is never waiting (loss is local): same 5, 6, 9.
    #   s0: free at 2, R0 [2,3], grad at 5 -> B0 [5,7]; R1 [7,8], grad at 9 -> B1 [9,11]  -> 11
    assert sim(2, 2, 1.0, 2.0, R=1.0, wait=True) == pytest.approx(11.0)


def test_recompute_in_wait_never_slower():
    for p, m, sched in itertools.product([1, 2, 3, 4], [1, 2, 4, 7], ["1F1B", "GPipe"]):
        if sched == "1F1B" and m < p:
            continue
        fw = [0.5 + (i * 7 % 5) * 0.3 for i in range(p)]
        bw = [2 * f + (i % 2) * 0.4 for i, f in enumerate(fw)]
        rc = [0.2 * ((i * 3) % 4) for i in range(p)]
        sd = [0.1 * (i % 3) for i in range(p)]
        args = (fw, bw, rc, sd, sched, m)
        on_demand = simulate_pipeline(*args, recompute_in_wait=False)
        in_wait = simulate_pipeline(*args, recompute_in_wait=True)
        assert in_wait <= on_demand + 1e-12
        # and neither beats the busiest stage working without a break
        assert in_wait >= m * max(f + b for f, b in zip(fw, bw)) - 1e-12


def test_bottleneck_stage_dominates():
    # one slow stage (F=2, B=4) among fast ones: step >= m * 6 and the fill/drain of the others
    step = simulate_pipeline([1, 2, 1], [2, 4, 2], [0] * 3, [0] * 3, "1F1B", 8)
    assert step >= 8 * 6 + 1 + 2  # stage 0's first forward and last backward lie outside stage 1's work


def test_schedule_order_1f1b_stage0_p4_m6():
    # warm-up min(m, p - stage) = 4 forwards, then B/F alternation, then the remaining backwards
    F, B = "F", "B"
    expect = [(F, 0), (F, 1), (F, 2), (F, 3), (B, 0), (F, 4), (B, 1), (F, 5), (B, 2), (B, 3), (B, 4), (B, 5)]
    assert schedule_order("1F1B", 4, 6, 0) == expect
    assert schedule_order("1F1B", 4, 6, 3) == [x for j in range(6) for x in ((F, j), (B, j))]
    assert schedule_order("GPipe", 2, 3, 1) == [(F, 0), (F, 1), (F, 2), (B, 0), (B, 1), (B, 2)]


def test_schedule_order_matches_torch_ir():
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    fake = types.SimpleNamespace(_num_stages=4, _n_microbatches=6)
    try:
        ir = sched.Schedule1F1B._get_pipeline_order(fake)
    except Exception as e:  # private torch API
        pytest.skip(f"torch's Schedule1F1B IR not available: {e}")
    kinds = {sched._ComputationType.FORWARD: "F", sched._ComputationType.FULL_BACKWARD: "B"}
    # the last rank is left out: torch 2.13's IR numbers its forwards F1..F6 there (its
    # `forward_mb += 1` runs before the first forward when num_forward == 0); the executed
    # _step_microbatches does F0 B0 F1 B1 ..., as test_schedule_order_1f1b_stage0_p4_m6 checks.
    for stage in range(3):
        theirs = [(kinds[a.computation_type], a.microbatch_index) for a in ir[stage]
                  if a is not None and a.computation_type in kinds]
        assert schedule_order("1F1B", 4, 6, stage) == theirs
