"""Every step within the budget, the first ones included (issue Q item 2).

The budget bounds each step's measured peak, everything the step allocates above what is
allocated when it starts (``.grad`` None at every start, ``zero_grad()``'s default, so the
parameter gradients the step creates count), against the same step of torch.compile with no
recompute (``backend="inductor"``, the budget's reference), +2%:

- a model compiled whole: one graph, planned on its own peak from its first compile;
- a model compiled per block (torchtitan's ``apply_compile``): each piece is first planned with
  the candidate of least memory in a step of many calls (``GraphRecord.provisional``,
  ``step.model.provisional_order``; at 0.5 the candidate saving least, ``full``, measured 0.552
  of Inductor's step at steps 1-2, the one chosen now 0.504), the step is recorded, and the pieces
  are planned together (``lynx_compile.step.recorder``). Steps 1-2 run the provisional plans, step 2
  is recorded (its peak read from lynx's recording as the other steps are measured:
  ``step.measured_peak.step_peak_bytes``), steps 3-5 run the plan of the step.
"""
import copy

import pytest
import torch

from lynx_compile.config import make_config
from lynx_compile.compiler.dynamo_backend import LynxBackend
from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import build_model, example_batch
from lynx_compile.step.measured_peak import step_peak_bytes


def _set_none(model):
    """``zero_grad()``'s default: the step allocates its gradients."""
    for p in model.parameters():
        p.grad = None


def _zero(model):
    """``zero_grad(set_to_none=False)``: ``.grad`` allocated at the step's start."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def _compiled(budget, style):
    """gpt-tiny (4 layers) compiled by lynx at ``budget`` and a copy by Inductor, alike in
    ``style``: (model, run, plain, ref, x, backend)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    plain = copy.deepcopy(model)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = LynxBackend(make_config({"memory_budget": budget, "plan_cache": False}))
    if style == "whole":
        return model, torch.compile(model, backend=backend), plain, torch.compile(plain, backend="inductor"), x, backend
    for block in model.blocks:
        block.compile(backend=backend, fullgraph=True)
    for block in plain.blocks:
        block.compile(backend="inductor", fullgraph=True)
    return model, model, plain, plain, x, backend


def _five_steps(model, run, plain, ref, x, reset, recorder):
    """Steps 1-5 of both, ``reset`` applied to ``.grad`` before each; per step (lynx's peak,
    Inductor's): every step, the one lynx records read from its recording (``recorder``)."""
    measured = {}
    for step in range(1, 6):
        reset(model), reset(plain)
        measured[step] = (step_peak_bytes(lambda: run(x).loss.backward(), torch.device("cpu"), recorder),
                          cpu_peak_bytes(lambda: ref(x).loss.backward()))
    return measured


@pytest.mark.parametrize("style,budget", [("whole", 0.6), ("whole", 0.7), ("per-block", 0.5), ("per-block", 0.7)])
def test_every_step_within_the_budget(style, budget):
    model, run, plain, ref, x, backend = _compiled(budget, style)
    measured = _five_steps(model, run, plain, ref, x, _set_none, backend.step_recorder)
    assert all(lynx is not None for lynx, _ in measured.values()), measured  # every step measured
    # Inductor's steps are alike: its largest measure is the reference (its compiling step 1
    # read 1.86 MB against 2.70 MB for the others once, in a loaded suite)
    none = max(n for _, n in measured.values())
    for step, (lynx, _) in measured.items():
        assert lynx <= budget * 1.02 * none, (step, lynx / none, measured)
    if style == "per-block":
        recorder = backend.step_recorder
        assert recorder.state == "done"
        assert all(r.plan.budget_scope == "step" for r in backend.records[-1:])


def test_per_block_with_grads_allocated_at_every_start(caplog):
    """``.grad`` allocated at each step's start (``zero_grad(set_to_none=False)``, a later
    micro-batch): the step is planned as it runs. At 0.38 no plan fits a step that allocates its
    gradients (gpt-tiny per block names 0.448 for it), while the step as it runs reaches 0.30;
    before, 0.38 was refused naming 0.448 although steps 1-2 measured 0.362."""
    budget = 0.38
    model, run, plain, ref, x, backend = _compiled(budget, "per-block")
    with caplog.at_level("WARNING", logger="lynx_compile"):
        measured = _five_steps(model, run, plain, ref, x, _zero, backend.step_recorder)
    assert all(lynx is not None for lynx, _ in measured.values()), measured
    none = max(n for _, n in measured.values())
    for step, (lynx, _) in measured.items():
        assert lynx <= budget * 1.02 * none, (step, lynx / none, measured)
    assert backend.step_recorder.state == "done"
    assert any(".grad were allocated as step 2 started, and the step is planned so" in r.getMessage()
               for r in caplog.records)
    # each step zeroes .grad first: the last step's gradients, equal to Inductor's
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _Recorder:
    """A step recorder as ``step_peak_bytes`` reads it: its next step is the recorded one, and
    running the step sets what its recording measured."""

    def __init__(self, measured):
        self.recorded_peak_bytes, self._measured = None, measured

    def records_next_step(self):
        return self.recorded_peak_bytes is None

    def run(self):
        self.recorded_peak_bytes = self._measured


def test_the_recorded_step_is_read_from_the_recording_on_cuda_too():
    """On CUDA lynx's recording resets the allocator's peak statistics at each mark, so an outer
    ``max_memory_allocated`` would read the last segment's: the recorded step's peak is the
    recording's on every device (no CUDA call is made for it); a step the recording does not
    record is measured by the device's own measure; a step recorded from the plan cache (nothing
    set by the step) reads None."""
    for device in (torch.device("cuda"), torch.device("cpu")):
        recorder = _Recorder(123_456)
        assert step_peak_bytes(recorder.run, device, recorder) == 123_456
    recorder = _Recorder(123_456)
    recorder.run()  # recorded already: the next step is measured by the CPU profiler
    assert step_peak_bytes(lambda: torch.ones(1024), torch.device("cpu"), recorder) == 4096
    silent = _Recorder(None)
    assert step_peak_bytes(lambda: None, torch.device("cpu"), silent) is None

