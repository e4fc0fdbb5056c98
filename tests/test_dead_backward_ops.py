"""The backward torch's partitioner hands lynx loses its dead ops, random ones included
(``recompute.apply.drop_dead_code``): torch's default partition of a tensor-parallel llama3
block compiled again with the step's plan (``compiler="eager"``) left a copy of the forward's
SDPA, unused, at the backward's start; FX's dead code pass keeps an op tagged
``nondeterministic_seeded`` (SDPA, dropout, rand), so its output was held by the backward and
raised the piece's no-recompute peak (issue S item 3)."""
from __future__ import annotations

import torch
import torch.fx as fx

from lynx_compile.recompute.apply import drop_dead_code

aten = torch.ops.aten


def _backward_like() -> fx.GraphModule:
    """x -> 2x, beside an unused SDPA, an unused dropout, an unused rand_like, and an in-place
    copy into an input (a side effect: kept)."""
    g = fx.Graph()
    x = g.placeholder("x")
    buf = g.placeholder("buf")
    q = g.call_function(aten.view.default, (x, [1, 1, 4, 2]))
    sdpa = g.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True))
    g.call_function(aten.native_dropout.default, (x, 0.5, True))
    g.call_function(aten.rand_like.default, (x,))
    g.call_function(aten.copy_.default, (buf, x))
    del sdpa
    y = g.call_function(aten.mul.Tensor, (x, 2))
    g.output((y,))
    return fx.GraphModule(torch.nn.Module(), g)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_fx_alone_keeps_the_dead_random_ops():
    gm = _backward_like()
    gm.graph.eliminate_dead_code()
    kept = _targets(gm)
    # the reason for lynx's own pass: FX counts a seeded-random op as impure
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in kept
    assert aten.rand_like.default in kept


def test_dead_ops_go_random_or_not_and_side_effects_stay():
    gm = _backward_like()
    x, buf = torch.randn(8), torch.zeros(8)
    assert drop_dead_code(gm)
    assert _targets(gm) == [aten.copy_.default, aten.mul.Tensor]
    (y,) = gm(x, buf)
    torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
    torch.testing.assert_close(buf, x, rtol=0, atol=0)  # the copy still ran
    assert not drop_dead_code(gm)  # nothing left to drop
