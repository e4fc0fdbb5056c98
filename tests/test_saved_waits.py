"""A saved ``_c10d_functional.wait_tensor`` of a graph input is saved as the input itself
(``_compat.inputs_saved_for_their_waits``): ``wait_tensor`` returns its argument's storage, and
AOTAutograd donates saved values that are not forward inputs to the backward, where Inductor may
write over them. The end-to-end case (deepseek_v3 under TP, gradients equal to Inductor's) is in
``tests/test_torchtitan_trainer.py``; this is the rewrite on a hand-built forward graph."""
from __future__ import annotations

import torch
import torch.fx as fx

from lynx_compile._compat.partitioner import inputs_saved_for_their_waits

WAIT = torch.ops._c10d_functional.wait_tensor.default


def _forward() -> tuple[fx.GraphModule, dict[str, fx.Node]]:
    """x (an input: a collective's unwaited result), c (a computed value) -> returns y; saves
    wait(x), wait(c), x."""
    g = fx.Graph()
    x = g.placeholder("x")
    waited = g.call_function(WAIT, (x,))
    y = g.call_function(torch.ops.aten.mul.Tensor, (waited, 2.0))
    c = g.call_function(torch.ops.aten.add.Tensor, (y, 1.0))
    waited_c = g.call_function(WAIT, (c,))
    g.output((y, waited, waited_c, x))
    return fx.GraphModule(torch.nn.Module(), g), {"x": x, "waited": waited, "waited_c": waited_c, "y": y}


def test_a_saved_wait_of_an_input_is_saved_as_the_input():
    fw, n = _forward()
    assert inputs_saved_for_their_waits(fw, num_fwd_outputs=1)
    outs = fw.graph.output_node().args[0]
    assert list(outs) == [n["y"], n["x"], n["waited_c"], n["x"]]  # the computed value's wait is left
    x = torch.randn(3)
    assert all(torch.equal(a, b) for a, b in zip(fw(x), (x * 2, x, x * 2 + 1, x)))
    assert not inputs_saved_for_their_waits(fw, num_fwd_outputs=1)  # nothing left to rewrite


def test_a_wait_returned_to_the_user_is_left():
    """Only saved values (after the forward's own outputs) are rewritten."""
    fw, n = _forward()
    assert not inputs_saved_for_their_waits(fw, num_fwd_outputs=2)
    assert list(fw.graph.output_node().args[0]) == [n["y"], n["waited"], n["waited_c"], n["x"]]
