"""One smallest budget for a model whose loss is compiled apart (issue Q item 3).

torchtitan's trainer compiles the model and its loss as two graphs of one step. The model graph
is compiled first and whole; its budget on its own peak can be out of reach while the step's is
decided only once the step is recorded (the loss and logits beside it). Before, a budget out of
reach on the model graph's own peak was refused at step 1 naming the model graph's smallest
budget (gpt-tiny 4 layers: 0.550), and asking for that was accepted at step 1 and refused at step
3 naming the step's (0.562): two numbers. Now the model graph is compiled at its smallest peak
and the refusal is left to the step (``step.recorder.StepRecorder.defer``): every unreachable
budget names the step's smallest, and asking for it is accepted.

References, independent of the number named: torch.compile's (``backend="inductor"``) same
step, measured alike (the budget's 100%), +2% (the issue's tolerance).

gpt-tiny, 4 layers, batch 4, one thread: ``model.logits`` compiled whole, the next-token loss
compiled apart, both by the same backend; ``.grad`` None at each step's start.
"""
from __future__ import annotations

import gc
import re

import pytest
import torch

from _steps import step_peaks
from lynx_compile.budget import parse_budget
from lynx_compile.config import make_config
from lynx_compile.decisions import BudgetError
from lynx_compile.compiler.dynamo_backend import LynxBackend, find_backend_error
from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import build_model, example_batch
from lynx_compile.models.common import lm_loss

TOLERANCE = 0.02
RECORDED = 2  # lynx_compile.step.recorder.RECORDED_STEP: not measured here (one profiler at a time)


def _step(backend):
    """(model, one training step) of gpt-tiny with its logits and its loss compiled apart."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    logits = torch.compile(model.logits, backend=backend)
    loss = torch.compile(lambda out, idx: lm_loss(out, idx, None), backend=backend)
    return model, lambda: loss(logits(x), x).backward()


def _set_none(model):
    for p in model.parameters():
        p.grad = None


def _lynx(budget: float) -> LynxBackend:
    return LynxBackend(make_config({"memory_budget": budget, "plan_cache": False}))


def _peaks(backend, steps: int = 5) -> dict[int, int]:
    """Measured peak of each step but the recorded one."""
    torch._dynamo.reset()
    model, step = _step(backend)
    out = {}
    for i in range(1, steps + 1):
        _set_none(model)  # zero_grad()'s default, outside the measure
        if i == RECORDED:
            step()
            continue
        out[i] = cpu_peak_bytes(step)
    return out


def _refusal(budget: float) -> tuple[BudgetError, float, int]:
    """(the error, the budget it names, the step it came at)."""
    torch._dynamo.reset()
    model, step = _step(_lynx(budget))
    for i in range(1, 5):
        _set_none(model)
        try:
            step()
        except Exception as e:  # noqa: BLE001 (dynamo wraps what the backend raises)
            err = find_backend_error(e, BudgetError)
            assert err is not None, e
            named = re.search(r"Use memory_budget >= ([0-9.]+)", str(err))
            assert named, str(err)
            return err, parse_budget(named.group(1)), i
    raise AssertionError(f"memory_budget={budget} was not refused")


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def refusals(one_thread):
    return _refusal(0.05), _refusal(0.3)


def test_every_refusal_names_the_steps_smallest_budget(refusals):
    """0.05 and 0.3 (both out of reach on the model graph's own peak) name the same budget,
    once the step is recorded: the step's, not the model graph's."""
    (err_a, named_a, at_a), (err_b, named_b, at_b) = refusals
    assert named_a == named_b and err_a.smallest_bytes == err_b.smallest_bytes, (str(err_a), str(err_b))
    assert at_a == at_b == RECORDED + 1, (at_a, at_b)
    assert "compiled pieces of this step" in str(err_a), str(err_a)


def test_the_named_budget_is_accepted_and_held_after_the_recorded_step(refusals, one_thread):
    """Asked for, the named budget is accepted, and steps 1 and 3-5 hold it (step 2 is the
    recorded one, unmeasured here).

    Step 1 did not until session 21, on a CPU: the loss graph compiles inside step 1 with the
    model's activations alive, and torch's min-cut knapsack, run for lynx's ``torch@``
    candidates, allocated its DP table as CPU tensors: 0.597 of torch.compile's step 1 at 0.565
    (steps 3-5: 0.549). It runs on numpy now (``_compat.knapsack``). Until session 20 the step's
    recorder also held the logits' gradient through the model's backward (a post hook: +0.024)."""
    (_, named, _), _ = refusals
    want = _peaks("inductor")
    backend = _lynx(named)
    got = _peaks(backend)  # a refusal raises here
    # the loss graph's candidates each save the logits it takes (its backward needs them): an
    # activation input, alive after the loss's forward only because it is saved, so counted in
    # what each saves (memory.simulate.saved_input_bytes): (4, 32, vocab 128) fp32 = 65,536 B
    (loss,) = [r for r in backend.records if r.takes_activations]
    assert all(c.saved_bytes >= 4 * 128 * 32 * 4 for c in loss.step.choices), loss.step.choices
    for i, peak in got.items():
        assert peak <= (named + TOLERANCE) * want[i], (i, {k: round(v / want[k], 3) for k, v in got.items()}, named)


def test_a_whole_model_alone_is_refused_at_the_end_of_step_1(one_thread):
    """No other graph shares the step: the model graph's own refusal, as the step's backward ends
    (its forward ran at the graph's smallest peak), naming its smallest budget."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = _lynx(0.05)
    out = torch.compile(model, backend=backend)(x)  # compiled: no error yet
    (record,) = backend.records
    assert record.step_choice.policy == "plan" and record.step_choice.nbytes  # its smallest peak
    assert any("until the step shows whether other compiled graphs share it" in n for n in record.notes)
    with pytest.raises(BudgetError, match=r"Use memory_budget >= 0\.\d+") as first:
        out.loss.backward()
    # called again (a notebook cell run again after the error): refused again, never run above
    # the budget; a second model compiled with the same backend too, at its own step 1 (the
    # step count restarts: it once stayed at 1, and the next model's refusal was never raised)
    _set_none(model)
    with pytest.raises(BudgetError, match=r"Use memory_budget >= 0\.\d+"):
        torch.compile(model, backend=backend)(x).loss.backward()
    torch.manual_seed(0)
    other = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    with pytest.raises(BudgetError) as second:
        torch.compile(other, backend=backend)(x).loss.backward()
    assert second.value.smallest_bytes == first.value.smallest_bytes


def test_with_grads_allocated_the_smallest_budget_is_policy_fulls_measured_step(one_thread):
    """The recorded step counts what the step holds, not what lynx's watching holds: the end of a
    piece's backward was seen by a post hook on its autograd node, with which the engine holds
    the gradients the node receives (here the logits' gradient, 64 KiB) until it returns, and
    the recording counted them outside the pieces. With ``.grad`` allocated (torchtitan's
    llama3 in ``bench_peers``), the smallest peak a refusal named was then 6.3% above what lynx's
    own ``full`` measures (1021704 B against 960700 B; now 956168 B; torchtitan's llama3: 0.413 of
    the step named, ``full`` measured 0.349, now 0.349 named).
    Reference: policy ``full``'s measured step (steps 3-4), independent of the step's plan."""
    def measured(backend) -> int:
        torch._dynamo.reset()
        model, step = _step(backend)
        # .grad allocated at every start; steps 1-2 unmeasured (the recorded step: no profiler
        # of ours around it)
        return max(p for p in step_peaks(step, list(model.parameters()), 4, "allocated",
                                         unmeasured=range(1, RECORDED + 1)) if p is not None)

    full = measured(LynxBackend(make_config({"policy": "full", "plan_cache": False})))
    with pytest.raises(Exception) as info:
        measured(_lynx(0.05))
    err = find_backend_error(info.value, BudgetError)
    assert err is not None and err.smallest_bytes is not None, info.value
    assert "compiled pieces of this step" in str(err) and ".grad were allocated" in str(err), str(err)
    assert abs(err.smallest_bytes - full) <= TOLERANCE * full, (err.smallest_bytes, full)


def test_step_1_runs_as_later_steps_when_the_plans_are_the_same(one_thread):
    """What lynx does to watch step 1 costs no memory: the model graph compiled by lynx (planned
    on its own peak), the loss by Inductor, so steps 1 and 3 run the same compiled code, and step 1
    measures what step 3 does (within 64 B of 1.5 MB). Before, the step's recorder put a post hook
    on the model graph's autograd node to see its backward end, and autograd holds a node's
    incoming gradients until its post hooks run: the logits' gradient (64 KiB) lived through the
    model's whole backward at step 1, +4.4% (compiled DDP's buckets: steps 1-2 above
    torch.compile's)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    backend = _lynx(0.565)
    logits = torch.compile(model.logits, backend=backend)
    loss = torch.compile(lambda out, idx: lm_loss(out, idx, None), backend="inductor")
    peaks = {}
    for i in (1, 2, 3):
        _set_none(model)
        gc.collect()  # earlier tests' garbage (their models, a refused step's frames) freed before, not in, step 1
        peaks[i] = cpu_peak_bytes(lambda: loss(logits(x), x).backward())
    (record,) = backend.records
    assert record.plan.budget_bytes is not None and record.plan.recomputed, record.plan  # it recomputes
    assert abs(peaks[1] - peaks[3]) <= 64, peaks
