"""``runtime.weight_split``: a lynx-compiled backward cut into B (input gradients) and W (weight
gradients) gives eager's gradients, with the weights' left for W."""
import copy

import pytest
import torch


def _block_and_input():
    from lynx_compile.models.presets import build_model

    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    h = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return model.blocks[0], h


@pytest.mark.timeout(120)
@pytest.mark.parametrize("options", [{"policy": "full"}, {"policy": "full", "recompute_in_wait": True},
                                     {"policy": "none"}])
def test_deferred_weight_gradients_equal_eager(options):
    import lynx_compile
    from lynx_compile.runtime.prefetch import microbatch
    from lynx_compile.runtime.weight_split import defer_weights

    block, h = _block_and_input()
    ref, h_ref = copy.deepcopy(block), h.detach().clone().requires_grad_()
    ref(h_ref).square().mean().backward()
    # weight gradients returned: in one process lynx adds them into .grad inside the backward by
    # default where something is recomputed (the refusal below), a pipeline's ranks return them
    backend = lynx_compile.LynxBackend(lynx_compile.make_config(
        {"compiler": "eager", "accumulate_grad_in_graph": False, **options}))
    compiled = torch.compile(block, backend=backend)
    with microbatch(3):
        loss = compiled(h).square().mean()
    with microbatch(3), defer_weights(3):  # B: the input gradient only
        loss.backward()
    assert torch.allclose(h.grad, h_ref.grad, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in block.parameters())
    assert backend.runtimes.run_weights(3) == 1  # W
    assert backend.runtimes.run_weights(3) == 0  # once
    for p, r in zip(block.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
def test_defer_refused_where_the_backward_adds_the_weight_gradients():
    """Default options, policy full, one process: the backward adds the weight gradients into
    .grad itself; defer_weights around it raises naming the option, before anything runs."""
    import lynx_compile
    from lynx_compile.runtime.weight_split import defer_weights

    block, h = _block_and_input()
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"compiler": "eager", "policy": "full"}))
    loss = torch.compile(block, backend=backend)(h).square().mean()
    assert backend.records[-1].grads_in_graph.applies
    with defer_weights(3), pytest.raises(RuntimeError, match="accumulate_grad_in_graph=False"):
        loss.backward()
    assert h.grad is None and all(p.grad is None for p in block.parameters())


@pytest.mark.timeout(120)
def test_without_defer_the_backward_is_whole():
    import lynx_compile

    block, h = _block_and_input()
    backend = lynx_compile.LynxBackend(lynx_compile.make_config({"compiler": "eager", "policy": "full"}))
    torch.compile(block, backend=backend)(h).square().mean().backward()
    assert all(p.grad is not None for p in block.parameters())
    assert backend.runtimes.run_weights(0) == 0
