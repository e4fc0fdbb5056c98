"""``alias_clones_pass`` (``compiler="eager"``): a layout-preserving clone in the functional
joint graph is its input, so the partition saves one storage where eager PyTorch saves one.

References: eager PyTorch's own saved tensors (``saved_tensors_hooks``) and its measured step
peak; hand-built FX graphs for what the pass leaves alone."""

import torch
import torch.fx as fx

import lynx_compile
from lynx_compile.config import make_config
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch
from lynx_compile.passes import GraphRecord, PassContext, alias_clones_pass

aten = torch.ops.aten


def _gpt():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", n_layers=4, seq_len=48, dropout=0.0)
    return model, example_batch(model, 3, generator=torch.Generator().manual_seed(1))


def test_eager_compiler_saves_what_eager_pytorch_saves():
    """gpt-tiny's attention calls ``F.dropout(p=0.0)``, traced as a clone of the probabilities
    that the batched matmul saves: without the pass the partition saved 3,404,140 B against
    eager's 2,969,836 B and measured 16% above eager's step."""
    model, x = _gpt()
    store = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        store[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    eager_saved = sum(v for k, v in store.items() if k not in params)
    eager_peak = measure_step(lambda: model(x).loss.backward(), repeats=1, warmup=1,
                              params=list(model.parameters())).peak_bytes
    model, x = _gpt()
    backend = lynx_compile.backend(policy="none", compiler="eager")
    compiled = torch.compile(model, backend=backend)
    torch._dynamo.reset()
    peak = measure_step(lambda: compiled(x).loss.backward(), repeats=1, warmup=1,
                        params=list(model.parameters())).peak_bytes
    plan = backend.plans[-1]
    assert plan.saved_bytes <= eager_saved, (plan.saved_bytes, eager_saved)
    assert peak <= 1.03 * eager_peak, (peak, eager_peak)
    assert abs(peak - plan.peak_bytes) <= 64


def _ctx(compiler):
    return PassContext(config=make_config({"compiler": compiler}), record=GraphRecord(graph_id=0, policy="none"),
                       num_fwd_outputs=1, joint_inputs=None, forward_names=frozenset())


def _graph():
    """x -> relu -> clone (same layout) -> neg;  relu -> clone(channels_last-like: transposed
    strides) -> sin; relu -> clone -> output."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(4, 6)
    r = g.call_function(aten.relu.default, (x,))
    r.meta["val"] = torch.randn(4, 6)
    same = g.call_function(aten.clone.default, (r,))
    same.meta["val"] = torch.randn(4, 6)
    other = g.call_function(aten.clone.default, (r,))
    other.meta["val"] = torch.randn(6, 4).t()  # other strides: a real relayout
    out_clone = g.call_function(aten.clone.default, (r,))
    out_clone.meta["val"] = torch.randn(4, 6)
    of_input = g.call_function(aten.clone.default, (x,))
    of_input.meta["val"] = torch.randn(4, 6)
    a = g.call_function(aten.neg.default, (same,))
    b = g.call_function(aten.sin.default, (other,))
    c = g.call_function(aten.cos.default, (of_input,))
    g.output((a, b, c, out_clone))
    return fx.GraphModule({}, g)


def test_only_layout_preserving_clones_of_computed_values_that_are_no_output_go():
    gm = alias_clones_pass(_graph(), _ctx("eager"))
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 3  # the relayout, the graph output, the clone of a graph input stay
    neg = next(n for n in gm.graph.nodes if n.target is aten.neg.default)
    assert neg.args[0].target is aten.relu.default
    x = torch.randn(4, 6)
    want = _graph()(x)
    for got, ref in zip(gm(x), want):
        torch.testing.assert_close(got, ref)


def test_inductor_graphs_are_left_alone():
    gm = alias_clones_pass(_graph(), _ctx("inductor"))
    assert sum(n.target is aten.clone.default for n in gm.graph.nodes) == 4
