"""Graphs that are one block or a piece of a model (per-block compile, graph breaks): the whole
graph is one block, and the budget bounds the bytes each graph saves, which is what adds up.

Oracles: eager PyTorch (gradients), policy ``none`` (measured whole-step peak), and the plan's own
saved bytes against the budget fraction of the no-recompute saved bytes.
"""
from __future__ import annotations

import copy

import pytest
import torch

import lynx_compile
from lynx_compile.compiler.dynamo_backend import LynxBackend
from lynx_compile.config import make_config
from lynx_compile.memory.measure import measure_step
from lynx_compile.models import build_model, example_batch

from _steps import per_block


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_per_block_compile_at_half_budget_equals_eager_and_saves_memory(compiler):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=4)
    ref, none_model = copy.deepcopy(model), copy.deepcopy(model)
    # batch 4: the step's plan holds for a step that starts from .grad None too (its gradients
    # kept, memory.param_grads); at batch 2 they are so much of the step that 0.5 is refused (0.713)
    x = example_batch(model, 4)
    backend = per_block(model, {"policy": "lynx", "memory_budget": 0.5, "compiler": compiler})
    per_block(none_model, {"policy": "none", "compiler": compiler})
    loss = model(x).loss
    loss.backward()
    want = ref(x).loss
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-5, name
    assert backend.records  # identical blocks share one graph (parameters are its inputs)
    for r in backend.records:
        plan = r.plan
        assert r.blocks == ["(whole graph)"] and plan.budget_scope == "saved"
        assert plan.saved_bytes <= plan.budget_bytes  # the budget bounds what each graph saves
        assert any("one block" in n for n in plan.notes)
    none_model(x).loss.backward()
    lynx_peak = measure_step(lambda: model(x).loss.backward(), repeats=1, warmup=0,
                             params=list(model.parameters())).peak_bytes
    none_peak = measure_step(lambda: none_model(x).loss.backward(), repeats=1, warmup=0,
                             params=list(none_model.parameters())).peak_bytes
    assert lynx_peak < none_peak, (lynx_peak, none_peak)


def test_per_block_compile_of_a_model_not_written_for_lynx():
    """``nn.TransformerEncoderLayer``s compiled one by one (torch's own layer, not ours)."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                                 for _ in range(3))
    ref = copy.deepcopy(layers)
    backend = LynxBackend(make_config({"policy": "lynx", "memory_budget": 0.5, "plan_cache": False}))
    for layer in layers:
        layer.compile(backend=backend)
    x = torch.randn(2, 16, 32)

    def run(mods):
        h = x
        for m in mods:
            h = m(h)
        return h.square().mean()

    loss = run(layers)
    loss.backward()
    want = run(ref)
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    for p, q in zip(layers.parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4
    assert all(r.plan.saved_bytes <= r.plan.budget_bytes for r in backend.records)


def test_flat_graph_is_one_block_for_full():
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 16)
            self.b = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.b(self.a(x).relu()).sum()

    torch.manual_seed(0)
    model = Flat()
    ref = copy.deepcopy(model)
    backend = lynx_compile.backend(policy="full", compiler="eager", plan_cache=False)
    x = torch.randn(4, 8)
    torch.compile(model, backend=backend)(x).backward()
    ref(x).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-5
    plan = backend.plans[-1]
    assert backend.records[-1].blocks == ["(whole graph)"] and plan.recomputed  # relu recomputed


def test_loss_only_graph_meets_any_budget_and_never_errors():
    """A loss-only graph (what a graph break before the loss leaves): once a whole-model budget
    made it fail at every budget; as a piece it recomputes what it saves and trains."""
    w = torch.randn(8, 8, requires_grad=True)

    def loss_only(h):
        return torch.nn.functional.cross_entropy(h @ w, torch.zeros(h.shape[0], dtype=torch.long))

    backend = LynxBackend(make_config({"policy": "lynx", "memory_budget": 0.01, "plan_cache": False,
                                       "compiler": "eager"}))
    h = torch.randn(4, 8, requires_grad=True)
    out = torch.compile(loss_only, backend=backend)(h)
    out.backward()
    got = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    want = loss_only(h)
    want.backward()
    assert torch.allclose(out, want)
    assert torch.allclose(got[0], h.grad) and torch.allclose(got[1], w.grad)
    plan = backend.plans[-1]
    assert plan.budget_scope == "saved" and plan.saved_bytes <= plan.budget_bytes


def test_hf_gpt2_with_labels_under_a_budget():
    """HF ``GPT2LMHeadModel(...)(x, labels=x)``: transformers breaks the graph before the loss;
    the loss graph is a piece of the model and no longer makes every budget fail. Gradients
    equal eager's; the measured step peak is below policy none's. (transformers is not a
    dependency: skipped without it.) Budget 0.65: since a fraction is of torch.compile's own
    step (issue M) this model reaches no less than 0.548 of it (0.5 was reachable against the
    unfused reference)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref, none_model = copy.deepcopy(model), copy.deepcopy(model)
    # batch 4 x 64: the step's peak counts the parameter gradients (issue M); at 2 x 32 they
    # hold the smallest reachable peak at 0.761 of none's
    x = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    backend = LynxBackend(make_config({"policy": "lynx", "memory_budget": 0.65, "plan_cache": False}))
    compiled = torch.compile(model, backend=backend)
    loss = compiled(x, labels=x).loss
    loss.backward()
    want = ref(x, labels=x).loss
    want.backward()
    assert _rel(loss.detach(), want.detach()) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-4, name
    compiled_none = torch.compile(none_model, backend=LynxBackend(make_config({"policy": "none"})))
    compiled_none(x, labels=x).loss.backward()
    peak = measure_step(lambda: compiled(x, labels=x).loss.backward(), repeats=1, warmup=0,
                        params=list(model.parameters())).peak_bytes
    none_peak = measure_step(lambda: compiled_none(x, labels=x).loss.backward(), repeats=1, warmup=0,
                             params=list(none_model.parameters())).peak_bytes
    assert peak < none_peak, (peak, none_peak)
