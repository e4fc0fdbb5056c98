"""lynx under compiled DDP (``torch.compile(DistributedDataParallel(model), backend=...)``), 2 gloo
ranks on CPU, buckets small enough that dynamo's DDPOptimizer splits the model into several
graphs (issue Q items 1-2; issue V item 2).

What is checked, each against ``backend="inductor"`` on the same DDP model and batch:

- the parameter gradients leave every compiled graph where they are computed
  (``lynx_compile.memory.grad_in_graph``; DDP's reducer reads ``.grad`` from its hook on
  ``AccumulateGrad``, which still runs), and the all-reduced gradients equal Inductor's;
- the step is recorded and planned across the pieces (DDPOptimizer runs each compiled bucket on
  fake tensors while it compiles the next: those calls are not steps), and with ``.grad``
  allocated at each start (``zero_grad(set_to_none=False)``) every measured step is within the
  budget of Inductor's same step (+2%). Step 2 is compared only to Inductor's step 2: DDP
  rebuilds its buckets as step 2 starts, and the profiler counts the new buckets but not the
  freeing of the old ones (allocated before it started), in both;
- with ``.grad`` None at each start the gradients alone exceed 0.7 of the step: the budget is
  refused at step 3 on both ranks naming the same smallest budget (before, the recorder never
  saw a step end and the budget was silently not held).
"""
from __future__ import annotations

import pytest
import torch

import lynx_compile
from _dist import run_ranks
from _steps import step_peaks
from lynx_compile.decisions import BudgetError
from lynx_compile.models import build_model, example_batch

BUDGET = 0.7
STEPS = 5
UNMEASURED = 3
"""The step lynx records (the first step no profiler of the test's own runs around)."""
BUCKET_MB = 1  # (DDPOptimizer's first bucket is 1 MB; a smaller cap is refused by dynamo)


def _steps(rank: int, options: dict | None, grads_none: bool) -> dict:
    """STEPS compiled DDP steps of a 2-layer gpt-tiny of hidden 256 (6 MB of parameters: several
    buckets); per step the allocator-event peak (None for the unmeasured one), the gradients after
    the last one, and lynx's records."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2, hidden=256)
    backend = "inductor" if options is None else lynx_compile.backend(**options)
    run = torch.compile(DDP(model, bucket_cap_mb=BUCKET_MB), backend=backend)
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1 + rank))
    peaks = list(step_peaks(lambda: run(x).loss.backward(), list(model.parameters()), STEPS,
                            "none" if grads_none else "allocated", unmeasured=(UNMEASURED,)))
    out = {"peaks": peaks, "grads": [p.grad.clone() for p in model.parameters()]}
    if options is not None:
        out["records"] = [(r.graph_id, r.grads_in_graph.applies, r.grads_in_graph.why, r.step_choice,
                           r.plan.budget_scope) for r in backend.records]
        out["state"] = backend.step_recorder.state
    return out


def _ranks(rank: int, world: int) -> dict:
    options = {"memory_budget": BUDGET, "plan_cache": False}
    out = {"inductor": _steps(rank, None, False), "lynx": _steps(rank, options, False)}
    try:
        _steps(rank, options, True)
        out["refused"] = None
    except BudgetError as e:
        out["refused"] = str(e)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_ranks, 2, timeout_s=900)


def test_gradients_leave_every_piece_and_equal_inductors(ranks):
    for r in ranks:
        records = r["lynx"]["records"]
        assert len({g for g, *_ in records}) >= 3, records  # DDPOptimizer split the model
        assert all(applies for _, applies, *_ in records), records
        for a, b in zip(r["lynx"]["grads"], r["inductor"]["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_every_step_within_the_budget_with_grads_allocated(ranks):
    for r in ranks:
        assert r["lynx"]["state"] == "done"
        assert {scope for *_, scope in r["lynx"]["records"]} == {"step"}
        lynx, ref = r["lynx"]["peaks"], r["inductor"]["peaks"]
        for step, (a, b) in enumerate(zip(lynx, ref), start=1):
            if step == UNMEASURED:
                continue
            limit = b if step == 2 else BUDGET * 1.02 * b  # (step 2: DDP's rebuilt buckets in both)
            assert a <= limit, (step, a / b, lynx, ref)
    # one plan on both ranks
    assert [c for *_, c, _ in ranks[0]["lynx"]["records"]] == [c for *_, c, _ in ranks[1]["lynx"]["records"]]


def test_unreachable_with_grads_none_is_refused_alike_on_every_rank(ranks):
    refusals = [r["refused"] for r in ranks]
    assert all(refusals), refusals
    assert "Use memory_budget >=" in refusals[0]
    named = [s.split("Use memory_budget >= ")[1].split()[0] for s in refusals]
    assert named[0] == named[1] and float(named[0]) > BUDGET, refusals
