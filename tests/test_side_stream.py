"""Side-stream recompute (``passes/side_stream.py``, ``lynx_compile/runtime/side_stream_runner.py``):
markers in the graph, pieces run in order, gradients equal eager, memory as planned."""
import copy
import glob
import operator

import pytest
import torch
import torch.fx as fx

import lynx_compile
from lynx_compile.models.presets import build_model, example_batch
from lynx_compile.passes import GraphRecord, PassContext, meta
from lynx_compile.passes.side_stream import side_stream_pass
from lynx_compile.runtime import stream_ops
from lynx_compile.runtime.side_stream_runner import InlineStreams, SideStreamRunner, split_at_markers

aten = torch.ops.aten


def _compile_and_step(policy, dropout=0.1, **options):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=dropout)
    ref = copy.deepcopy(model)
    idx = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"policy": policy, "compiler": "eager", **options}))
    torch.manual_seed(5)
    loss = torch.compile(model, backend=backend)(idx).loss
    loss.backward()
    torch.manual_seed(5)
    want = ref(idx).loss
    want.backward()
    return model, ref, loss, want, backend


@pytest.mark.parametrize("policy,options", [("full", {}), ("selective", {}), ("lynx", {"memory_budget": 0.8}),
                                            ("full", {"side_stream_extra_bytes": 1 << 30})])
def test_side_stream_keeps_loss_and_gradients_equal_to_eager(policy, options):
    model, ref, loss, want, backend = _compile_and_step(policy, side_stream=True, **options)
    torch.testing.assert_close(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    runner = backend.runtimes.side_stream_runners[0]
    decided = backend.records[0].stats["side_stream"]
    assert runner.num_segments == decided["segments"] > 0
    if policy == "full":  # one recompute segment per block
        assert decided["segments"] == model.config.n_layers
    # every segment: begin, end, then wait, in that order, each once
    log = runner.streams.log
    for k in range(runner.num_segments):
        assert [a for a, j in log if j == k] == ["begin", "end", "wait"]
        assert log.index(("begin", k)) < log.index(("end", k)) < log.index(("wait", k))


def test_side_pieces_hold_only_recompute_and_launch_one_segment_ahead():
    *_, backend = _compile_and_step("full", side_stream=True, side_stream_extra_bytes=1 << 30)
    runner = backend.runtimes.side_stream_runners[0]
    for step in runner.steps:
        if step.kind == "side":
            ops = [n for n in step.piece.graph.nodes if n.op == "call_function"]
            assert ops and all(n.name.endswith("_recomputed") or "rng" in str(n.target)
                               or n.target is operator.getitem for n in ops)
    decided = backend.records[0].stats["side_stream"]
    assert decided["not_launched_early"] == 0 and decided["main_nodes_overlapped"] > 0
    kinds = [s.kind for s in runner.steps]
    # with room to spare, main-stream work sits between each segment's end and its wait
    for k in range(runner.num_segments):
        end = next(i for i, s in enumerate(runner.steps) if s.kind == "end" and s.segment == k)
        wait = next(i for i, s in enumerate(runner.steps) if s.kind == "wait" and s.segment == k)
        assert "main" in kinds[end + 1:wait]


def test_launching_early_within_zero_extra_bytes_keeps_the_planned_peak():
    *_, off = _compile_and_step("full", side_stream=False)
    *_, on = _compile_and_step("full", side_stream=True)
    *_, ahead = _compile_and_step("full", side_stream=True, side_stream_extra_bytes=1 << 30)
    peak = off.records[0].plan.peak_bytes
    assert on.records[0].plan.peak_bytes == peak
    assert ahead.records[0].plan.peak_bytes > peak  # full overlap holds a segment's outputs longer


def test_markers_are_visible_in_the_dumped_graph(tmp_path):
    _compile_and_step("selective", side_stream=True, dump_dir=str(tmp_path))
    after = glob.glob(str(tmp_path / "graph_*" / "backward_*_side_stream_pass_after.txt"))
    text = open(after[0]).read()
    for op in ("side_stream_begin", "side_stream_end", "side_stream_wait"):
        assert f"torch.ops.lynx.{op}.default" in text


def _hand_graph():
    """x (saved), g (tangent): r = sin(x) * 2 recomputed; m = g + 1 main; out = m * r, g * 3."""
    g = fx.Graph()
    x, t = g.placeholder("x"), g.placeholder("tangents_1")
    def op(target, args, name):
        return g.create_node("call_function", target, args, name=name)

    m = op(aten.add.Tensor, (t, 1), "m")
    m2 = op(aten.mul.Tensor, (t, 3), "m2")
    r1 = op(aten.sin.default, (x,), "r1")
    r2 = op(aten.mul.Tensor, (r1, 2), "r2")
    out = op(aten.mul.Tensor, (m, r2), "out")
    g.output((out, m2))
    for n in (r1, r2):
        n.meta[meta.RECOMPUTED] = True
    gm = fx.GraphModule({}, g)
    inputs = [torch.randn(4, 8), torch.randn(4, 8)]
    env = dict(zip(("x", "tangents_1"), inputs))
    for n in gm.graph.nodes:  # real values as meta["val"] for the memory simulation
        if n.op == "placeholder":
            n.meta["val"] = env[n.name]
        elif n.op == "call_function":
            n.meta["val"] = n.target(*fx.node.map_arg(n.args, lambda a: a.meta["val"]))
    return gm, inputs


def test_pass_brackets_a_hand_built_segment_and_launches_it_first():
    gm, inputs = _hand_graph()
    want = gm(*inputs)
    ctx = PassContext(config=lynx_compile.make_config({"side_stream": True, "side_stream_extra_bytes": 1 << 20}),
                      record=GraphRecord(graph_id=0, policy="full"), num_fwd_outputs=0)
    gm = side_stream_pass(gm, ctx)
    gm.recompile()
    names = [n.target if n.target in stream_ops.MARKERS else n.name for n in gm.graph.nodes]
    # the segment reads only a graph input: it is launched before any main-stream op
    assert names == ["x", "tangents_1", stream_ops.BEGIN, "r1", "r2", stream_ops.END, "m", "m2",
                     stream_ops.WAIT, "out", "output"]
    torch.testing.assert_close(gm(*inputs), want)  # markers are no-ops when the graph runs as is
    steps = split_at_markers(gm)
    assert [s.kind for s in steps] == ["begin", "side", "end", "main", "wait", "main"]
    assert steps[1].reads == ("x",) and steps[1].writes == ("r2",)
    runner = SideStreamRunner(gm, lambda piece: lambda args: piece(*args), InlineStreams())
    torch.testing.assert_close(runner(list(inputs)), want)
    assert runner.streams.log == [("begin", 0), ("end", 0), ("wait", 0)]
    assert ctx.record.stats["side_stream"]["main_nodes_overlapped"] == 2


def test_runner_drops_values_after_their_last_piece():
    gm, inputs = _hand_graph()
    ctx = PassContext(config=lynx_compile.make_config({"side_stream": True, "side_stream_extra_bytes": 1 << 20}),
                      record=GraphRecord(graph_id=0, policy="full"), num_fwd_outputs=0)
    gm = side_stream_pass(gm, ctx)
    runner = SideStreamRunner(gm, lambda piece: lambda args: piece(*args), InlineStreams())
    dropped = {name for s in runner.steps for name in s.drop}
    assert {"x", "r2", "m"} <= dropped  # x after the segment; r2 and m after their last use
    assert "out" not in dropped and "m2" not in dropped  # graph outputs are returned


@pytest.mark.parametrize("options,match", [
    ({"side_stream": True, "compiler": "inductor"}, "compiler='eager'"),
    ({"side_stream": True, "recompute_in_wait": True}, "choose one"),
    ({"side_stream_extra_bytes": -1}, ">= 0"),
])
def test_bad_side_stream_options_name_the_fix(options, match):
    with pytest.raises(ValueError, match=match):
        lynx_compile.make_config(options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_gradients_equal_eager():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0).cuda()
    ref = copy.deepcopy(model)
    idx = example_batch(model, 2).cuda()
    backend = lynx_compile.LynxBackend(lynx_compile.make_config(
        {"policy": "full", "side_stream": True, "side_stream_extra_bytes": 1 << 30}))
    torch.compile(model, backend=backend)(idx).loss.backward()
    ref(idx).loss.backward()
    from lynx_compile.runtime.side_stream_runner import CudaStreams

    assert isinstance(backend.runtimes.side_stream_runners[0].streams, CudaStreams)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
