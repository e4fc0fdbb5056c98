"""policy="lynx": the optimizer's plans train exactly like eager and fit their budget.

Budgets sweep from the smallest reachable peak to 100%; for each plan the loss and every
gradient equal eager (fp32, dropout on, same seeds), the allocator-measured peak is within the
budget (+2%) and within 5% of the prediction, and peaks do not grow as the budget shrinks."""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import find_backend_error
from lynx_compile.recompute.seeds import TORCH_SETTINGS
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.decisions import BudgetError
from _reach import BASELINES, plan_reach, reach_model

BUDGETS = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]


def _grads(model):
    return {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _run(preset, options, batch=4, seed=7):
    torch.manual_seed(0)
    eager = build_model(preset, dropout=0.1)
    twin = copy.deepcopy(eager)
    x = example_batch(eager, batch, generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    ref = eager(x).loss
    ref.backward()
    options = {"compiler": "eager", **options}  # exact: eager's RNG, prediction = allocator peak
    backend = lynx_compile.backend(**options)
    compiled = torch.compile(twin, backend=backend)
    for p in twin.parameters():  # .grad allocated from the first step on, the regime measured below
        p.grad = torch.zeros_like(p)
    torch.manual_seed(seed)
    loss = compiled(x).loss
    loss.backward()
    assert _rel(loss.detach(), ref.detach()) <= 1e-5
    ref_grads, grads = _grads(eager), _grads(twin)
    for name, g in ref_grads.items():
        assert _rel(grads[name], g) <= 1e-5, name
    twin.zero_grad(set_to_none=False)
    measured = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=0,
                            params=list(twin.parameters()))
    return backend.plans[-1], measured


# each solver on one of the two models (the four pairs took 183 s of the suite; each model's
# plans under both solvers are compared in test_solver_heuristic / test_solver_solvers)
@pytest.mark.parametrize("preset,solver", [("gpt-tiny", "highs"), ("llama-tiny", "heu")])
def test_budget_sweep_equals_eager_fits_and_is_monotone(preset, solver):
    peaks = []
    for i, budget in enumerate(BUDGETS):
        torch._dynamo.reset()
        options = {"policy": "lynx", "memory_budget": budget, "solver": solver, "plan_cache": False}
        try:
            plan, measured = _run(preset, options, seed=11 + i)
        except Exception as e:  # below the smallest reachable budget: must say so
            assert "smallest reachable peak" in str(e), e
            break
        budget_bytes = plan.budget_bytes
        assert measured.peak_bytes <= budget_bytes * 1.02, (budget, measured.peak_bytes, budget_bytes)
        assert abs(measured.peak_bytes - plan.peak_bytes) <= 0.05 * measured.peak_bytes
        peaks.append(measured.peak_bytes)
    assert len(peaks) >= 3, "the sweep should reach at least three budgets"
    assert all(b <= a for a, b in zip(peaks, peaks[1:])), peaks


def test_budget_below_smallest_reachable_is_an_error_naming_it():
    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend="lynx",
                             options={"policy": "lynx", "memory_budget": 0.05, "solver": "heu"})
    with pytest.raises(Exception) as info:  # at the end of step 1 (step.recorder.StepRecorder.defer)
        compiled(example_batch(model, 4)).loss.backward()
    err = find_backend_error(info.value, BudgetError)
    assert isinstance(err, BudgetError)
    assert "smallest reachable peak is" in str(err) and "Use memory_budget >=" in str(err)


def test_no_budget_recomputes_nothing():
    plan, _ = _run("gpt-tiny", {"policy": "lynx", "solver": "heu"})
    assert not plan.recomputed and plan.peak_fraction == pytest.approx(1.0, abs=0.01)


def test_plan_file_is_reused_without_solving(tmp_path):
    from lynx_compile.tools.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt-tiny", "--batch-size", "4", "--policy", "lynx", "--solver", "heu",
                 "--memory-budget", "0.7", "--compiler", "eager", "--out", str(out)]) == 0
    torch._dynamo.reset()
    # the step lynx plan plans: .grad None as it starts (zero_grad()'s default), the gradients
    # returned by the backward, as a compile under a budget makes the graph at its first step
    torch.manual_seed(0)
    eager = build_model("gpt-tiny", dropout=0.1)
    twin = copy.deepcopy(eager)
    x = example_batch(eager, 4, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    eager(x).loss.backward()
    backend = lynx_compile.backend(policy="lynx", memory_budget=0.7, plan=str(out), compiler="eager")
    torch.manual_seed(7)
    torch.compile(twin, backend=backend)(x).loss.backward()
    for name, g in _grads(eager).items():
        assert _rel(_grads(twin)[name], g) <= 1e-5, name
    plan = backend.plans[-1]
    assert plan.solver == "file" and plan.plan_time_s == 0.0
    import json
    saved = json.loads(out.read_text())[0]
    from lynx_compile.decisions import Decisions

    assert plan.decisions.source == "file"
    assert plan.decisions.units == Decisions.from_dict(saved["decisions"]).units


def test_plan_for_another_graph_is_rejected(tmp_path):
    from lynx_compile.tools.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--policy", "lynx", "--solver", "heu",
                 "--memory-budget", "0.8", "--out", str(out)]) == 0
    model = build_model("gpt-tiny")
    compiled = torch.compile(model, backend="lynx", options={"policy": "lynx", "plan": str(out)})
    with pytest.raises(Exception, match="made for a different graph"):
        compiled(example_batch(model, 2))


def test_plan_names_replayed_dropouts_by_their_forward_op():
    """A recomputed dropout is re-run from its saved RNG state by a node the partitioner makes
    (``run_with_rng_state``); the plan lists it under the forward op it replays and prices it
    with that op's cost (it was listed as ``native_dropout.default`` at zero cost)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1)
    backend = lynx_compile.backend(policy="full", compiler="eager", cost_source="analytic")
    compiled = torch.compile(model, backend=backend)
    compiled(example_batch(model, 1)).loss.backward()
    plan = backend.plans[-1]
    names = {d.name for d in plan.recomputed}
    assert not any(n.endswith(".default") for n in names), sorted(names)
    dropouts = [d for d in plan.recomputed if d.name.startswith("native_dropout")]
    assert dropouts and all(d.recompute_s > 0 for d in dropouts)


@pytest.mark.parametrize("name,baselines", [("gpt-tiny", BASELINES), ("llama-tiny", BASELINES),
                                            ("hf-llama", BASELINES[2:])], ids=["gpt-tiny", "llama-tiny", "hf-llama"])
def test_lynx_reaches_each_baseline_peak_with_no_more_exposed_recompute(name, baselines, monkeypatch):
    """Issue 13: every peak a baseline reaches (full = checkpointing each block, selective,
    torch's min-cut at 0.3 / 0.5 / 0.7), lynx reaches, given it as its budget in bytes, with no
    more exposed recompute. Where lynx's MILP cannot (full recomputes the block outputs its
    model keeps; torch's min-cut recomputes them too), a baseline is the seed (``decide``).
    HF Llama at torch@0.5 found a gap in the seeds (numbers of the memory model at the time):
    torch's min-cut was tried only at the budget fraction (0.52, which peaked above the budget)
    and half of it, not at the setting that reached the peak, so lynx fell back to full (362 us
    exposed against torch's 256 us); below the optimizer's reach it now tries every setting
    0.1 ... 0.9 (``seeds.TORCH_SETTINGS``). HF Llama (a model lynx was not written for) is
    checked against torch's min-cut only, for time: a plan below the optimizer's reach runs up to
    13 min-cut partitions. Analytic H100 costs, batch 2; tests/_reach.py."""
    model, x = reach_model(name, monkeypatch)
    rows = plan_reach(model, (x,), baselines, cost_source="analytic", hardware="h100-sxm", plan_cache=False)
    report = "\n".join(map(str, rows))
    print(f"{name}:\n{report}")  # shown with -s / -rP
    assert all(r.ok for r in rows), report
    for r in rows:
        # below the optimizer's reach (no 'lynx' candidate): torch's min-cut at every round setting.
        # Since the parameter gradients count (issue M) gpt-tiny's full is within the reach.
        if r.name == "full" and "lynx" not in r.candidates:
            assert {f"torch@{s:g}" for s in TORCH_SETTINGS} <= set(r.candidates), r.candidates
