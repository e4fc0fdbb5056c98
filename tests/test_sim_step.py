"""simulate_iteration against closed forms, hand-drawn timelines and simulate_pipeline (times in ms)."""
import json
import random
import types

import pytest

from lynx_compile.pipelining.schedule_sim import simulate_pipeline
from lynx_compile.sim.step import (LayerSim, StageSim, StepResult, StepSim, interleaved_order, rank_orders,
                                   simulate_iteration)
from lynx_compile.sim.timeline import plot_gantt, to_chrome_trace


def stage(F, B, R=0.0, kept=0, transient=0, static=0, send=0, **layer_kw):
    lay = LayerSim(forward_s=F, backward_s=B, recompute_on_demand_s=R, kept_bytes=kept,
                   backward_transient_bytes=transient, **layer_kw)
    return StageSim(layers=(lay,), static_bytes=static, send_bytes=send)


def run(p, m, F, B, schedule="1F1B", **kw):
    layer_kw = {k: kw.pop(k) for k in list(kw) if k in ("R", "kept", "transient", "static", "send")}
    return simulate_iteration(StepSim(stages=(stage(F, B, **layer_kw),) * p, num_microbatches=m, schedule=schedule, **kw))


# ---- time: closed forms -------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("wait", [False, True])
def test_single_stage_is_m_times_f_plus_b_plus_dp(schedule, wait):
    # nothing to wait for: F, R, B back to back m times, then the DP reduction
    res = run(1, 5, 1.0, 2.0, schedule, R=0.5, dp_allreduce_s=4.0, recompute_in_wait=wait)
    assert res.iteration_s == pytest.approx(5 * 3.5 + 4.0)
    assert res.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize("p,m,F,B", [(2, 2, 1, 2), (4, 8, 1, 2), (4, 8, 2, 1), (3, 5, 1.5, 2.5), (4, 2, 1, 1)])
def test_uniform_pipeline_closed_form(p, m, F, B):
    # 1F1B: fill (p-1)F, the last stage runs m(F+B) without a break, drain (p-1)B.
    # GPipe: the last stage ends its forwards at (m+p-1)F; backwards take (m+p-1)B more.
    # Both (m+p-1)(F+B); e.g. p=4, m=8, F=1, B=2: 11 * 3 = 33.
    one_f1b, gpipe = run(p, m, F, B), run(p, m, F, B, "GPipe")
    assert one_f1b.iteration_s == pytest.approx((m + p - 1) * (F + B))
    assert gpipe.iteration_s == pytest.approx((m + p - 1) * (F + B))
    # each rank works m(F+B) of the p(m+p-1)(F+B) rank-seconds: bubble (p-1)/(m+p-1)
    assert one_f1b.busy_s == pytest.approx((m * (F + B),) * p)
    assert one_f1b.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", [2, 4])
def test_p2p_adds_two_sends_per_hop_for_one_microbatch(p):
    # m=1: F chain over p stages, p-1 sends, B chain back, p-1 sends.
    # send = latency + bytes / bandwidth = 0.25 + 500 / 2000 = 0.5
    res = run(p, 1, 1.0, 2.0, send=500, p2p_latency_s=0.25, p2p_bytes_per_s=2000.0)
    assert res.iteration_s == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.5)
    sends = [e for e in res.events if e.kind == "P2P"]
    assert len(sends) == 2 * (p - 1) and all(e.end_s - e.start_s == pytest.approx(0.5) for e in sends)


def test_tp_collectives_block_forward_and_backward():
    # one stage, two micro-batches: each F = 1 + 0.2 + 0.3, each B = 2 + 0.4 + 0.1 (no recompute)
    s = StageSim(layers=(LayerSim(forward_s=1.0, backward_s=2.0, tp_forward_comm_s=(0.2, 0.3),
                                  tp_backward_comm_s=(0.4, 0.1)),))
    res = simulate_iteration(StepSim(stages=(s,), num_microbatches=2))
    assert res.iteration_s == pytest.approx(2 * (1.5 + 2.5))
    assert sum(e.kind == "TP" for e in res.events) == 2 * 4


@pytest.mark.parametrize("r,kappa,expect_window", [
    (0.5, 1.0, 1.0),   # kappa r = 0.5 <= c = 1: hidden, the window is the collective
    (0.8, 1.25, 1.0),  # kappa r = 1.0 == c: still hidden
    (0.8, 1.5, 1.2),   # kappa r = 1.2 > c: the window grows by kappa r - c = 0.2
    (2.0, 1.0, 2.0),   # kappa r = 2 > c: exposed by 1
])
def test_window_recompute_hidden_up_to_the_collective(r, kappa, expect_window):
    s = StageSim(layers=(LayerSim(forward_s=1.0, backward_s=2.0, tp_backward_comm_s=(1.0,),
                                  recompute_in_window_s=(r,)),))
    res = simulate_iteration(StepSim(stages=(s,), num_microbatches=3, overlap_slowdown=kappa))
    assert res.iteration_s == pytest.approx(3 * (1.0 + 2.0 + expect_window))
    # the recompute bar starts with the collective on the other lane (a Gantt chart shows both)
    for rec in [e for e in res.events if e.kind == "R"]:
        tp = next(e for e in res.events if e.kind == "TP" and e.microbatch == rec.microbatch)
        assert (rec.lane, tp.lane) == ("compute", "comm")
        assert rec.start_s == tp.start_s and rec.end_s - rec.start_s == pytest.approx(kappa * r)


def test_recompute_in_wait_hand_timeline_p2_m2():
    # F=1, B=2, R=1 (on demand, one layer per stage).
    # on demand: s1 F0 [1,2] RB0 [2,5] F1 [5,6] RB1 [6,9]; s0 F0 [0,1] F1 [1,2] RB0 [5,8] RB1 [9,12] -> 12
    assert run(2, 2, 1.0, 2.0, R=1.0).iteration_s == pytest.approx(12.0)
    # in the wait: s1 never waits (its loss is local) -> same times. s0 is free at 2 and waits for
    # the gradient of mb 0 until 5: R0 [2,3], B0 [5,7]; R1 [7,8], gradient at 9, B1 [9,11] -> 11
    res = run(2, 2, 1.0, 2.0, R=1.0, recompute_in_wait=True)
    assert res.iteration_s == pytest.approx(11.0)
    early = sorted((e.start_s, e.end_s) for e in res.events if e.rank == 0 and e.kind == "R")
    assert early == [pytest.approx((2.0, 3.0)), pytest.approx((7.0, 8.0))]
    assert res.busy_s[0] == pytest.approx(2 * (1 + 1 + 2))  # the wait is not busy time


# ---- time: agreement with simulate_pipeline -----------------------------------------------

def test_agrees_with_simulate_pipeline_on_random_cases():
    rng = random.Random(0)
    for _ in range(40):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        schedule, wait = rng.choice(["1F1B", "GPipe"]), rng.random() < 0.5
        F = [rng.uniform(0.1, 2) for _ in range(p)]
        B = [rng.uniform(0.1, 4) for _ in range(p)]
        R = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(p)]
        nbytes = [rng.randint(0, 1000) for _ in range(p)]
        lat, bw = rng.uniform(0, 0.3), 4000.0
        stages = tuple(stage(F[i], B[i], R=R[i], send=nbytes[i]) for i in range(p))
        ours = simulate_iteration(StepSim(stages=stages, num_microbatches=m, schedule=schedule, p2p_latency_s=lat,
                                     p2p_bytes_per_s=bw, recompute_in_wait=wait)).iteration_s
        sends = [lat + n / bw for n in nbytes]
        theirs = simulate_pipeline(F, B, R, sends, schedule, m, recompute_in_wait=wait)
        assert ours == pytest.approx(theirs, rel=1e-12)


# ---- memory -------------------------------------------------------------------------------

def two_layer_stage(static):
    # kept 3 + 5 = 8 per micro-batch; transients 7 and 2 never overlap (one layer's backward at a time)
    return StageSim(layers=(LayerSim(forward_s=1.0, backward_s=2.0, kept_bytes=3, backward_transient_bytes=7),
                            LayerSim(forward_s=0.5, backward_s=1.0, kept_bytes=5, backward_transient_bytes=2)),
                    static_bytes=static)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (3, 3), (1, 4)])
def test_peak_memory_closed_forms(p, m):
    stages = tuple(two_layer_stage(static=100 * (i + 1)) for i in range(p))
    one_f1b = simulate_iteration(StepSim(stages=stages, num_microbatches=m))
    gpipe = simulate_iteration(StepSim(stages=stages, num_microbatches=m, schedule="GPipe"))
    for i in range(p):
        # 1F1B stage i holds its min(p-i, m) warm-up micro-batches during its first backward
        assert one_f1b.peak_bytes[i] == 100 * (i + 1) + min(p - i, m) * 8 + 7
        assert gpipe.peak_bytes[i] == 100 * (i + 1) + m * 8 + 7


def test_recompute_in_wait_holds_transients_from_the_early_recompute():
    # every stage runs its whole recompute as one R before the backward, so both layers' recomputed
    # tensors (transients 7 + 2) are live together: stage 0 during R0 holds mb 0 and 1 (kept 8 each),
    # the last stage holds one micro-batch.
    layers = tuple(LayerSim(forward_s=0.5, backward_s=1.0, recompute_on_demand_s=0.5, kept_bytes=4,
                            backward_transient_bytes=t) for t in (7, 2))
    stages = (StageSim(layers=layers),) * 2
    on_demand = simulate_iteration(StepSim(stages=stages, num_microbatches=2))
    in_wait = simulate_iteration(StepSim(stages=stages, num_microbatches=2, recompute_in_wait=True))
    assert on_demand.peak_bytes == (2 * 8 + 7, 8 + 7)
    assert in_wait.peak_bytes == (2 * 8 + 7 + 2, 8 + 7 + 2)


def test_oom_names_the_ranks_over_capacity():
    stages = tuple(two_layer_stage(static=0) for _ in range(4))
    peaks = (4 * 8 + 7, 3 * 8 + 7, 2 * 8 + 7, 8 + 7)  # 39, 31, 23, 15
    res = simulate_iteration(StepSim(stages=stages, num_microbatches=8, device_memory_bytes=30))
    assert res.peak_bytes == peaks and res.oom == (0, 1) and not res.fits
    assert simulate_iteration(StepSim(stages=stages, num_microbatches=8, device_memory_bytes=39)).fits  # peak == cap


# ---- interleaved 1F1B ---------------------------------------------------------------------

def test_interleaved_hand_timeline_2_ranks_2_chunks():
    # F=1, B=2 per virtual stage, rank 0 holds stages 0, 2; rank 1 holds 1, 3. m=2.
    # orders (torch): r0 F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1;  r1 F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1
    # r0: F0.0 [0,1] F0.1 [1,2] F2.0 [2,3] F2.1 [3,4]          B2.0 [6,8]  B2.1 [9,11]  B0.0 [11,13] B0.1 [13,15]
    # r1:   F1.0 [1,2] F1.1 [2,3] F3.0 [3,4] B3.0 [4,6] F3.1 [6,7] B3.1 [7,9] B1.0 [9,11] B1.1 [11,13]
    assert interleaved_order(2, 2, 2, 1) == [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0),
                                             ("F", 3, 1), ("B", 3, 1), ("B", 1, 0), ("B", 1, 1)]
    res = run(4, 2, 1.0, 2.0, "Interleaved1F1B", num_ranks=2)
    assert res.iteration_s == pytest.approx(15.0)
    b20 = next(e for e in res.events if (e.kind, e.stage, e.microbatch) == ("B", 2, 0))
    assert (b20.rank, b20.start_s, b20.end_s) == (0, 6.0, 8.0)


@pytest.mark.parametrize("R,v,m,F,B", [(2, 2, 2, 1, 2), (2, 2, 4, 1, 2), (2, 2, 6, 2, 1), (4, 2, 8, 1, 2),
                                       (2, 3, 4, 1, 3), (4, 4, 4, 1, 1)])
def test_interleaved_closed_form(R, v, m, F, B):
    # Megatron's interleaved bubble (Narayanan et al. 2021): (R-1)(F+B) with per-chunk times, on top of
    # the m*v*(F+B) each rank works: (m v + R - 1)(F + B). R=2, v=2, m=2: 5 * 3 = 15 (hand timeline above).
    res = run(R * v, m, F, B, "Interleaved1F1B", num_ranks=R)
    assert res.iteration_s == pytest.approx((m * v + R - 1) * (F + B))
    assert res.bubble_fraction == pytest.approx((R - 1) / (m * v + R - 1))


def test_interleaved_memory_and_placement():
    # R=2, v=2, m=2: rank 0 runs all four forwards (stages 0, 2 x mb 0, 1) before its first backward;
    # rank 1 holds F1.0 F1.1 F3.0 during B3.0. static: rank 0 = s0 + s2 = 1 + 3, rank 1 = 2 + 4.
    stages = tuple(stage(1.0, 2.0, kept=10, transient=5, static=i + 1) for i in range(4))
    res = simulate_iteration(StepSim(stages=stages, num_microbatches=2, schedule="Interleaved1F1B", num_ranks=2))
    assert res.peak_bytes == (4 + 4 * 10 + 5, 6 + 3 * 10 + 5)
    assert {(e.rank, e.stage % 2) for e in res.events} == {(0, 0), (1, 1)}


def test_interleaved_on_one_rank_sends_nothing():
    # all stages on rank 0: stage-to-stage transfers stay on the device, so the latency never counts
    res = run(3, 2, 1.0, 2.0, "Interleaved1F1B", num_ranks=1, p2p_latency_s=5.0)
    assert res.iteration_s == pytest.approx(3 * 2 * 3.0)


def test_interleaved_order_matches_torch():
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {sched._ComputationType.FORWARD: "F", sched._ComputationType.FULL_BACKWARD: "B"}
    for R, v, m in [(2, 2, 2), (2, 2, 6), (4, 2, 8), (3, 3, 6), (4, 3, 4)]:
        fake = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=R, pp_group_size=R, _n_microbatches=m)
        for rank in range(R):
            try:
                ir = sched.ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, rank)
            except Exception as e:  # private torch API
                pytest.skip(f"torch's ScheduleInterleaved1F1B IR not available: {e}")
            theirs = [(kinds[a.computation_type], a.stage_index, a.microbatch_index) for a in ir if a is not None]
            assert interleaved_order(R, v, m, rank) == theirs


# ---- timeline invariants and serialization ------------------------------------------------

def rich_step(schedule="1F1B", num_ranks=None, p=4, wait=True):
    lay = LayerSim(forward_s=1.0, backward_s=2.0, tp_forward_comm_s=(0.1, 0.1), tp_backward_comm_s=(0.2, 0.3),
                   recompute_on_demand_s=0.2, recompute_in_window_s=(0.1, 0.5), kept_bytes=2**20,
                   backward_transient_bytes=2**18, name="block")
    st = StageSim(layers=(lay, lay), static_bytes=2**24, send_bytes=2**16)
    return StepSim(stages=(st,) * p, num_microbatches=4, schedule=schedule, num_ranks=num_ranks,
                   p2p_latency_s=0.05, p2p_bytes_per_s=2**20, dp_allreduce_s=1.0, overlap_slowdown=1.2,
                   recompute_in_wait=wait, device_memory_bytes=2**25)


@pytest.mark.parametrize("step", [rich_step(), rich_step("GPipe", wait=False), rich_step("Interleaved1F1B", 2)])
def test_lanes_never_overlap_and_work_is_conserved(step):
    res = simulate_iteration(step)
    for r in range(step.ranks):
        for lane in ("compute", "comm"):
            spans = sorted((e.start_s, e.end_s) for e in res.events if e.rank == r and e.lane == lane)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    per_stage = 2 * ((1.0 + 0.1 + 0.1) + (0.2 + 2.0 + max(0.2, 1.2 * 0.1) + max(0.3, 1.2 * 0.5)))  # 2 layers
    work = step.num_microbatches * len(step.stages) * per_stage + step.ranks * 1.0
    assert sum(res.busy_s) == pytest.approx(work)
    assert res.iteration_s == pytest.approx(max(e.end_s for e in res.events))


def test_serialization_round_trips_through_strict_json():
    step = rich_step()
    assert StepSim.from_dict(json.loads(json.dumps(step.to_dict(), allow_nan=False))) == step
    free_link = StepSim(stages=(stage(1.0, 2.0),), num_microbatches=1)
    assert StepSim.from_dict(json.loads(json.dumps(free_link.to_dict(), allow_nan=False))) == free_link
    res = simulate_iteration(step)
    assert StepResult.from_dict(json.loads(json.dumps(res.to_dict(), allow_nan=False))) == res


def test_chrome_trace_has_one_complete_event_per_event(tmp_path):
    res = simulate_iteration(rich_step("Interleaved1F1B", 2))
    to_chrome_trace(res, tmp_path / "trace.json")
    doc = json.loads((tmp_path / "trace.json").read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.events)
    first = res.events[0]
    assert xs[0]["pid"] == first.rank and xs[0]["ts"] == pytest.approx(first.start_s * 1e6)
    assert xs[0]["dur"] == pytest.approx((first.end_s - first.start_s) * 1e6)


def test_plot_gantt_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot_gantt(simulate_iteration(rich_step()), tmp_path / "gantt.png", title="rich step")
    data = (tmp_path / "gantt.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


# ---- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("make,match", [
    (lambda: StepSim(stages=(stage(1, 1),), num_microbatches=0), "at least 1 micro-batch"),
    (lambda: LayerSim(forward_s=1, backward_s=1, tp_backward_comm_s=(1, 1), recompute_in_window_s=(1,)),
     "one recompute time per backward collective"),
    (lambda: StepSim(stages=(stage(1, 1),), num_microbatches=1, overlap_slowdown=0.5), "kappa >= 1"),
    (lambda: LayerSim(forward_s=-1, backward_s=1), "forward_s"),
    (lambda: LayerSim(forward_s=1, backward_s=1, tp_forward_comm_s=(-0.1,)), r"tp_forward_comm_s\[0\]"),
    (lambda: StepSim(stages=(stage(1, 1),), num_microbatches=1, p2p_latency_s=-1), "p2p_latency_s"),
    (lambda: StepSim(stages=(stage(1, 1),) * 3, num_microbatches=2, schedule="Interleaved1F1B", num_ranks=2),
     "multiple of num_ranks"),
    (lambda: StepSim(stages=(stage(1, 1),) * 4, num_microbatches=3, schedule="Interleaved1F1B", num_ranks=2),
     "use 4 micro-batches"),
    (lambda: StepSim(stages=(stage(1, 1),) * 4, num_microbatches=2, num_ranks=2), "one stage per rank"),
    (lambda: StepSim(stages=(stage(1, 1),), num_microbatches=2, schedule="ZB"), "unknown"),
    (lambda: StepSim(stages=(), num_microbatches=2), "at least one StageSim"),
])
def test_bad_inputs_raise_with_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_rank_orders_cover_every_action_once():
    for step in (rich_step(), rich_step("GPipe"), rich_step("Interleaved1F1B", 2)):
        actions = sorted(a for order in rank_orders(step) for a in order)
        expect = sorted((k, s, j) for k in "FB" for s in range(len(step.stages)) for j in range(4))
        assert actions == expect


def test_fsdp_communication_hides_recompute_up_to_its_length():
    """One stage, one layer, one micro-batch (ms): F = 1 beside a 1.5 all-gather ends at 1.5;
    B = 2 with R = 0.5 on demand beside 3 of all-gather + reduce-scatter ends 3 later: the
    recompute is hidden. With R = 1.5 the compute (3.5) outlasts the communication."""
    for r, end in ((0.5, 1.5 + 3.0), (1.5, 1.5 + 3.5)):
        res = simulate_iteration(StepSim(stages=(stage(1.0, 2.0, R=r, fsdp_forward_comm_s=1.5, fsdp_backward_comm_s=3.0),),
                                    num_microbatches=1))
        assert res.iteration_s == pytest.approx(end)
        fsdp = [e for e in res.events if e.kind == "FSDP"]
        assert [(e.lane, e.start_s, e.end_s) for e in fsdp] == [("fsdp", 0.0, 1.5), ("fsdp", 1.5, 4.5)]
