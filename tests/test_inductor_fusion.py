"""The horizontal fusions refused in lynx's placements (``_compat.inductor_fusion``): those of a
kernel lynx recomputes in the backward sharing less than 1 MiB of reads.

References: hand-built stand-ins of Inductor's scheduler nodes for the rule, Inductor's own
choices handler for what the rule leaves alone, and the CPU allocator's measured peak of a
compiled step against lynx's prediction for what it is for.
"""
from types import SimpleNamespace

import pytest
import torch

import lynx_compile
from lynx_compile import _compat
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.passes import meta


def _snode(*metas: dict):
    """A (fused) scheduler node lowered from FX nodes with these metas, one per sub-node."""
    subs = [SimpleNamespace(node=SimpleNamespace(origins=[SimpleNamespace(meta=m)])) for m in metas]
    return SimpleNamespace(get_nodes=lambda: subs)


REC0, REC1 = {meta.RECOMPUTED: True, meta.BLOCK: 0}, {meta.RECOMPUTED: True, meta.BLOCK: 1}
GRAD0, GRAD1, LOSS = {meta.BLOCK: 0}, {meta.BLOCK: 1}, {}


@pytest.mark.parametrize("left,right,refused", [
    ((REC0,), (REC1,), True),           # block 0's recomputed softmax with block 1's (the causal mask)
    ((REC1,), (GRAD1,), True),          # a recompute with its own block's gradient (HF Llama's MLP)
    ((GRAD0, REC0), (LOSS,), True),     # a fused node holding a recompute
    ((GRAD0,), (GRAD1,), False),        # no recompute: Inductor decides
    ((LOSS,), (GRAD1, GRAD0), False),
])
def test_refuses_only_fusions_with_a_recompute(left, right, refused):
    a, b = _snode(*left), _snode(*right)
    assert _compat.refuses_horizontal_fusion(a, b, 4096) is refused
    assert _compat.refuses_horizontal_fusion(b, a, 4096) is refused
    # sharing 1 MiB of reads, as lynx's memory model fuses (a SwiGLU backward's gate and up)
    assert _compat.refuses_horizontal_fusion(a, b, _compat.RECOMPUTE_FUSION_SHARED_BYTES) is False


def test_rule_is_installed_only_while_compiling():
    """Inside the wrapped compile the choices handler is lynx's (refusing a recompute's fusion);
    after the compile returns or raises, the previous handler is back."""
    from torch._inductor.virtualized import V

    before = V.choices
    seen = []

    def inner(fail: bool):
        seen.append(V.choices)
        if fail:
            raise RuntimeError("compile failed")
        return "compiled"

    wrapped = _compat.refusing_recompute_fusion(inner)
    assert wrapped(False) == "compiled"
    assert V.choices is before and seen[-1] is not before
    assert seen[-1].can_fuse_horizontal(None, _snode(REC0), _snode(REC1), 4096) is False
    with pytest.raises(RuntimeError):
        wrapped(True)
    assert V.choices is before


def _full_peak(batch: int) -> tuple[int, int]:
    """gpt-tiny under ``full`` compiled by Inductor: (measured step peak, lynx's prediction)."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    x = example_batch(model, batch)
    # gradients returned (as with several ranks): the regime the rule was made for. Added into
    # .grad in the graph (the one-process default), no-rule's step measured within the
    # tolerance (1685768 B against 1683712 B predicted, torch 2.13)
    backend = lynx_compile.backend(policy="full", compiler="inductor", plan_cache=False,
                                   accumulate_grad_in_graph=False)
    compiled = torch.compile(model, backend=backend)
    for p in model.parameters():  # the .grad regime measured below, from the compiling step on
        p.grad = torch.zeros_like(p)
    with torch._inductor.config.patch(fx_graph_cache=False):  # the rule is not in the cache key
        compiled(x).loss.backward()
    m = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=1, params=list(model.parameters()))
    return m.peak_bytes, backend.plans[-1].peak_bytes


@pytest.mark.parametrize("rule", [True, False], ids=["rule", "no-rule"])
def test_recompute_stays_where_the_partition_put_it(rule, monkeypatch):
    """gpt-tiny, batch 8, policy full: the case lynx's 1 MiB horizontal-fusion threshold was made
    for. Inductor's default fuses kernels sharing any read: each block's recomputed softmax with
    another block's (the causal mask is read by both) and recomputed kernels with gradient
    kernels, running a recompute where another block's activations are alive. Without the rule
    or the threshold the step measured 2149128 B against 1818624 B predicted (1.18x, torch 2.13);
    with the rule 1817608 B, as with the threshold. (Batch 1 no longer shows it: since the step's
    peak counts the parameter gradients, its peak is at the end of the backward.)"""
    if not rule:
        monkeypatch.setattr(_compat, "refusing_recompute_fusion", lambda inner_compile: inner_compile)
        assert "score_fusion_memory_threshold" not in _compat.INDUCTOR_KEEP_PLACEMENT
    measured, predicted = _full_peak(8)
    within = 0.99 * predicted <= measured <= 1.04 * predicted  # test_inductor's tolerance at batch 1
    assert within is rule, (measured, predicted)
