"""One smallest budget, the true one (issue Q item 3): a budget lynx refuses names the lowest
exact peak of the candidates every budget its optimizer has no plan under tries (``full``,
``selective``, torch's min-cut at ``seeds.TORCH_SETTINGS`` and ``seeds.LAST_SETTINGS``, the
optimizer at its own smallest peak), whatever budget was asked, and asking for it is accepted.

References, independent of the number named: the refused compile's own candidates (none of
those it realized peaks below it), policy ``full`` compiled on its own and its measured step,
and the measured step of the plan at the named budget. Fractions are of the plan's
no-recompute reference, the peak a budget's fraction is of (``lynx_compile.budget``).

One model: the zoo's gpt-tiny (2 layers, sequence 128, batch 2), where torch's min-cut at 0.05
peaks lowest (below ``full`` and every setting of 0.1 ... 0.9: before, a refusal of 0.05 named
``full``'s peak, and a budget between the two was refused). ``compiler="eager"``: the prediction
is the allocator's peak, and torch's min-cut candidates are tried as under Inductor, without
Inductor's code generation. Analytic H100 costs, no plan cache; ``.grad`` allocated when it
compiles, as in steady-state training (the memory model then counts what
``measure_step(params=...)`` measures). Five compiles: two refusals, the named budget measured,
``full`` measured, a plan at its fraction.
"""
from __future__ import annotations

import math
import json
import re

import pytest
import torch

import lynx_compile
from lynx_compile.budget import parse_budget
from lynx_compile.decisions import BudgetError
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.planning import plan_model

OPTIONS = {"compiler": "eager", "cost_source": "analytic", "hardware": "h100-sxm", "plan_cache": False}
TOLERANCE = 0.02  # the issue's: the measured peak within the budget's fraction + 2%


def _model():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=2, seq_len=128, dropout=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model, example_batch(model, 2, generator=torch.Generator().manual_seed(1))


def _fraction_up(nbytes: int, reference: int) -> float:
    """``nbytes`` as a fraction of ``reference``, rounded up at the third digit (as a person
    would write the budget it takes)."""
    return math.ceil(nbytes / reference * 1000) / 1000


def _refusal(budget: float):
    """(the BudgetError, the fraction it names, its graph's record) of lynx at ``budget``."""
    model, x = _model()
    backend = lynx_compile.backend(memory_budget=budget, **OPTIONS)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(model, backend=backend)(x).loss.backward()
    err = find_backend_error(info.value, BudgetError)
    assert err is not None and err.smallest_bytes is not None, info.value
    text = str(err)
    named = re.search(r"Use memory_budget >= ([0-9.]+)", text)
    assert named and text.index("Use memory_budget") < text.index("The smallest reachable peak"), text  # the fix first
    return err, parse_budget(named.group(1)), backend.records[-1]


def _measured(**options):
    """(plan, measured step peak) of the model compiled with lynx under ``options``."""
    model, x = _model()
    backend = lynx_compile.backend(**OPTIONS, **options)
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend)
    m = measure_step(lambda: run(x).loss.backward(), repeats=1, warmup=1, params=list(model.parameters()))
    return backend.plans[-1], m.peak_bytes


_SETTINGS: list[float] = []
"""The min-cut setting of each partition torch made while 0.05 was refused (``refusals``)."""


@pytest.fixture(scope="module")
def refusals():
    """Refusals of 0.05 and of the budget just below the one 0.05's names."""
    from lynx_compile import _compat

    partition = _compat.min_cut_partition

    def counted(*args, memory_budget: float = 1.0, **kw):
        _SETTINGS.append(memory_budget)
        return partition(*args, memory_budget=memory_budget, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compat, "min_cut_partition", counted)
        first = _refusal(0.05)
    return first, _refusal(round(first[1] - 0.001, 3))


def test_every_refusal_names_the_same_smallest_budget(refusals):
    """0.05 and the budget just below the one it names name the same peak and fraction, and no
    candidate the refusal of 0.05 realized peaks below it (0.05's own min-cut settings, 0.05
    and 0.025, are among those every refusal tries: partitioned once each, at the budget's
    fraction, and taken again as last settings; before session 38, twice)."""
    (err, named, record), (err_below, named_below, _) = refusals
    # each of the refusal's decisions (step 1's, the step's) partitions at each setting once
    assert _SETTINGS.count(0.05) == _SETTINGS.count(0.025) == _SETTINGS.count(0.9) >= 1, repr(_SETTINGS)
    assert (err.smallest_bytes, named) == (err_below.smallest_bytes, named_below), (str(err), str(err_below))
    peaks = {k: c["peak_bytes"] for k, c in record.stats["candidates"].items() if "peak_bytes" in c}
    assert min(peaks.values()) == err.smallest_bytes, peaks
    assert {"full", "selective", "torch@0.05", "torch@0.025", "lynx@smallest"} <= set(peaks), peaks
    assert named == _fraction_up(err.smallest_bytes, record.reference_peak_bytes)


def test_the_named_budget_is_accepted_and_holds_on_the_measured_step(refusals):
    (err, named, _), _ = refusals
    plan, measured = _measured(memory_budget=named)
    assert plan.peak_bytes <= plan.budget_bytes
    # the plan names what it chose in text (a typed candidate key there broke its JSON)
    assert isinstance(plan.solver, str) and json.loads(plan.to_json())["solver"] == plan.solver, plan.solver
    assert measured <= (named + TOLERANCE) * plan.reference_peak_bytes, (measured, named, plan.reference_peak_bytes)


def test_policy_fulls_measured_fraction_is_accepted(refusals):
    """Policy full's measured step, as the fraction a person would read off it, is never
    refused, and is at or above the smallest budget named."""
    (_, named, _), _ = refusals
    plan, measured = _measured(policy="full")
    fraction = _fraction_up(measured, plan.reference_peak_bytes)
    assert fraction >= named
    model, x = _model()
    lynx = plan_model(model, (x,), memory_budget=fraction, **OPTIONS)[-1].plan  # a refusal raises here
    assert lynx.peak_bytes <= lynx.budget_bytes
