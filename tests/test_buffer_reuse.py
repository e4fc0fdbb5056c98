"""Inductor's buffer reuse under lynx's rule (option ``buffer_reuse``, ``_compat.inductor_reuse``).

The rule against a hand-worked schedule (which reuses it takes, what it holds); then compiled:
lynx's code reuses buffers it did not before, the measured step stays at the peak lynx planned
within its budget, the gradients are those without reuse; and a gradient that
``lynx::accumulate_grads`` keeps as ``.grad`` is never handed to a later buffer (per block, the
gradients equal eager's over two steps with ``.grad`` None).
"""
import gc
from types import SimpleNamespace

import pytest
import torch

import lynx_compile
from lynx_compile import _compat
from lynx_compile.memory import measure_step
from lynx_compile.memory.measure import grad_rel_diff, grad_snapshot
from lynx_compile.models import build_model, example_batch
from lynx_compile.tools.variants import transformer_blocks

WRAPPER = object()


def _line(index: int) -> SimpleNamespace:
    return SimpleNamespace(wrapper=WRAPPER, scheduler_node_index=index, comm_buffer=False)


def _freed(index: int, name: str = "buf") -> SimpleNamespace:
    return SimpleNamespace(scheduler_node_index=index, node=SimpleNamespace(get_name=lambda: name))


def test_the_rule_holds_reuses_within_the_headroom_and_never_a_kept_gradient():
    rule = _compat.ReuseRule(headroom=100)
    rule.graphs[id(WRAPPER)] = ([0] * 12, {"grad0"})
    # freed by the node just before: nothing runs between, taken whatever its size
    assert rule.decide(_line(3), _freed(2), 10_000)
    # freed at node 2, allocated at node 6: 60 B held over nodes 3-5
    assert rule.decide(_line(6), _freed(2), 60)
    # over nodes 4-7 another 60 B would hold 120 B at 4 and 5: refused; 40 B fits (100 at 4 and 5)
    assert not rule.decide(_line(8), _freed(3), 60)
    assert rule.decide(_line(8), _freed(3), 40)
    assert rule.held() == 100
    # a gradient accumulate_grads may keep as .grad: never, not even freed just before
    assert not rule.decide(_line(10), _freed(9, "grad0"), 8)
    assert (rule.reused, rule.refused) == (3, 2)
    held = rule.graphs[id(WRAPPER)][0]
    assert held[3:9] == [60, 100, 100, 40, 40, 0]


def _gpt(n_layers=2):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=n_layers, seq_len=48, dropout=0.0)
    x = example_batch(model, 3, generator=torch.Generator().manual_seed(1))
    return model, x


def _run(options: dict):
    """The model compiled whole with ``options`` (``.grad`` None before each step): the output
    code, the records, the gradients of the first step and the measured peak of one more."""
    model, x = _gpt()
    backend = lynx_compile.backend(**options)
    first = len(backend.records)
    run = torch.compile(model, backend=backend)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        run(x).loss.backward()

    # Inductor's FX-graph cache off: a graph it serves skips codegen, and the rule is not asked
    with _compat.inductor_output_code() as codes, torch._inductor.config.patch(fx_graph_cache=False):
        step()
    grads = grad_snapshot(model)
    gc.collect()  # (garbage of earlier compiles freed inside the measured step would read as negative)
    peak = measure_step(step, repeats=1, warmup=0).peak_bytes
    return "\n".join(codes), backend.records[first:], grads, peak


def test_reuse_keeps_the_planned_peak_and_the_gradients():
    torch._dynamo.reset()
    options = dict(memory_budget=0.75, plan_cache=False)
    code_on, records, grads_on, peak_on = _run(options)
    torch._dynamo.reset()
    code_off, _, grads_off, peak_off = _run({**options, "buffer_reuse": False})
    assert code_on.count("# reuse") > code_off.count("# reuse")
    assert code_on.count("empty_strided") < code_off.count("empty_strided")
    (record,) = [r for r in records if r.plan is not None]
    reuse = record.stats["buffer_reuse"]
    assert reuse["reused"] > 0 and reuse["held_bytes"] <= reuse["headroom_bytes"]
    assert reuse["headroom_bytes"] == record.plan.budget_bytes - record.plan.peak_bytes
    # within the budget, and above the plan's predicted peak by at most what the rule held (the
    # allocator rounds each block to 64 B)
    assert peak_on <= record.plan.budget_bytes
    assert peak_on <= record.compiled_peak_bound + 64 * 8
    # the same kernels: equal gradients (bit for bit but for the first compile of a process, whose
    # gradients differ from every later compile's of the same plan by ~4e-8, with or without reuse)
    assert grad_rel_diff(grads_on, grads_off) <= 1e-6


@pytest.mark.parametrize("per_block", [False, True])
def test_a_gradient_kept_as_grad_is_not_reused(per_block):
    """Compiled while ``.grad`` is allocated (the gradients are added in the graph), then run with
    ``.grad`` None: ``lynx::accumulate_grads`` keeps each gradient's buffer as ``.grad``, and no
    later kernel may be handed that buffer (Inductor's own rule overwrote them: wrong gradients,
    the reason buffer reuse was off in lynx's placements before ``buffer_reuse``)."""
    model, x = _gpt()
    model(x).loss.backward()
    ref = grad_snapshot(model)
    torch._dynamo.reset()
    model, x = _gpt()
    backend = lynx_compile.backend(memory_budget=0.75, plan_cache=False)
    if per_block:
        for block in transformer_blocks(model):
            block.compile(backend=backend)
        run = model
    else:
        run = torch.compile(model, backend=backend)
    with torch._inductor.config.patch(fx_graph_cache=False):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        run(x).loss.backward()
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            run(x).loss.backward()
    assert any(r.grads_in_graph is not None and r.grads_in_graph.applies for r in backend.records)
    assert grad_rel_diff(grad_snapshot(model), ref) <= 1e-4
