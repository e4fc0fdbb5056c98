"""The user's own checkpointing is kept (issue U item 1; ``passes/user_tags.py``).

A model whose blocks are wrapped in ``torch.utils.checkpoint`` (or given a selective
checkpointing policy) reaches lynx's partitioner with torch's checkpoint tags on its joint graph.
The reference is torch.compile with the same annotations (``backend="inductor"``), measured the
same way (the allocator-event peak of a step, ``.grad`` allocated before it):

- no budget: lynx's step is torch.compile's (the same peak at every step; gradients within
  Inductor's own error vs eager: lynx's partition is of its own CSE'd joint);
- a budget: never more memory than the annotations give (at or below torch.compile's peak), and
  what a SAC policy says MUST_SAVE is saved (the plan recomputes none of it);
- policy ``none``/``full``/... replace the tags, and the record says so.
"""
import functools
import re

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lynx_compile.config import make_config
from lynx_compile.decisions import BudgetError
from lynx_compile.compiler.dynamo_backend import LynxBackend, find_backend_error
from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import build_model, example_batch

from _steps import measured_steps

aten = torch.ops.aten


def _save_matmuls(ctx, func, *args, **kwargs):
    """A SAC policy: matmuls saved, everything else recomputed (torchtitan's selective AC kind)."""
    if func in (aten.mm.default, aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(torch.nn.Module):
    def __init__(self, block, sac):
        super().__init__()
        self.block, self.sac = block, sac

    def forward(self, x):
        if self.sac:
            return checkpoint(self.block, x, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))
        return checkpoint(self.block, x, use_reentrant=False)


def _model(sac=False, wrap=True):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0, n_layers=2)
    if wrap:
        model.blocks = torch.nn.ModuleList(Checkpointed(b, sac) for b in model.blocks)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def _steps(backend, sac=False, style="whole", steps=2, wrap=True):
    """(peak of each step, last step's gradients, lynx's backend or None). Per block, step 3 (the
    one lynx records) runs without a profiler of ours and is not measured."""
    torch._dynamo.reset()
    peaks, grads = measured_steps(_model(sac, wrap), backend, style, steps,
                                  unmeasured=() if style == "whole" else (3,))
    return peaks, grads, backend


def _eager_grads(sac):
    model = _model(sac)
    model(example_batch(model, 4, generator=torch.Generator().manual_seed(1))).loss.backward()
    return [p.grad for p in model.parameters()]


def _lynx(**options):
    return LynxBackend(make_config({"plan_cache": False, **options}))


@pytest.fixture(scope="module")
def inductor():
    return {sac: _steps("inductor", sac) for sac in (False, True)}


@pytest.mark.parametrize("sac", [False, True], ids=["checkpoint", "sac"])
def test_no_budget_is_torch_compiles_step(inductor, sac):
    peaks, grads, backend = _steps(_lynx(), sac)
    want_peaks, want_grads, _ = inductor[sac]
    # step 1 holds the first compile's allocations, which depend on Inductor's cache state (seen:
    # lynx 16 B above, 131-181 KB below after earlier tests warmed the cache, and Inductor's own
    # step 1 229 KB below its step 2): at or below torch.compile's step (its largest, +64 B)
    assert peaks[1:] == want_peaks[1:] and peaks[0] <= max(want_peaks) + 64, (peaks, want_peaks)
    # within Inductor's own error vs eager (measured 3.7e-09 against 6.0e-08), not bit for bit:
    # lynx partitions the joint after its own CSE, Inductor after its own (operation order)
    err = max((w - e).abs().max().item() for w, e in zip(want_grads, _eager_grads(sac)))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=err)
    (record,) = backend.records
    assert record.torch_partition
    tags = record.stats["user_tags"]
    assert tags["regions"] == 2 and tags["recompute"] > 0 and (tags["must_save"] > 0) == sac
    assert any("no budget given, so the graph is partitioned as torch.compile" in n for n in record.notes)


def test_budget_never_above_the_users_memory(inductor):
    """0.9 of the no-recompute step is more than the checkpointed blocks hold: the plan stays
    within the checkpointed step's memory, and recomputes less where that fits."""
    peaks, grads, backend = _steps(_lynx(memory_budget=0.9))
    want_peaks, want_grads, _ = inductor[False]
    for got, want in zip(peaks, want_peaks):
        assert got <= want, (peaks, want_peaks)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    (record,) = backend.records
    assert record.plan.peak_bytes <= record.stats["user_tags"]["peak_bytes"]


def test_sac_must_save_is_saved_under_a_budget(inductor):
    """A budget below what the SAC policy holds: lynx recomputes more, but none of the matmuls
    the policy says MUST_SAVE. Saving every one of them bounds the reach: an unreachable budget
    is refused naming a smallest budget, which is accepted when asked for."""
    backend = _lynx(memory_budget=0.3)
    with pytest.raises(Exception) as refused:
        _steps(backend, sac=True)
    error = find_backend_error(refused.value, BudgetError)
    assert isinstance(error, BudgetError), refused.value
    floor = float(re.search(r"Use memory_budget >= ([0-9.]+)", str(error)).group(1))
    peaks, grads, backend = _steps(_lynx(memory_budget=floor), sac=True)
    (record,) = backend.records
    must_save = set(record.stats["user_tags"]["must_save_names"])
    recomputed = {d.name for d in record.plan.recomputed}
    assert must_save and recomputed and not must_save & recomputed
    assert peaks[-1] <= inductor[True][0][-1]
    for g, w in zip(grads, inductor[True][1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_per_block_checkpointed_with_a_budget():
    """Blocks compiled apart (torchtitan's style), each checkpointed: steps 1-2 run the user's
    partition, the step's plan after it: every step at or below torch.compile's same step."""
    want, _, _ = _steps("inductor", style="per-block", steps=5)
    peaks, _, backend = _steps(_lynx(memory_budget=0.9), style="per-block", steps=5)
    want = [w for i, w in enumerate(want) if i != 2] if len(want) == 5 else want
    assert len(peaks) == len(want) == 4
    # step 1 against torch.compile's largest step: its own step 1 can hold less than its later
    # ones (seen: 745,852 B against 821,512 B, with lynx's step 1 at 821,496 B), as above
    assert peaks[0] <= max(want) + 64, (peaks, want)
    for got, ref in zip(peaks[1:], want[1:]):
        assert got <= ref, (peaks, want)
    assert backend.step_recorder.state == "done"


def test_per_block_checkpointed_gradients_with_grad_none():
    """``.grad`` None at each start (the step creates its gradients in the graph): the gradients
    of every step after the step's plan equal Inductor's (a reused buffer once became a .grad
    that a later kernel overwrote)."""
    def grads(backend):
        torch._dynamo.reset()
        model = _model()
        x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
        for block in model.blocks:
            block.compile(backend=backend)
        for _ in range(4):
            for p in model.parameters():
                p.grad = None
            model(x).loss.backward()
        return [p.grad for p in model.parameters()]

    for g, w in zip(grads(_lynx(memory_budget=0.9)), grads("inductor")):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_a_baseline_policy_replaces_the_tags_and_says_so():
    peaks, _, backend = _steps(_lynx(policy="none"))
    plain, _, _ = _steps("inductor", wrap=False)
    # no recompute: the checkpointing is gone, as asked (step 1: see test_no_budget_is_torch_compiles_step)
    assert peaks[1:] == plain[1:] and peaks[0] <= max(plain) + 64, (peaks, plain)
    assert any("replaced by policy 'none'" in n for n in backend.records[0].notes)


def test_hf_gradient_checkpointing_is_kept(monkeypatch):
    """A model lynx was not written for, with its own switch: HF Llama (2 layers) after
    ``gradient_checkpointing_enable(use_reentrant=False)``: with no budget lynx's step peaks where
    torch.compile's does on the same model (steps 2+; step 1 holds the compile), not where a step
    without checkpointing does, and the record names the user's regions."""
    from _reach import reach_model

    def steps(backend, checkpointing=True):
        torch._dynamo.reset()
        model, x = reach_model("hf-llama", monkeypatch)
        model.train()
        if checkpointing:
            model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        run = torch.compile(model, backend=backend)
        peaks = []
        for _ in range(2):
            for p in model.parameters():
                p.grad.zero_()
            peaks.append(cpu_peak_bytes(lambda: run(x).loss.backward()))
        return peaks, [p.grad.clone() for p in model.parameters()]

    backend = _lynx()
    peaks, grads = steps(backend)
    want, want_grads = steps("inductor")
    plain, _ = steps("inductor", checkpointing=False)
    assert peaks[1] == want[1] < plain[1], (peaks, want, plain)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    (record,) = backend.records
    assert record.stats["user_tags"]["regions"] == 2 and record.torch_partition
