"""Accumulate parameter gradients into ``.grad`` inside the compiled backward (issue M, "the
gradient pile"; option ``accumulate_grad_in_graph``).

A model compiled whole has one compiled backward that returns every parameter gradient at its
end; autograd's ``AccumulateGrad`` adds each into ``.grad`` only after it returns, so the step's
peak holds all of them at once (4 bytes per parameter in fp32) on top of the activations still
alive. Eager PyTorch adds each into ``.grad`` as soon as it is computed.

With the option, before lynx partitions the joint graph each parameter's gradient output is
replaced by ``lynx::accumulate_grad(param, grad)``, an opaque op with a side effect placed right
after the gradient's producer: it adds the gradient into ``param.grad`` (or sets a copy when
``.grad`` is None), and the gradient dies there. The backward then returns None for that
parameter, so autograd's ``AccumulateGrad`` does not run for it. The parameter itself is saved
for the backward (an input: no memory); at run time it is the ``nn.Parameter`` object, read
back from autograd's saved tensors (a leaf is saved as itself).

What this changes, and where it cannot apply:

- ``AccumulateGrad`` hooks do not run for these parameters: ``register_post_accumulate_grad_hook``,
  DDP's reducer and FSDP's reduce-scatter all hang on it. lynx refuses the option when a
  parameter has such a hook, when it is a tensor subclass (FSDP2's DTensor), and when
  ``torch.distributed`` runs more than one rank (DDP registers its hooks in C++, where lynx
  cannot see them).
- ``torch.autograd.grad(loss, params)`` gets no gradient for these parameters (it raises
  "appears to not have been used in the graph", or returns None with ``allow_unused=True``)
  while ``.grad`` is still updated: use ``loss.backward()``.
- ``create_graph=True`` (double backward) is refused at run time.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from lynx_compile import _compat

OP_NAME = "lynx::accumulate_grad"


@torch.library.custom_op(OP_NAME, mutates_args=())
def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (``param.grad = copy of grad`` when it is None), as autograd's
    ``AccumulateGrad`` would once the backward returned."""
    if not (param.is_leaf and param.requires_grad):
        raise RuntimeError(
            "lynx accumulate_grad_in_graph: the compiled backward did not receive the parameter "
            "itself (a non-leaf or detached tensor), so it cannot add the gradient into its .grad; "
            "compile without accumulate_grad_in_graph")
    if getattr(param, "_post_accumulate_grad_hooks", None):
        raise RuntimeError("lynx accumulate_grad_in_graph: a parameter has a post-accumulate-grad hook "
                           "(registered after compiling), which would not run; compile without "
                           "accumulate_grad_in_graph")
    if torch.is_grad_enabled():
        raise RuntimeError("lynx accumulate_grad_in_graph: backward(create_graph=True) is not supported; "
                           "compile without accumulate_grad_in_graph")
    if param.grad is None:
        # a copy in the parameter's layout: the gradient's buffer belongs to the compiled graph,
        # which may reuse it once this op returns
        new = torch.empty_like(param)
        new.copy_(grad)
        param.grad = new
    else:
        param.grad.add_(grad)


@accumulate_grad.register_fake
def _(param: torch.Tensor, grad: torch.Tensor) -> None:
    return None


_compat.mark_side_effect(torch.ops.lynx.accumulate_grad.default)


def param_indices(joint: fx.GraphModule, num_fwd_outputs: int,
                  static_lifetime_input_indices: list[int] | None) -> list[int]:
    """Positions among the joint's primals of the parameters: inputs with a static lifetime
    (dynamo's parameters and buffers) that get a gradient."""
    out = joint.graph.find_nodes(op="output")[0]
    grads = list(out.args[0])[num_fwd_outputs:]
    static = set(static_lifetime_input_indices or ())
    return [i for i, g in enumerate(grads) if i in static and isinstance(g, fx.Node)]


def rewrite_joint(joint: fx.GraphModule, num_fwd_outputs: int, params: list[int]) -> int:
    """In place: each parameter gradient output of ``joint`` becomes None, and a
    ``lynx::accumulate_grad(primal, grad)`` node follows the gradient's producer. Returns how many
    gradients were moved into the graph."""
    graph = joint.graph
    primals = [n for n in graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    out = graph.find_nodes(op="output")[0]
    outputs = list(out.args[0])
    grads = outputs[num_fwd_outputs:]
    if len(grads) != len(primals):
        raise RuntimeError(f"lynx accumulate_grad_in_graph: {len(grads)} gradient outputs for "
                           f"{len(primals)} inputs; compile without accumulate_grad_in_graph")
    moved = 0
    for i in params:
        grad = grads[i]
        if not isinstance(grad, fx.Node) or grad.op == "placeholder":
            continue
        # after the grad's producer (a view of it: after the view)
        with graph.inserting_after(grad):
            acc = graph.call_function(torch.ops.lynx.accumulate_grad.default, (primals[i], grad))
        acc.meta["val"] = None
        for key in ("seq_nr", "fwd_nn_module_stack", "nn_module_stack", "stack_trace"):
            if key in grad.meta:
                acc.meta[key] = grad.meta[key]
        outputs[num_fwd_outputs + i] = None
        moved += 1
    out.args = (tuple(outputs) if isinstance(out.args[0], tuple) else outputs,)
    joint.recompile()
    return moved


def check_applicable(example_inputs: list) -> None:
    """Refuse the option where a hook on ``AccumulateGrad`` would be skipped (see the module
    docstring)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        raise _error("torch.distributed runs several ranks: DDP's and FSDP's gradient hooks hang on "
                     "AccumulateGrad, which does not run for gradients accumulated in the graph")
    for t in example_inputs:
        if not isinstance(t, torch.nn.Parameter) or not t.requires_grad:
            continue
        if type(t) is not torch.nn.Parameter and type(t.data) is not torch.Tensor:
            raise _error(f"a parameter is a tensor subclass ({type(t.data).__name__}, e.g. FSDP2's "
                         "DTensor)")
        if getattr(t, "_post_accumulate_grad_hooks", None):
            raise _error("a parameter has a post-accumulate-grad hook (register_post_accumulate_grad_hook), "
                         "which would not run")


def _error(why: str) -> Exception:
    from lynx_compile.errors import LynxOptionError

    return LynxOptionError(f"accumulate_grad_in_graph=True cannot apply: {why}; compile without it")


__all__ = ["accumulate_grad", "rewrite_joint", "param_indices", "check_applicable"]
