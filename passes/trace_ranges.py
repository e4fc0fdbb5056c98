"""Make recomputation visible in profiler traces (``LynxConfig.trace_recompute``).

Reads ``meta.RECOMPUTED`` and ``meta.DECISION`` on the final backward graph. Wraps every maximal
run of consecutive recomputed nodes in a ``torch.profiler`` range named
``lynx::recompute[<decision>]`` (``demand``, or ``window:<collective>`` for runs placed inside
that collective's window)::

    ar = all_reduce(g)
    h = profiler._record_function_enter_new("lynx::recompute[window:all_reduce_2]")
    x_recomputed = gelu(y)
    profiler._record_function_exit(h)
    wait_tensor(ar)

Runs at code generation, after planning and memory simulation, so the range handles never
appear in what the planner or the simulator saw. Without an active profiler the ranges cost a
few microseconds each; they are only added when asked for.
"""
from __future__ import annotations

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.decisions import Window

from . import meta

RANGE_PREFIX = "lynx::recompute"


def _role(node: fx.Node) -> str:
    decision = node.meta.get(meta.DECISION)
    return str(decision) if isinstance(decision, Window) else "demand"


def trace_ranges_pass(gm: fx.GraphModule, ctx=None) -> fx.GraphModule:
    """Insert enter/exit profiler ranges around runs of recomputed nodes (in place)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    runs: list[list[fx.Node]] = []
    for node in nodes:
        if not node.meta.get(meta.RECOMPUTED):
            continue
        prev = node.prev
        if runs and runs[-1][-1] is prev and _role(prev) == _role(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    enter, exit_ = _compat.record_function_ops()
    for run in runs:
        with gm.graph.inserting_before(run[0]):
            handle = gm.graph.call_function(enter, (f"{RANGE_PREFIX}[{_role(run[0])}]", None))
        with gm.graph.inserting_after(run[-1]):
            gm.graph.call_function(exit_, (handle,))
    gm.graph.lint()
    gm.recompile()
    return gm
