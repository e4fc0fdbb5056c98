"""The compiled pieces of one step planned together (issue M item 3: ``lynx_compile.step.model``,
``lynx_compile.step.recorder``).

Oracles: hand-computed step peaks and choices for the arithmetic; for the runtime, eager
PyTorch's gradients and the measured peak of torch.compile's own per-block step (no lynx).
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from lynx_compile.compiler.dynamo_backend import LynxBackend
from lynx_compile.config import make_config
from lynx_compile.decisions import BudgetError, CandidateKey
from lynx_compile.memory.measure import cpu_peak_bytes, measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.step.model import Candidate, GraphChoices, Segment, StepModel, choose

from _steps import per_block, step_peaks


def _c(name, exposed, saved, fw=None, bw=None):
    """A candidate named by its key's text (``half``: torch's min-cut at 0.5, ``late`` at 0.2)."""
    name = {"half": "torch@0.5", "late": "torch@0.2"}.get(name, name)
    return Candidate(name=CandidateKey.parse(name), exposed_s=exposed, saved_bytes=saved,
                     forward_peak_bytes=saved if fw is None else fw, backward_peak_bytes=saved if bw is None else bw)


NONE, HALF, FULL = _c("none", 0.0, 100), _c("half", 1.0, 50), _c("full", 3.0, 10)


def _two_calls(current="none", outside=(0, 0, 0, 0, 0, 0)):
    """One graph called twice: fw0, fw1, then bw1, bw0. Measured peaks are the model's with
    ``current`` plus ``outside`` per segment."""
    c = {"none": NONE, "half": HALF, "full": FULL}[current]
    graphs = {0: GraphChoices(reference=NONE, choices=(NONE, HALF, FULL), current=c.name)}
    shape = [((), None), ((), (0, "fw")), ((0,), None), ((0,), (1, "fw")), ((0, 1), None), ((0,), (1, "bw")),
             ((0,), None), ((), (0, "bw")), ((), None)]
    segs = []
    for i, (alive, running) in enumerate(shape):
        extra = outside[i] if i < len(outside) else 0
        pieces = len(alive) * c.saved_bytes + (c.saved_bytes if running else 0)
        segs.append(Segment(peak=pieces + extra, alive=alive, running=running))
    return StepModel(graphs=graphs, calls=(0, 0), segments=tuple(segs))


def test_predicted_peak_is_measured_outside_plus_the_pieces():
    model = _two_calls("half", outside=(5, 5, 5, 5, 40, 5))
    assert model.outside()[:6] == [5, 5, 5, 5, 40, 5]
    assert model.predicted(model.uniform({0: HALF})) == 40 + 2 * 50  # the recorded step itself
    assert model.predicted(model.uniform({0: FULL})) == 40 + 2 * 10
    assert model.predicted({0: (FULL, HALF)}) == 40 + 10 + 50  # the calls compiled differently
    assert model.reference() == 40 + 2 * 100  # every piece at no recompute


def test_choose_takes_the_least_recompute_that_fits_and_reports_when_nothing_does():
    model = _two_calls("none", outside=(0, 0, 0, 0, 30, 0))  # reference 230
    assert choose(model, 230).pick[0] == (NONE, NONE)
    assert choose(model, 229).pick[0] == (HALF, NONE)  # 180: one call recomputes half
    assert choose(model, 130).pick[0] == (HALF, HALF)  # 130, 2 s (full + none: 140)
    assert choose(model, 130).exposed_s == pytest.approx(2.0)
    got = choose(model, 129)  # the first call, alive longest, takes the smaller candidate
    assert got.pick[0] == (FULL, HALF) and got.predicted == 90 and got.exposed_s == pytest.approx(4.0)
    assert choose(model, 50).pick[0] == (FULL, FULL)
    low = choose(model, 49)
    assert not low.fits and low.pick[0] == (FULL, FULL) and low.predicted == 50


def test_a_fixed_graph_keeps_its_plan_and_the_piece_takes_the_rest():
    """A graph planned on its own peak (one choice) beside a piece: only the piece moves."""
    big = GraphChoices(reference=_c("none", 0, 300), choices=(_c("plan", 0, 120),), current=CandidateKey("plan"))
    piece = GraphChoices(reference=NONE, choices=(NONE, HALF, FULL), current=NONE.name)
    segs = (Segment(peak=120, alive=(), running=(0, "fw")), Segment(peak=120 + 100, alive=(0,), running=(1, "fw")),
            Segment(peak=120 + 100, alive=(0, 1), running=None))
    model = StepModel(graphs={0: big, 1: piece}, calls=(0, 1), segments=segs)
    assert model.reference() == 400
    got = choose(model, 180)
    assert got.pick[0][0].name == CandidateKey("plan") and got.pick[1] == (HALF,) and got.predicted == 170


def test_the_transients_that_ran_are_taken_as_measured():
    """The model says the candidate that ran (``half``) peaks 30 B above what it does in its
    backward and 5 B in its forward. Taken as modelled, ``outside`` would come out low by as much
    and every other candidate be predicted low by it; taken as measured (the peak above the
    segment's start, plus what of the call is alive there: what it saved, the 7 B gradient it
    receives), another candidate's prediction is its model on the true outside. Hand-computed."""
    half = _c("half", 1.0, 50, fw=60, bw=90)  # truly: forward 55, backward 60
    graphs = {0: GraphChoices(reference=NONE, choices=(NONE, half, FULL), current=half.name, incoming_bytes=7)}
    outside = 20
    # one call: forward, alive, backward (its saved 50 + incoming 7 at the start, 60 at its peak)
    segs = (Segment(peak=outside + 55, alive=(), running=(0, "fw"), start=outside),
            Segment(peak=outside + 50, alive=(0,), running=None, start=outside + 50),
            Segment(peak=outside + 60, alive=(), running=(0, "bw"), start=outside + 57))
    model = StepModel(graphs=graphs, calls=(0,), segments=segs)
    assert model.outside() == [15, 20, -10]  # the modelled transients: low by 5 and by 30
    measured, changes = model.measured()
    assert changes == [(0, "backward", 90, 60), (0, "forward", 60, 55)]
    assert measured.outside() == [20, 20, 20]
    assert measured.graphs[0].named(half.name).backward_peak_bytes == 60
    late = _c("late", 2.0, 10, fw=20, bw=100)  # another candidate, peaking in its backward
    assert measured.predicted(measured.uniform({0: late})) == outside + 100
    assert model.predicted(model.uniform({0: late})) == outside + 100 - 30  # what it was
    # without the incoming bytes a backward's transient is left as modelled
    unknown = StepModel(graphs={0: GraphChoices(reference=NONE, choices=(NONE, half, FULL), current=half.name)},
                        calls=(0,), segments=segs)
    assert unknown.measured()[1] == [(0, "forward", 60, 55)]


def test_a_recording_gives_each_marks_peak_and_level():
    """Allocator events (time, address, bytes) cut at marks: per mark the highest live bytes since
    the previous mark and the live bytes at it. Hand-computed."""
    from lynx_compile.step.memory_marks import segment_memory

    events = [(1, 1000, 100), (2, 2000, 50), (3, 1000, -100), (5, 3000, 30), (6, 2000, -50), (8, 4000, 10)]
    peaks, levels = segment_memory(events, [4, None, 7, 9])
    assert peaks == [150, None, 80, 40]
    assert levels == [50, None, 30, 40]


# A step where a buffer (address 1000, 100 B) is freed by a thread the profiler does not follow
# (under gloo: the worker dropping a collective's buffer after the step's own thread did): the
# profiler records no free (SEEN has it at t=30), and its memory is allocated again at t=50 (at
# 1040: the alignment moved the block's start). The allocator's running total (the events' fourth
# field, counted on every thread while lynx records) saw the free by the next event, t=35. Marks
# at 40, 70, 90.
SEEN = [(10, 1000, 100, 100), (20, 2000, 50, 150), (30, 1000, -100, 50), (35, 3000, 20, 70), (36, 3000, -20, 50),
        (50, 1040, 30, 80), (60, 2000, -50, 30), (80, 1040, -30, 0)]
UNSEEN = [e for e in SEEN if e[0] != 30]


def test_a_free_on_a_thread_the_profiler_does_not_follow_is_counted():
    """Read from the allocator's total, the step reads as if the free had been recorded; without
    it (left in, the buffer read as live to the end: levels [150, 130, 100]) the reused memory
    shows the free was missed, and the buffer counts only as it is made. Hand-computed."""
    from lynx_compile.memory.measure import freed_unseen
    from lynx_compile.step.memory_marks import segment_memory

    marks = [40, 70, 90]
    assert segment_memory(SEEN, marks, every_thread=True) == segment_memory(SEEN, marks) == \
        ([150, 80, 30], [50, 30, 0])
    assert segment_memory(UNSEEN, marks, every_thread=True) == ([150, 80, 30], [50, 30, 0])
    assert freed_unseen(UNSEEN) == {0} and freed_unseen(SEEN) == set()
    assert segment_memory(UNSEEN, marks) == ([100, 80, 30], [50, 30, 0])  # before t=20 only


# A collective's own copy of its input (address 1000, 100 B: gloo's reduce-scatter clones it),
# held by the work until whichever thread drops the work last frees it. EARLY: the step's thread,
# after its wait, at t=25 (recorded). LATE: gloo's worker, between t=30 and t=35 (not recorded;
# the allocator's total shows it), after the next block's all-gather (address 3000, 60 B) has
# started. Marks at 40, 70, 90; the address is allocated again at t=45 (30 B).
HELD = {(10, 1000)}
EARLY = [(10, 1000, 100, 100), (20, 2000, 50, 150), (25, 1000, -100, 50), (30, 3000, 60, 110),
         (35, 3000, -60, 50), (45, 1000, 30, 80), (50, 2000, -50, 30), (55, 1000, -30, 0)]
LATE = [(10, 1000, 100, 100), (20, 2000, 50, 150), (30, 3000, 60, 210), (35, 3000, -60, 50),
        (45, 1000, 30, 80), (50, 2000, -50, 30), (55, 1000, -30, 0)]
# LATER: the worker got to it only after the mark at 40 (between t=45 and t=50, a block of 30 B
# at 4000 allocated meanwhile); NEVER: not within the window at all.
LATER = [(10, 1000, 100, 100), (20, 2000, 50, 150), (30, 3000, 60, 210), (35, 3000, -60, 150),
         (45, 4000, 30, 180), (50, 2000, -50, 30), (55, 4000, -30, 0)]
NEVER = [*LATER[:5], (50, 2000, -50, 130), (55, 4000, -30, 100)]


def test_a_collectives_held_buffer_reads_alike_whichever_thread_frees_it():
    """Issue S items 1 and 4: held to the next mark, the copy reads live through the all-gather
    in every run (the later free's step: 210 B), and gone at the mark (level 50), however late
    gloo's worker frees it. Read as freed, the early run's first segment peaks at 150, the late
    one's at 210, and the later ones carry it into the next segment: other plans for one
    command. Hand-computed."""
    from lynx_compile.step.memory_marks import segment_memory

    marks = [40, 70, 90]
    assert segment_memory(EARLY, marks, every_thread=True) == ([150, 80, 0], [50, 0, 0])
    assert segment_memory(LATE, marks, every_thread=True) == ([210, 80, 0], [50, 0, 0])
    assert segment_memory(LATER, marks, every_thread=True) == ([210, 180, 0], [150, 0, 0])
    assert segment_memory(NEVER, marks, every_thread=True) == ([210, 180, 100], [150, 100, 100])
    # a free the worker made (LATE, LATER, NEVER) is read as the step's thread made it, in the
    # segment it allocated the buffer in (session 42: 1 run in 24 planned otherwise, FSDP2)
    for events in (EARLY, LATE, LATER, NEVER):
        assert segment_memory(events, marks, every_thread=True, held=HELD) == ([210, 80, 0], [50, 0, 0])
    # freed after a mark: held to the next one (live through the all-gather, gone at 70)
    assert segment_memory(EARLY, [22, 70, 90], every_thread=True, held=HELD) == ([150, 210, 0], [150, 0, 0])
    # not held, or freed after the last mark: as read
    assert segment_memory(EARLY, marks, every_thread=True, held={(20, 2000)}) == ([150, 80, 0], [50, 0, 0])
    assert segment_memory(EARLY, [5, 8, 22], every_thread=True, held=HELD) == ([0, 0, 150], [0, 0, 150])


# A tensor the step made and handed to a collective (address 1, 100 B, taken by the collective
# from t=15 to 20), then a 200 B buffer (t=30). The step's thread frees the first after its use
# (t=25), or gloo's worker does as the work finishes (t=35, unrecorded: the total shows it at
# t=40). A 300 B gradient handed to an all-reduce (t=50-55) stays live past the window.
HANDED = [(15, 20, 1, True), (50, 55, 3, True)]
BY_STEP = [(10, 1, 100, 100), (25, 1, -100, 0), (30, 2, 200, 200), (40, 2, -200, 0), (45, 3, 300, 300)]
BY_WORKER = [(10, 1, 100, 100), (30, 2, 200, 300), (40, 2, -200, 0), (45, 3, 300, 300)]


def test_a_tensor_handed_to_a_collective_reads_alike_whichever_thread_frees_it():
    """Issue S item 1 (llama3 TP, the eager compiler's refusal: 0.859 in 1 of 16 runs, 0.857 in
    the others): freed by the worker, the handed tensor read live through the 200 B buffer's
    allocation (300 B); read as freed where the collective that took it last ended, the segment
    peaks at 200 B as when the step's thread frees it. The gradient, live at the end, is left.
    Hand-computed."""
    from lynx_compile.step.memory_marks import segment_memory

    marks = [42, 60]
    assert segment_memory(BY_STEP, marks, every_thread=True) == ([200, 300], [0, 300])
    assert segment_memory(BY_WORKER, marks, every_thread=True) == ([300, 300], [0, 300])
    for events in (BY_STEP, BY_WORKER):
        assert segment_memory(events, marks, every_thread=True, inputs=HANDED) == ([200, 300], [0, 300])
    # taken by an op that is not a collective: as read (no work held it)
    assert segment_memory(BY_WORKER, marks, every_thread=True, inputs=[(15, 20, 1, False)]) == ([300, 300], [0, 300])
    # its last use after the worker's free cannot be its free: as read
    assert segment_memory(BY_WORKER, marks, every_thread=True, inputs=[(15, 41, 1, True)]) == ([300, 300], [0, 300])
    # a collective's own held buffer is read by held_to_next_mark's rule, not this one
    assert segment_memory(BY_WORKER, marks, every_thread=True, inputs=HANDED, held={(10, 1)}) == ([300, 300], [0, 300])
    # a gradient handed to an all-reduce (300 B, live on) does not take another buffer's free
    # (400 B, by the worker: the total drops 400 B before t=30): only a drop of its own size is
    other = [(10, 3, 300, 300), (20, 2, 400, 700), (30, 4, 50, 350)]
    assert segment_memory(other, marks, every_thread=True, inputs=[(12, 14, 3, True)]) == \
        segment_memory(other, marks, every_thread=True) == ([700, 350], [350, 350])


def _held_in_one_gloo_process(tmp_path, work) -> tuple[list, set, dict, list]:
    """``work()`` run in a one-rank gloo process group under a memory profile, lynx's counting of
    every thread on (as the step record runs it): the allocator events, the buffers
    ``_compat.collective_held_allocations`` finds, the size of each allocation by (time,
    address), and the ops' tensor inputs (``_compat.tensor_inputs``)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from lynx_compile import _compat

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        with _compat.cpu_allocator_counts_every_thread():
            prof.start()
            work()
            prof.stop()
    finally:
        dist.destroy_process_group()
    events = _compat.cpu_allocation_events(prof, totals=True)
    sizes = {(t, ptr): size for t, ptr, size, _ in events if size > 0}
    return events, _compat.collective_held_allocations(prof), sizes, _compat.tensor_inputs(prof)


def test_gloos_reduce_scatter_copy_is_the_buffer_its_work_holds(tmp_path):
    """One gloo process: ``reduce_scatter_tensor`` clones its input inside ``c10d::_reduce_scatter_base_``
    and the work holds the clone past the call (found); ``all_gather_into_tensor`` frees its
    temporary before returning, and the caller's tensors are allocated outside (not found)."""
    import torch.distributed as dist

    gathered, mine, scattered = torch.empty(256, 64), torch.randn(256, 64), torch.empty(256, 64)

    def work():
        grads = torch.randn(256, 64)
        dist.reduce_scatter_tensor(scattered, grads, async_op=True).wait()
        del grads
        dist.all_gather_into_tensor(gathered, mine, async_op=True).wait()

    events, held, sizes, _ = _held_in_one_gloo_process(tmp_path, work)
    assert len(held) == 1 and [sizes[k] for k in held] == [256 * 64 * 4], (held, events)
    grads_made = min(t for t, _, size, _ in events if size > 0)
    assert min(held)[0] > grads_made  # the clone, not the caller's tensor


def test_a_functional_collectives_output_is_a_buffer_its_work_holds(tmp_path):
    """One gloo process: a functional all-gather (what a compiled TP block calls) allocates its
    output inside ``_c10d_functional::all_gather_into_tensor`` and returns it while the work
    holds it too (found: which thread frees it last moved a TP step's backward segment by that
    buffer, 256 KiB, between identical runs); the input, made outside, is not."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    mine = torch.randn(128, 64)
    total = []

    def work():
        gathered = funcol.wait_tensor(funcol.all_gather_tensor(mine, 0, dist.group.WORLD))
        total.append(float(gathered.sum()))

    events, held, sizes, inputs = _held_in_one_gloo_process(tmp_path, work)
    assert total == [float(mine.sum())]
    assert [sizes[k] for k in held] == [128 * 64 * 4], (held, events)
    assert all(ptr != mine.data_ptr() for _, ptr in held)
    # the input is one the collective was handed (``_compat.tensor_inputs``): a tensor the caller
    # made, freed by whichever thread drops it last (handed_gone_at_last_use); so is the output,
    # to ``wait_tensor``
    handed = {ptr for _, _, ptr, collective in inputs if collective}
    assert handed == {mine.data_ptr()} | {ptr for _, ptr in held}, handed


def test_the_recorded_steps_peak_is_read_as_every_other_step_is_measured(tmp_path):
    """One gloo process, a step whose reduce-scatter clones a 64 KiB input (the work holds the
    clone), then two 64 KiB tensors live at once. The recording's plan reading holds the clone to
    the next mark (3 x 64 KiB in the segment); its ``peak_bytes`` reads the events as
    ``memory.measure.cpu_peak_bytes`` measures a step (the clone freed where the allocator freed
    it): 2 x 64 KiB, hand-computed, and what ``cpu_peak_bytes`` measures of the same work. A tool
    measuring every step reads the recorded one this way (``StepRecorder.recorded_peak_bytes``)."""
    import time

    import torch.distributed as dist

    from lynx_compile.memory.measure import cpu_peak_bytes
    from lynx_compile.step.memory_marks import ProfilerRecording

    K = 256 * 64 * 4
    scattered = torch.empty(256, 64)

    def work():
        grads = torch.randn(256, 64)
        handle = dist.reduce_scatter_tensor(scattered, grads, async_op=True)
        handle.wait()
        del handle, grads
        time.sleep(0.05)  # the worker has dropped the work: the clone is freed
        x, y = torch.randn(256, 64), torch.randn(256, 64)
        return x, y

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        recording = ProfilerRecording()
        assert recording.start()
        kept = work()
        recording.mark(0)
        del kept
        peaks, _ = recording.finish(1)
        measured = cpu_peak_bytes(work)
    finally:
        dist.destroy_process_group()
    assert peaks == [3 * K]  # the plan's reading: the clone held to the mark
    assert recording.peak_bytes == measured == 2 * K


def test_the_allocator_counts_a_free_on_another_thread_while_lynx_records():
    """torch's own CPU allocator: a tensor made while profiling and freed on a thread the profiler
    does not follow. The profiler records no free; with lynx's counting on, the next event's total
    has it (``_compat.cpu_allocator_counts_every_thread``), and the flag is restored after."""
    import threading

    from torch.profiler import ProfilerActivity, profile

    from lynx_compile import _compat

    def run(count: bool) -> list:
        held = []
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _compat.cpu_allocator_counts_every_thread() if count else contextlib.nullcontext(False) as on:
            assert on is count
            prof.start()
            held.append(torch.empty(5000, dtype=torch.uint8))
            worker = threading.Thread(target=held.clear)
            worker.start()
            worker.join()
            after = torch.empty(300, dtype=torch.uint8)
            prof.stop()
        del after
        return [e for e in _compat.cpu_allocation_events(prof, totals=True)]

    counted, missed, again = run(True), run(False), run(False)
    assert [size for _, _, size, _ in counted] == [5000, 300]  # no free recorded either way
    assert counted[-1][3] - counted[0][3] == 300 - 5000  # the total saw it
    assert missed[-1][3] - missed[0][3] == 300  # it did not
    assert again[-1][3] - again[0][3] == 300  # off again after the block


def _step_from_none(model, x) -> None:
    """One training step's forward and backward from ``.grad`` None (``zero_grad()``'s default)."""
    for p in model.parameters():
        p.grad = None
    model(x).loss.backward()


def _inductor_per_block(model):
    for block in model.blocks:
        block.compile(backend="inductor", fullgraph=True)


def test_per_block_budget_holds_on_the_measured_whole_step(monkeypatch):
    """gpt-tiny compiled block by block at memory_budget=0.5: after two steps lynx plans the
    blocks together and the measured step (embedding, LM head, loss and the parameter
    gradients included) is within half of torch.compile's own per-block step; gradients are
    eager's all along. Each compile again for the step's plan is wrapped in a progress line
    naming the candidate chosen."""
    from lynx_compile.compiler import dynamo_backend, progress

    said = []

    class Recorded(progress.Progress):
        def __init__(self, what, **kw):
            said.append(what)
            super().__init__(what, **kw)

    monkeypatch.setattr(dynamo_backend, "Progress", Recorded)
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = per_block(model, {"policy": "lynx", "memory_budget": 0.5}, fullgraph=True)
    _inductor_per_block(plain)
    for step in range(3):  # step 2 is recorded, step 3 runs the pieces planned together
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
        loss = model(x).loss
        loss.backward()
        want = ref(x).loss
        want.backward()
        assert torch.allclose(loss, want, rtol=1e-5, atol=1e-6), step
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), (step, name)
    plan = backend.records[0].plan
    assert plan.budget_scope == "step" and plan.step_peak_bytes <= plan.budget_bytes
    assert plan.budget_bytes == int(0.5 * plan.step_reference_bytes)
    assert any("planned together" in n for n in plan.notes)
    recorder = backend.step_recorder
    assert recorder.state == "done" and len(recorder.model.calls) == 4  # four blocks, one graph
    again = [w for w in said if "compiling again" in w]
    chosen = {str(r.step_choice) for r in backend.records if r.step_choice is not None}
    assert [w for w in said if "tracing, planning and compiling" in w] and chosen, said  # first compile; a choice
    assert {w.split("chose ('")[1].rstrip("')") for w in again} == chosen, (again, chosen)
    # measured as the steps above ran and lynx recorded them: .grad None as each step starts (a
    # step that starts with .grad allocated is another regime, planned for only where it is the
    # one recorded: step.recorder's _choose; measured so, this plan's 'torch@0.3' / 'torch@0.4'
    # mix peaked at 1,405,192 B against 1,303,304 with .grad None, as predicted, on a machine
    # whose calibrated profile chose it)
    lynx = measure_step(lambda: _step_from_none(model, x), repeats=1, warmup=1)
    none = measure_step(lambda: _step_from_none(plain, x), repeats=1, warmup=1)
    assert lynx.peak_bytes <= 0.5 * 1.02 * none.peak_bytes, (lynx.peak_bytes, none.peak_bytes)
    assert lynx.peak_bytes <= plan.step_peak_bytes * 1.01, (lynx.peak_bytes, plan.step_peak_bytes)
    # lynx's model of torch.compile's per-block step is the measured one (2,634,504 B against
    # 2,633,992 B in session 35): the recording starts at the model's call (and ``ref``, an eager
    # model run between lynx's steps, is not recorded)
    assert abs(plan.step_reference_bytes - none.peak_bytes) <= 0.01 * none.peak_bytes
    # gradient accumulation after the step's plan (two backwards into kept .grad): the graph is
    # compiled again with its gradients added into .grad, each call keeping the candidate the
    # step's plan gave it (a call whose compile the plan kept was planned afresh before: its
    # step_choice is None), gradients still eager's, and the step from None is still the one
    # planned (1,405,704 B against 1,303,304 before the fix, on a machine that kept a call)
    piece = recorder.pieces[0]
    in_use = [r.step_choice or r.step.current for r in piece._call_records]
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
    for _ in range(2):
        model(x).loss.backward()
        ref(x).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), ("accumulated", name)
    assert [r.step_choice for r in piece._call_records] == in_use
    assert all(r.grads_in_graph.applies for r in piece._call_records)
    accumulating = measure_step(lambda: _step_from_none(model, x), repeats=1, warmup=1)
    assert accumulating.peak_bytes <= plan.step_peak_bytes * 1.01, (accumulating.peak_bytes, plan.step_peak_bytes)


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


class _EagerStem(torch.nn.Module):
    """Eager work before the compiled pieces that holds memory past the first of them: ``stem``'s
    output, saved by the GELU after it for the backward (512 KiB), and a buffer a forward
    pre-hook allocates and a hook on the step's loss drops at the end of the backward (as FSDP2
    all-gathers the root's parameters for the step: 256 KiB). Neither is the first piece's
    input."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(64, 256)
        self.blocks = torch.nn.ModuleList(_Block(256) for _ in range(2))
        self.held = None
        self.register_forward_pre_hook(lambda module, args: setattr(module, "held", torch.ones(256, 256)))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.stem(x))
        for block in self.blocks:
            h = block(h)
        loss = (h * self.held[0]).pow(2).mean()
        loss.register_hook(lambda g: setattr(self, "held", None))
        return loss


def test_the_step_is_recorded_from_its_first_module_call():
    """What eager code allocates before the first piece call and holds past it (a saved
    activation of the stem, a buffer allocated by a pre-hook) is the step's: lynx records the
    step from the call of its outermost module, so its step with no recompute is torch.compile's own
    per-block step as measured, and at budget 1.0 the measured step is within the budget.
    Recorded from the first piece call (before session 35), the step missed those 768 KiB of
    its 6.25 MiB, and a step at 1.0 measured 1.14x its budget."""
    torch.manual_seed(0)
    model, x = _EagerStem(), torch.randn(512, 64)
    plain = copy.deepcopy(model)
    for block in plain.blocks:
        block.compile(backend="inductor")
    backend = per_block(model, {"policy": "lynx", "memory_budget": 1.0})

    def step(m):
        return lambda: m(x).backward()

    peaks = {}
    for name, m in (("lynx", model), ("inductor", plain)):
        peaks[name] = list(step_peaks(step(m), list(m.parameters()), 4, grads="none", unmeasured=(1, 2)))[2:]
    plan = backend.records[0].plan
    assert plan.budget_scope == "step" and backend.step_recorder.state == "done"
    assert max(peaks["lynx"]) <= plan.budget_bytes * 1.001, (peaks, plan.budget_bytes)
    assert abs(plan.step_reference_bytes - max(peaks["inductor"])) <= 0.01 * max(peaks["inductor"]), \
        (plan.step_reference_bytes, peaks)


def test_the_step_module_hooks_leave_other_models_alone():
    """After step 1 lynx waits for step 2 with hooks on the model step 1 ran (its outermost
    module call), no other: another model run between the steps records nothing and leaves no
    profiler running; an evaluation under ``no_grad`` keeps the hooks; step 2's first piece call
    removes them, and the step is planned from its recording."""
    from lynx_compile import _compat

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    x = example_batch(model, 2)
    backend = per_block(model, {"policy": "lynx", "memory_budget": 0.8})
    recorder = backend.step_recorder
    model(x).loss.backward()  # step 1
    assert recorder._root() is model and len(model._forward_pre_hooks) == 1
    other = torch.nn.Linear(8, 8)
    other(torch.randn(2, 8)).sum().backward()
    assert not other._forward_pre_hooks and not _compat.profiler_running() and recorder.state == "warming"
    with torch.no_grad():
        model(x)
    assert len(model._forward_pre_hooks) == 1 and recorder.state == "warming"
    model(x).loss.backward()  # step 2, recorded from the model's call
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert recorder.state == "recorded" and not _compat.profiler_running()
    model(x).loss.backward()  # step 3, planned
    assert recorder.state == "done" and backend.records[0].plan.budget_scope == "step"


def test_a_step_recorded_with_grad_allocated_is_planned_for_grad_none_too():
    """Gradient accumulation (or ``zero_grad(set_to_none=False)``): step 2, the recorded one,
    starts with ``.grad`` allocated, so its parameter gradients are added into ``.grad`` and
    freed; a step starting with ``.grad`` None (``zero_grad()``'s default, the first
    micro-batch) keeps them. lynx plans for both (``memory.param_grads``): the step measured
    from ``.grad`` None stays within the budget of torch.compile's own per-block step. (Planned
    for the recorded regime alone, this case measured 0.540 of it at 0.5.)"""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    plain = copy.deepcopy(model)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = per_block(model, {"policy": "lynx", "memory_budget": 0.5}, fullgraph=True)
    _inductor_per_block(plain)
    for m in (model, plain):
        for _ in range(3):  # .grad never set to None: allocated from step 2 on
            m(x).loss.backward()
    plan = backend.records[0].plan
    assert plan.budget_scope == "step"
    assert any("of .grad were allocated as step 2 started" in n for n in plan.notes)

    def from_grad_none(m):
        for p in m.parameters():
            p.grad = None
        return cpu_peak_bytes(lambda: m(x).loss.backward())

    lynx, none = from_grad_none(model), from_grad_none(plain)
    assert lynx <= 0.5 * 1.02 * none, (lynx, none)
    kept = cpu_peak_bytes(lambda: model(x).loss.backward())  # the regime recorded: lower still
    assert kept <= lynx


def test_a_budget_the_pieces_cannot_reach_is_refused_naming_what_lies_outside_them():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    x = example_batch(model, 2)
    per_block(model, {"policy": "lynx", "memory_budget": 0.05, "compiler": "eager"}, fullgraph=True)
    for _ in range(2):
        model(x).loss.backward()
    with pytest.raises(BudgetError) as err:
        model(x).loss.backward()
    msg = str(err.value)
    assert "outside" in msg and "compile it too" in msg and "Use memory_budget >= 0." in msg


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_rerun_takes_the_pieces_and_the_step_plan_from_the_plan_cache(tmp_path, monkeypatch, caplog, compiler):
    """A script run again (a fresh backend on the same cache directory): each piece's plan and
    the step's plan across them come from the plan cache, so nothing is weighed or recorded,
    the pieces are compiled with the same candidates at step 2, and the gradients are the same.
    Under Inductor torch's AOTAutograd cache serves every compile of the rerun, the pieces
    recompiled with the step's plan included (they compile in a tracing context of lynx's)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def run(steps):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
        x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
        backend = LynxBackend(make_config({"policy": "lynx", "memory_budget": 0.5, "compiler": compiler}))
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            model(x).loss.backward()
        return backend, [p.grad.clone() for p in model.parameters()]

    first, grads = run(3)
    assert first.step_recorder.state == "done" and not first.step_recorder._cached
    caplog.clear()
    with caplog.at_level("INFO", logger="lynx_compile"):
        again, grads_again = run(2)  # step 1 compiles from the cache, step 2 runs the step's plan
    seen = caplog.messages
    # every piece's provisional plan from its entry: the entry's bytes count the block input the
    # piece saves, as the step's plan does (until session 30 compared without it, and missed)
    assert not [m for m in seen if "re-planning" in m], seen
    assert any("plan cache: hit" in m for m in seen), seen
    recorder = again.step_recorder
    assert recorder.state == "done" and recorder._cached and recorder.steps_seen == 1
    assert [r.step_choice for r in again.records] == [r.step_choice for r in first.records]
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
    if compiler == "inductor":
        assert [r.stats.get("served_by") for r in again.records] == ["autograd_cache"] * len(again.records)
        assert [r.plan.peak_bytes for r in again.records] == [r.plan.peak_bytes for r in first.records]


def _n_calls(cands, n, grad_bytes):
    """One graph called ``n`` times (forwards 0..n-1, then backwards n-1..0), each backward adding
    ``grad_bytes`` of ``.grad`` that the step holds from then on; recorded with ``cands[0]``."""
    ran = cands[0]
    graphs = {0: GraphChoices(reference=ran, choices=tuple(cands), current=ran.name)}
    segs, alive, outside = [], [], 0
    for k in range(n):
        segs.append(Segment(peak=len(alive) * ran.saved_bytes + ran.forward_peak_bytes, alive=tuple(alive),
                            running=(k, "fw")))
        alive.append(k)
    for k in reversed(range(n)):
        alive.remove(k)
        segs.append(Segment(peak=outside + len(alive) * ran.saved_bytes + ran.backward_peak_bytes,
                            alive=tuple(alive), running=(k, "bw")))
        outside += grad_bytes
    return StepModel(graphs=graphs, calls=(0,) * n, segments=tuple(segs))


@pytest.mark.parametrize("n,grad_bytes", [(4, 167936), (16, 167936), (16, 0)])
def test_the_provisional_candidate_is_the_least_step_peak_of_many_calls(n, grad_bytes):
    """``provisional_pick`` (before any step is recorded, the number of calls unknown) picks the
    candidate whose step of ``n`` calls peaks lowest, by the step model's own arithmetic
    (oracle), with ``.grad`` None at the step's start (each call adds a block's gradients) and
    allocated (adds none). gpt-tiny's block candidates as measured: ``full`` saves nothing but
    peaks in its backward as high as no recompute; the candidate saving least is not the answer
    where ``.grad`` is None."""
    from lynx_compile.step.model import provisional_pick

    cands = [_c("none", 0.0, 560128, 592896, 789504), _c("full", 4.0, 0, 229376, 788480),
             _c("torch@0.3", 2.0, 167936, 331776, 528384), _c("torch@0.1", 3.0, 39936, 230400, 564224)]
    model = _n_calls(cands, n, grad_bytes)
    peaks = {c.name: model.predicted(model.uniform({0: c})) for c in cands}
    pick = provisional_pick(cands, grad_bytes)
    assert peaks[pick.name] == min(peaks.values()), (pick.name, peaks)
    assert (pick.name == CandidateKey("full")) == (grad_bytes == 0), pick.name


def test_the_provisional_candidate_weighs_what_it_saves_against_its_transient():
    """Saving 4,096 B a call more than the gradients a call adds pays for a backward 35,840 B
    lower in any step of up to 9 calls (gpt-tiny per block, 4 calls: 0.455 of the step against
    0.467), and costs at most 2% in a step of very many; the other candidate's worst is 6.4%
    (one call). Oracle: the step model's arithmetic at 4 calls."""
    from lynx_compile.step.model import provisional_pick

    low_saved, low_transient = _c("torch@0.1", 3.0, 72704, 230400, 596992), _c("torch@0.3", 2.0, 200704, 331776, 561152)
    assert provisional_pick([low_saved, low_transient], 196608) == low_transient
    model = _n_calls([low_saved, low_transient], 4, 196608)
    assert model.predicted(model.uniform({0: low_transient})) < model.predicted(model.uniform({0: low_saved}))


def test_compiling_a_piece_again_allocates_no_stand_in_for_a_dead_activation():
    """``InputSpec`` keeps weak references: at step 3 the example activation a piece compiled
    with is gone. Its stand-in for the compile again (``_compat.static_tracing``) is a fake
    tensor of the tracing's mode, of the same layout: nothing of the step's memory (a real
    empty tensor was, 1 MiB here, measured by the CPU allocator's events)."""
    from lynx_compile import _compat
    from lynx_compile.step.piece import InputSpec

    weight = torch.nn.Parameter(torch.randn(4, 4))
    activation = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    spec = InputSpec([activation, weight, 3])
    del activation
    seen = []

    def compile_again():
        with _compat.static_tracing(spec.inputs) as fakes:
            seen.append(fakes)

    assert cpu_peak_bytes(compile_again) < 64 * 1024
    (x, w, k), = seen
    assert type(x).__name__ == "FakeTensor" and x.shape == (256, 1024) and x.requires_grad
    assert type(w).__name__ == "FakeTensor" and w.shape == (4, 4) and k == 3
    # without the tracing's mode (the eager compiler compiles with real inputs): a real one
    real = cpu_peak_bytes(lambda: seen.append(spec.inputs()))
    assert real >= 1024 * 1024 and seen[-1][1] is weight
