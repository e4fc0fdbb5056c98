"""Option ``weight_split`` under Inductor: the backward compiled as two Inductor graphs, B (input
gradients) and W (weight gradients), as the zero-bubble pipeline schedules run them
(``lynx_compile.compiler.inductor_partition.WeightSplitCompile``, ``runtime.weight_split``). Reference: eager
PyTorch's gradients of the same model, fp32, dropout 0."""
import pytest
import torch

import lynx_compile
from lynx_compile import _compat
from lynx_compile.models import build_model, example_batch
from lynx_compile.runtime.weight_split import defer_weights


def _models(name):
    torch.manual_seed(0)
    model = build_model(name, dropout=0.0)
    ref = build_model(name, dropout=0.0)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _worst(model, ref):
    return max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
               for p, q in zip(model.parameters(), ref.parameters()))


# llama-tiny at 0.9: a fraction is of torch.compile's own step, parameter gradients included
# (issue M), of which it reaches 0.80 at batch 2
@pytest.mark.parametrize("name,options", [("gpt-tiny", {"policy": "full"}),
                                          ("llama-tiny", {"policy": "lynx", "memory_budget": 0.9, "solver": "heu"})])
def test_deferred_weight_gradients_equal_eager_under_inductor(name, options):
    model, ref = _models(name)
    x = example_batch(model, 2)
    backend = lynx_compile.backend(weight_split=True, **options)
    compiled = torch.compile(model, backend=backend)
    ref(x).loss.backward()

    with defer_weights("mb0"):
        compiled(x).loss.backward()
    # B ran: every parameter's gradient is a weight gradient, so none is there yet
    assert all(p.grad is None for p in model.parameters())
    deferral = next(d for d in backend.runtimes.weight_deferrals if "mb0" in d.pending)
    assert deferral.pending_bytes("mb0") > 0
    assert backend.runtimes.run_weights("mb0") == 1 and not deferral.pending
    assert _worst(model, ref) < 1e-5

    # outside defer_weights the same compiled pieces run B, then W at once
    model.zero_grad(set_to_none=True)
    compiled(x).loss.backward()
    assert _worst(model, ref) < 1e-5


def test_b_reuses_no_buffer_that_w_reads(monkeypatch):
    # AOTAutograd lets Inductor reuse some saved tensors' buffers in the backward once read
    # (donated); B must not, for the inputs it hands to W, and W reuses none
    seen = []
    compile_graph = _compat.inductor_compile_graph

    def spy(gm, example_inputs, donated=None, **kwargs):
        if kwargs.get("is_backward"):
            seen.append((gm, _compat.inductor_donated_inputs(), donated))
        return compile_graph(gm, example_inputs, donated=donated, **kwargs)

    monkeypatch.setattr(_compat, "inductor_compile_graph", spy)
    model, _ = _models("gpt-tiny")
    backend = lynx_compile.backend(policy="none", weight_split=True)
    torch.compile(model, backend=backend)(example_batch(model, 2)).loss.backward()
    (b, b_context, b_donated), (w, _, w_donated) = seen
    assert b_context, "no donated backward inputs: the case is not exercised"
    w_reads = {p.name.removesuffix("_carried") for p in w.graph.find_nodes(op="placeholder")}
    b_inputs = [p.name for p in b.graph.find_nodes(op="placeholder")]
    assert set(b_donated) <= set(b_context)
    assert not {b_inputs[i] for i in b_donated} & w_reads
    assert {b_inputs[i] for i in set(b_context) - set(b_donated)} <= w_reads
    assert w_donated == []


def test_weight_split_is_a_checked_option():
    with pytest.raises(ValueError, match="weight_split"):
        lynx_compile.backend(weight_split="yes")
    with pytest.raises(ValueError, match="choose one"):
        lynx_compile.backend(weight_split=True, side_stream=True, compiler="eager")
