"""insert_recompute_pass on a hand-built backward: window units move after their collective.

The graph is what the partitioner made for a DTensor TP=2 Llama at selective's peak (under
Inductor): the causal mask's ``where`` is folded into both the softmax's ``amax`` (window of the
first all-reduce) and its ``sub`` (window of the second), so the one FX node carries the second
window's decision. It used to be moved into the first window with ``amax`` and then on into the
second, after ``amax``, which reads it ("window placement broke the graph order").
"""
import torch
import torch.fx as fx

from lynx_compile.config import make_config
from lynx_compile.decisions import Window
from lynx_compile.passes import GraphRecord, PassContext, meta
from lynx_compile.passes.insert_recompute import insert_recompute_pass

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _backward():
    g = fx.Graph()
    x, grad = g.placeholder("x"), g.placeholder("grad")
    ar1 = g.call_function(c10d.all_reduce.default, (grad, "sum", "0"), name="all_reduce_1")
    w1 = g.call_function(c10d.wait_tensor.default, (ar1,), name="wait_1")
    ar2 = g.call_function(c10d.all_reduce.default, (w1, "sum", "0"), name="all_reduce_2")
    w2 = g.call_function(c10d.wait_tensor.default, (ar2,), name="wait_2")
    # on demand, before first use (the partitioner's placement)
    where = g.call_function(aten.relu.default, (x,), name="where_recomputed")
    amax = g.call_function(aten.amax.default, (where, [-1], True), name="amax_recomputed")
    sub = g.call_function(aten.sub.Tensor, (where, amax), name="sub_recomputed")
    out = g.call_function(aten.mul.Tensor, (sub, w2), name="use")
    g.output((out,))
    for node, window in ((where, "all_reduce_2"), (amax, "all_reduce_1"), (sub, "all_reduce_2")):
        node.meta[meta.RECOMPUTED] = True
        node.meta[meta.DECISION] = Window(window)
    return fx.GraphModule({}, g)


def test_a_node_two_windows_read_runs_in_the_earlier_one():
    gm = _backward()
    ctx = PassContext(config=make_config({}), record=GraphRecord(graph_id=0, policy="lynx"), num_fwd_outputs=1)
    gm = insert_recompute_pass(gm, ctx)  # lints the graph: raised "used before it has been defined"
    order = [n.name for n in gm.graph.nodes]
    pos = {name: i for i, name in enumerate(order)}
    # amax and the where it reads run in all_reduce_1's window; sub in all_reduce_2's
    assert pos["all_reduce_1"] < pos["where_recomputed"] < pos["amax_recomputed"] < pos["wait_1"], order
    assert pos["all_reduce_2"] < pos["sub_recomputed"] < pos["wait_2"], order
    assert ctx.record.stats["recompute_nodes_in_windows"] == 3
