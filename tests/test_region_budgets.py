"""Budgets per region of the model (issue U item 2; ``lynx_compile/recompute/regions.py``).

A region annotated with ``lynx_compile.region_budget(f)`` (or torch's own
``torch.autograd.graph.region_activation_memory_budget(f)``) saves at most ``f`` of what it
saves with no recompute, next to the step's budget. The references: a toy problem with a
hand-computed optimum (both solvers), torch.compile's own step (``backend="inductor"``) for the
step's peak and the gradients, and the compiled graphs' saved tensors for the region's bytes.
"""
import re

import pytest
import torch

import lynx_compile
from lynx_compile.config import make_config
from lynx_compile.compiler.dynamo_backend import LynxBackend, find_backend_error
from lynx_compile.models import build_model

from _steps import measured_steps
from lynx_compile.recompute.regions import RegionBudgetError
from lynx_compile.solver import RematProblem, Unit
from lynx_compile.solver.heuristic import solve_heu
from lynx_compile.solver.milp import solve_milp
from lynx_compile.solver.problem import InfeasibleRegion, RegionCap

MS = 1e-3
SOLVERS = [pytest.param(lambda p, b: solve_milp(p, b, solver="highs"), id="opt-highs"),
           pytest.param(lambda p, b: solve_heu(p, b), id="heu")]


def _toy(cap_bytes, must_c=False):
    # a: 4 B, 1 ms; b: 3 B, 2 ms; c: 2 B, 3 ms; read by the backward at events 1, 2, 3; the step's
    # budget (100 B) binds nowhere. Region {b, c} may keep at most cap_bytes:
    # cap 3 -> keep b (3 B) and recompute c: 3 ms, or keep c (2 B) and recompute b: 2 ms. Optimum:
    # keep {a, c}, recompute b on demand, 2 ms exposed.
    def unit(i, nbytes, ms, use, must=False):
        return Unit(id=i, name=f"u{i}", nbytes=nbytes, compute_s=ms * MS, fw_pos=i, fw_last=i, first_use=use,
                    need_start=use, need_end=use, must_keep=must)
    units = (unit(0, 4, 1, 1), unit(1, 3, 2, 2), unit(2, 2, 3, 3, must=must_c))
    cap = RegionCap(name="bc", units=(1, 2), max_bytes=cap_bytes, fraction=cap_bytes / 5, reference_bytes=5)
    return RematProblem(units=units, num_fw_events=3, num_bw_events=4, fw_base=(0, 0, 0), bw_base=(10, 0, 0, 0),
                        reference_peak=19, region_caps=(cap,))


@pytest.mark.parametrize("solve", SOLVERS)
def test_toy_region_cap_is_a_constraint(solve):
    sol = solve(_toy(3), 100)
    assert sorted(sol.keep) == [0, 2] and list(sol.demand) == [1]
    assert sol.exposed_s == pytest.approx(2 * MS)
    unconstrained = solve(_toy(5), 100)  # the region's whole 5 B fits: nothing recomputed
    assert sorted(unconstrained.keep) == [0, 1, 2] and unconstrained.exposed_s == 0


@pytest.mark.parametrize("solve", SOLVERS)
def test_toy_region_below_what_it_must_keep_is_refused(solve):
    # c cannot be recomputed (must_keep, 2 B): the region reaches 2 / 5 = 0.4 at the least
    with pytest.raises(InfeasibleRegion, match=r"region 'bc'.*use a region budget >= 0\.400") as refused:
        solve(_toy(1, must_c=True), 100)
    assert refused.value.smallest == pytest.approx(0.4)


class Budgeted(torch.nn.Module):
    """``inner`` run as a region with its own budget (how a user annotates a module)."""

    def __init__(self, inner, fraction, name, torch_api=False):
        super().__init__()
        self.inner, self.fraction, self.name, self.torch_api = inner, fraction, name, torch_api

    def forward(self, x):
        if self.torch_api:
            with torch.autograd.graph.region_activation_memory_budget(self.fraction):
                return self.inner(x)
        with lynx_compile.region_budget(self.fraction, name=self.name):
            return self.inner(x)


def _model(region=None, torch_api=False):
    """gpt-tiny, 2 layers; ``region``: (module path in block 0, fraction)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    if region is not None:
        path, fraction = region
        block = model.blocks[0]
        if path == "blocks":  # every block, one region (consecutive code with one annotation)
            for i, b in enumerate(model.blocks):
                model.blocks[i] = Budgeted(b, fraction, "blocks", torch_api)
        else:
            setattr(block, path, Budgeted(getattr(block, path), fraction, f"{path}0", torch_api))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def _steps(backend, region=None, style="whole", steps=2, torch_api=False):
    """(peak of each step, last gradients): ``.grad`` allocated, as the peers are measured."""
    torch._dynamo.reset()
    return measured_steps(_model(region, torch_api), backend, style, steps)


def _lynx(**options):
    return LynxBackend(make_config({"plan_cache": False, **options}))


@pytest.fixture(scope="module")
def inductor():
    return _steps("inductor")


def _region(backend):
    (record,) = [r for r in backend.records if r.stats.get("regions")]
    (region,) = record.stats["regions"]
    return record, region


def test_region_budget_held_beside_the_step_budget(inductor):
    """The MLP of block 0 at 0.3 and the step at 0.8: the region saves at most 0.3 of what it
    saves with no recompute, the step is within 0.8 of torch.compile's, the gradients are
    Inductor's (within its own error), and the record says what the region held."""
    backend = _lynx(memory_budget=0.8)
    peaks, grads = _steps(backend, region=("mlp", 0.3))
    record, region = _region(backend)
    assert region["name"] == "mlp0" and region["budget"] == 0.3 and region["reference_bytes"] > 0
    assert region["saved_bytes"] <= 0.3 * region["reference_bytes"]
    # the region's saved bytes, read independently off the compiled backward's inputs
    assert record.plan.peak_bytes <= 0.8 * record.reference_peak_bytes
    for got, want in zip(peaks, inductor[0]):
        assert got <= 0.8 * want * 1.02, (peaks, inductor[0])
    for g, w in zip(grads, inductor[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert any("region budgets of the model: 'mlp0' at 0.3" in n for n in record.notes)


def test_region_budget_without_a_step_budget_recomputes_only_there(inductor):
    """No step budget: lynx plans for the region alone; the region's bytes within its cap and the
    step at or below torch.compile's (nothing outside the region is asked for)."""
    backend = _lynx()
    peaks, grads = _steps(backend, region=("mlp", 0.0))
    record, region = _region(backend)
    assert region["saved_bytes"] == 0 < region["reference_bytes"]
    assert record.plan.recomputed and all(peak <= want for peak, want in zip(peaks, inductor[0]))
    for g, w in zip(grads, inductor[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_unreachable_region_budget_is_refused_naming_the_region():
    """Every block as one region at 0: block 0's output is read across the boundary into block
    1 and stays saved, so 0 is refused, naming the region and the smallest budget it reaches;
    that one is accepted and held."""
    with pytest.raises(Exception) as refused:
        _steps(_lynx(memory_budget=0.9), region=("blocks", 0.0), steps=1)
    error = find_backend_error(refused.value, RegionBudgetError)
    assert isinstance(error, RegionBudgetError), refused.value
    assert "region 'blocks'" in str(error)
    smallest = float(re.search(r"use a region budget >= ([0-9.]+)", str(error)).group(1))
    assert 0 < smallest < 1
    backend = _lynx(memory_budget=0.9)
    _steps(backend, region=("blocks", smallest), steps=1)
    _, region = _region(backend)
    assert region["saved_bytes"] <= smallest * region["reference_bytes"]


@pytest.mark.skipif(not hasattr(torch.autograd.graph, "region_activation_memory_budget"),
                    reason="torch's per-region budget is torch 2.13's")
def test_torchs_own_annotation_plans_as_lynxs():
    """``torch.autograd.graph.region_activation_memory_budget`` is read as lynx's own: the same
    region bytes and the same peak (only the region's name differs: its module path)."""
    mine, theirs = _lynx(memory_budget=0.8), _lynx(memory_budget=0.8)
    peaks_mine, _ = _steps(mine, region=("mlp", 0.3))
    peaks_theirs, _ = _steps(theirs, region=("mlp", 0.3), torch_api=True)
    (a,), (b,) = (_region(mine)[1],), (_region(theirs)[1],)
    assert b["name"].startswith("blocks.0.mlp") and a["saved_bytes"] == b["saved_bytes"]
    assert peaks_mine[-1] == peaks_theirs[-1]


def test_region_budget_per_block():
    """Blocks compiled apart (torchtitan's style): the piece holding the region keeps it within
    its budget at every step."""
    backend = _lynx()
    _steps(backend, region=("mlp", 0.0), style="per-block", steps=4)
    held = [r["saved_bytes"] for rec in backend.records for r in rec.stats.get("regions", ())]
    assert held and all(s == 0 for s in held)


def test_bad_region_budget_names_the_fix():
    with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
        lynx_compile.region_budget(1.5)


_FRESH = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import lynx_compile
from test_region_budgets import _model
from lynx_compile.models import example_batch
model = _model(("mlp", {fraction}))
x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
backend = lynx_compile.backend(memory_budget=0.9)
torch.compile(model, backend=backend)(x).loss.backward()
record = backend.records[0]
print(json.dumps({{"regions": record.stats["regions"], "cache": record.stats.get("plan_cache")}}))
"""


def test_a_changed_region_budget_is_not_served_from_the_caches():
    """The plan cache and torch's compile caches (on disk, fresh processes, the machine's own
    cache directory): the same graph with another region budget gets its own plan, never the
    other's (cache hits of the same options are test_plan_cache's)."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)

    def run(fraction):
        code = _FRESH.format(tests=os.path.dirname(os.path.abspath(__file__)), fraction=fraction)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, other, again = run(0.0), run(1.0), run(0.0)
    assert first["regions"][0]["saved_bytes"] == again["regions"][0]["saved_bytes"] == 0
    assert again["cache"] == "hit"
    assert other["regions"][0]["budget"] == 1.0 and other["regions"][0]["saved_bytes"] > 0
