"""lynx on torchtitan 0.3.0's own models (issue N item 1; issue M's torchtitan rows).

torchtitan's llama3, qwen3 and deepseek_v3 (MoE) ``debugmodel`` from their model registries,
SDPA in place of FlexAttention (no CPU backward) as torchtitan's graph_trainer tests do, float32
on the CPU, batch 2 x sequence 256 (``benchmarks/torchtitan_models.py``; every layer and width
of the registry's model). Compiled per block by torchtitan's own
``torchtitan.distributed.compile.apply_compile`` (``CompileConfig.backend`` = the backend object)
and whole (``torch.compile(model)``); the loss (torchtitan's ``CrossEntropyLoss``) compiled with the
same backend by torchtitan itself, as its trainer does.

Oracles, all independent of lynx: ``backend="inductor"``'s gradients (lynx with no budget must
give them bit for bit: same partition, same Inductor code); eager PyTorch's gradients (how far
Inductor itself is from them sets the tolerance of lynx at a budget); the measured peak of the
whole step of torch.compile's own model in the same compile style
(``lynx_compile.memory.measure_step``, the project's measure).
"""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import torchtitan_models as tt  # noqa: E402

from lynx_compile.compiler.dynamo_backend import LynxBackend  # noqa: E402
from lynx_compile.config import make_config  # noqa: E402
from lynx_compile.memory.measure import measure_step  # noqa: E402

_MISSING = tt.available()
# Each test compiles its model three times (Inductor, lynx without and with a budget) plus the
# re-planned pieces at step 3: minutes on 2 shared CPU cores, above the suite's 300 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]

BATCH, SEQ = 2, 256
# the registry's first blocks only (llama3 / qwen3 / deepseek debugmodels have 6 / 8 / 6): every
# kind of block is still there (deepseek: its dense block and an MoE block, two graphs per block
# compile), at about half the suite's time for these tests
LAYERS = {"tt-llama3": 3, "tt-qwen3": 3, "tt-deepseek": 3}
BUDGET = 0.7
ERR_MULTIPLE = 4.0  # lynx at a budget vs Inductor: within this multiple of Inductor's own error vs eager
MEASURE_SLACK = 1.02  # torch.compile's own step measures up to ~2-4% off lynx's model of it (docs/memory_budget.md)


@pytest.fixture(autouse=True)
def _torchtitan_dynamo_config(monkeypatch):
    """apply_compile sets two dynamo flags process-wide; undo them after each test."""
    for name in ("capture_scalar_outputs", "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))
    # One thread: Inductor's CPU code for the embedding's backward accumulates in parallel, so
    # with 2 threads two runs of backend="inductor" itself differ in the last bits (measured on
    # qwen3's tied embedding: 1.9e-9 of 0.06). Inductor reads the thread count when it compiles.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _lynx(budget):
    return LynxBackend(make_config({"memory_budget": budget, "plan_cache": False}))


def _steps(name, style, backend, n):
    """``n`` training steps (each from ``.grad = None``, as torchtitan's zero_grad); the model,
    the step and the last step's loss and gradients."""
    t0 = time.perf_counter()
    model, step = tt.step_fn(name, style, backend, BATCH, SEQ, layers=LAYERS[name])
    for _ in range(n):
        for p in model.parameters():
            p.grad = None
        loss = step()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    print(f"{name} {style} {backend}: {n} steps {time.perf_counter() - t0:.1f} s")
    return model, step, loss.detach(), grads


def _max_err(a, b):
    return {k: (a[k] - b[k]).abs().max().item() for k in a}


def _step_peak(model, step):
    return measure_step(step, repeats=1, warmup=0, params=list(model.parameters())).peak_bytes  # compiled already


def _check(name, style):
    """The whole check of one model and compile style."""
    _, _, loss_e, eager = _steps(name, style, None, 1)
    ref_model, ref_step, loss_i, ind = _steps(name, style, "inductor", 1)
    assert set(ind) == set(eager)

    # 1. no budget: torch.compile's own partition under Inductor, bit for bit
    none = _lynx(None)
    _, _, loss_n, got = _steps(name, style, none, 1)
    assert torch.equal(loss_n, loss_i)
    diff = [k for k in ind if not torch.equal(got[k], ind[k])]
    assert not diff, f"lynx (no budget) differs from inductor in {len(diff)} gradients, e.g. {diff[:3]}"
    assert none.plans

    # 2. at a budget: within a small multiple of Inductor's own error vs eager, per parameter
    backend = _lynx(BUDGET)
    # the loss is a graph of its own (torchtitan compiles it too): the model is compiled in
    # pieces in both styles, so step 2 is recorded and step 3 runs the pieces planned together
    model, step, loss_b, got = _steps(name, style, backend, 3)
    ind_err = _max_err(ind, eager)
    floor = 1e-6 * max(g.abs().max().item() for g in eager.values())  # exactly-equal parameters
    err = _max_err(got, ind)
    bad = {k: (err[k], ind_err[k]) for k in err if err[k] > ERR_MULTIPLE * max(ind_err[k], floor)}
    assert not bad, f"{len(bad)} gradients farther from inductor's than {ERR_MULTIPLE}x its error vs eager: " \
                    f"{dict(list(bad.items())[:3])}"
    assert abs(loss_b.item() - loss_i.item()) <= ERR_MULTIPLE * max(abs(loss_i.item() - loss_e.item()), 1e-6)
    plans = backend.plans
    assert plans
    assert backend.step_recorder.state == "done"
    assert all(p.budget_scope == "step" for p in plans)

    # 3. the budget holds on the measured whole step, against torch.compile's own in the same style
    lynx_peak = _step_peak(model, step)
    ref_peak = _step_peak(ref_model, ref_step)
    assert lynx_peak <= BUDGET * MEASURE_SLACK * ref_peak, (lynx_peak, ref_peak, lynx_peak / ref_peak)
    print(f"{name} {style}: inductor err {max(ind_err.values()):.3g}, lynx-inductor {max(err.values()):.3g}, "
          f"measured {lynx_peak / ref_peak:.3f}")
    return {"inductor_err": max(ind_err.values()), "lynx_err": max(err.values()), "frac": lynx_peak / ref_peak}


def test_llama3_per_block_apply_compile():
    """torchtitan's own per-block compile (apply_compile) with the lynx backend object."""
    _check("tt-llama3", "per-block")


def test_llama3_whole_model():
    _check("tt-llama3", "whole")


def test_qwen3_per_block_apply_compile():
    """qwen3 per block (GQA 16/8, q/k RMSNorm, head dim 128, tied embedding outside the blocks);
    qwen3 whole is measured in benchmarks/results/budget_torchtitan.md."""
    _check("tt-qwen3", "per-block")


def test_qwen3_whole_tied_embedding_without_a_budget_is_inductor_bit_for_bit():
    """Regression (lynx_compile/compiler/dynamo_backend.py): with no budget lynx ran its own post-grad passes
    under Inductor although its partition is torch's; ``split_late_addmm_pass`` split Inductor's
    ``addmm`` of the tied embedding / LM head weight's two gradients, and that gradient differed
    from backend="inductor"'s by one ulp (3.7e-9 of 0.06; two runs of "inductor" itself agree
    bit for bit on one thread). qwen3's first two registry layers keep the test short."""
    grads = []
    for backend in ("inductor", _lynx(None)):
        torch._dynamo.reset()
        model = tt.build("tt-qwen3", layers=2)
        tokens, labels = tt.batch(BATCH, SEQ)
        tt.loss(None)(tt.compiled(model, "whole", backend)(tokens), labels).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert model.tok_embeddings.weight is model.lm_head.weight
    diff = [k for k in grads[0] if not torch.equal(grads[0][k], grads[1][k])]
    assert not diff, diff


def test_deepseek_v3_moe_per_block_apply_compile():
    """MoE: token-choice top-3 routing (argsort, gather, grouped_mm over per-expert token
    counts, scatter_add), a dense and an MoE block (two graphs) under apply_compile."""
    _check("tt-deepseek", "per-block")
