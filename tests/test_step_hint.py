"""A rerun compiles a whole graph once where the first run compiled it twice (issue P, warm
runs; ``lynx_compile.step.hint``).

torchtitan's trainer compiles the model and its loss apart: two graphs of one step. At budget 0.7
the model graph is planned at step 1 within 0.7 of its own peak; the step recorded at step 2
(the loss and logits outside it) does not fit, so lynx plans the model graph lower
(``step_choice``: ``CandidateKey("plan", nbytes=...)``) and compiles it again at step 3. A rerun of the script, on the
same cache directory, compiles it within that lower peak at step 1 and never again.

Oracles: the first run (the choice its step's plan made; its gradients, bit for bit: the same
plan compiled by the same Inductor).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import torchtitan_models as tt  # noqa: E402

from lynx_compile.step import hint as step_hint  # noqa: E402
from lynx_compile.config import make_config  # noqa: E402
from lynx_compile.compiler.dynamo_backend import LynxBackend  # noqa: E402

_MISSING = tt.available()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    for name in ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # Inductor's CPU embedding backward is bitwise stable on one thread
    yield
    torch.set_num_threads(threads)


def _run(steps: int):
    """(backend, each graph's compiles as (graph id, step choice) in compile order, gradients)."""
    torch._dynamo.reset()
    backend = LynxBackend(make_config({"memory_budget": 0.7}))
    compiles = []
    original = backend._compile

    def counting(gm, example_inputs, record):
        compiles.append((record.graph_id, record.step_choice))
        return original(gm, example_inputs, record)

    backend._compile = counting
    model, step = tt.step_fn("tt-llama3", "whole", backend, 2, 256, layers=3)  # its first 3 blocks: shorter
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        step()
    return backend, compiles, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def test_a_rerun_compiles_the_whole_graph_once_within_the_steps_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    first, compiles, grads = _run(3)
    model_graph = first.records[0]
    lower = model_graph.step_choice
    assert lower is not None and lower.policy == "plan" and lower.nbytes, [r.step_choice for r in first.records]
    gid = model_graph.graph_id
    assert [c for g, c in compiles if g == gid] == [None, lower]  # compiled twice: provisional, then lower

    again, compiles_again, grads_again = _run(3)
    graph = again.records[0]
    assert [c for g, c in compiles_again if g == graph.graph_id] == [lower]  # once, at the lower peak
    assert graph.step_choice == lower and graph.plan.budget_scope == "step"
    assert graph.plan.peak_bytes == model_graph.plan.peak_bytes
    assert again.step_recorder.state == "done"
    assert all(torch.equal(grads[k], grads_again[k]) for k in grads)


def test_no_hint_with_the_plan_cache_off(tmp_path, monkeypatch):
    """``plan_cache=False``: nothing is kept, and every run compiles as a first one."""
    cfg = make_config({"memory_budget": 0.7, "plan_cache": False})
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert step_hint.key(gm, [torch.randn(1, 2)], cfg) is None
    assert step_hint.key(gm, [torch.randn(1, 2)], make_config({"memory_budget": 0.7})) is not None
    assert step_hint.key(gm, [torch.randn(1, 2)], make_config({})) is None  # no budget: nothing to lower
