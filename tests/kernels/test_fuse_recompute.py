"""``fuse_recompute_pass`` under the Triton interpreter: lynx compiles GPT with full recompute and
fused kernels; loss and gradients equal eager, and the recompute chains were replaced."""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile.models.presets import build_model, example_batch


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_fused_recompute_keeps_gradients_equal_to_eager(policy):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    ref = copy.deepcopy(model)
    idx = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"policy": policy, "fuse_kernels": True, "compiler": "eager"}))
    loss = torch.compile(model, backend=backend)(idx).loss
    loss.backward()
    want = ref(idx).loss
    want.backward()
    torch.testing.assert_close(loss, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=name)
    fused = backend.records[0].stats["fused_recompute"]
    assert fused["causal_softmax"] == model.config.n_layers  # one attention softmax per block
    if policy == "full" and hasattr(torch.ops.lynx, "layer_norm"):
        assert fused["layer_norm"] >= 2 * model.config.n_layers


def test_fusion_off_leaves_the_graph_alone():
    model = build_model("gpt-tiny", dropout=0.0)
    idx = example_batch(model, 2)
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"policy": "full", "fuse_kernels": False, "compiler": "eager"}))
    torch.compile(model, backend=backend)(idx).loss.backward()
    assert "fused_recompute" not in backend.records[0].stats


def test_fused_recompute_on_the_side_stream_keeps_gradients_equal_to_eager():
    """The fused kernels run inside the side-stream segments (inline on CPU)."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    ref = copy.deepcopy(model)
    idx = example_batch(model, 2, generator=torch.Generator().manual_seed(1))
    backend = lynx_compile.LynxBackend(lynx_compile.make_config(
        {"policy": "full", "fuse_kernels": True, "side_stream": True, "side_stream_extra_bytes": 1 << 30}))
    torch.compile(model, backend=backend)(idx).loss.backward()
    ref(idx).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=2e-5, rtol=1e-4, msg=name)
    side_ops = {str(n.target) for s in backend.runtimes.side_stream_runners[0].steps if s.kind == "side"
                for n in s.piece.graph.nodes if n.op == "call_function"}
    assert "lynx.causal_softmax.default" in side_ops
