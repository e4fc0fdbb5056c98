"""Parameter gradients added into ``.grad`` inside the compiled backward, where each is computed
(issue M's "gradient pile", on by default since issue Q; option ``accumulate_grad_in_graph``).

A model compiled whole has one compiled backward. Left to AOTAutograd, it returns every
parameter gradient at its end; autograd's ``AccumulateGrad`` adds each into ``.grad`` only after
it returns, so the step's peak holds all of them at once (4 bytes per parameter in fp32) on top
of the activations still alive. Eager PyTorch adds each into ``.grad`` as soon as it is computed.

lynx does what eager does. Before it partitions the joint graph, each parameter's gradient
output is replaced by ``lynx::accumulate_grad(param, grad)``, an opaque op with a side effect
placed right after the gradient's producer, and the backward returns None for that parameter,
so autograd's ``AccumulateGrad`` does not run for it. The op does at run time what
``AccumulateGrad`` would have done (the parameter itself is saved for the backward: an input,
no memory; a leaf is saved as itself):

- the gradient is added into ``param.grad``, or a copy becomes ``.grad`` when it is None (the
  gradient's buffer belongs to the compiled graph, which may reuse it once the op returns);
- post-accumulate-grad hooks (``register_post_accumulate_grad_hook``) still run: autograd's
  engine runs the parameter's ``AccumulateGrad`` with no gradient once the backward returns, and
  its post hooks with it (after ``.grad`` is complete, at the backward's end rather than where
  the gradient was computed);
- tensor hooks (``register_hook``) would be called by the engine with None: a graph whose
  parameter has one when it compiles keeps its gradients returned, and one registered after
  compiling is an error naming the fix;
- nothing happens where the engine would not accumulate into this parameter
  (``loss.backward(inputs=[...])`` without it); ``torch.autograd.grad(loss, params)``, which
  asks for the gradient itself, and ``create_graph=True`` raise one error naming the fix
  (``accumulate_grad_in_graph=False``).

Several ranks: DDP's reducer hangs its hook on each parameter's ``AccumulateGrad`` and reads
``.grad`` there; the engine still runs that node once the compiled backward returns (with no
gradient), so the hook finds ``.grad`` complete and all-reduces it (``tests/test_ddp.py``:
compiled DDP split into buckets, gradients equal Inductor's, ``gradient_as_bucket_view`` too).
FSDP2 reads the unsharded parameters' ``.grad`` in its post-backward (``tests/test_fsdp2.py``).
dynamo's DDPOptimizer compiles each bucket's graph on fake parameters: the ``AccumulateGrad``
nodes are taken from the real ones at the graph's first call (:func:`remembering`). A Python
hook registered on the node itself (``grad_fn.next_functions``'s ``register_hook``) receives
None as the gradient: read ``.grad`` there, or compile with ``False``.

When :func:`decide` keeps the gradients returned (``accumulate_grad_in_graph=None``, the
default, where eager's ``.grad`` cannot be promised; ``True`` refuses there instead): a
tensor-subclass parameter (FSDP2's DTensor compiled whole, TP's DTensor), a tensor hook,
``weight_split`` (the weight gradients belong to the deferred W graph). By default also where
nothing is recomputed (policy ``none`` or ``torch``, ``lynx`` with no budget): the step is then
torch.compile's, bit for bit (a tied weight's two gradients are summed in another order once the
sum feeds the op), and its peak is at the backward's start, where the pile has not formed. The record says which
(``GraphRecord.grads_in_graph``).

Memory: the graph's memory model frees each gradient after its op. Where a parameter's ``.grad``
is None when the graph compiles (``zero_grad()``'s default, the first step), the step allocates
``.grad`` there and keeps it: the op's node carries those bytes (``GRAD_BYTES``), which the
simulation keeps to the graph's end. Where ``.grad`` is allocated at the step's start, the
gradient dies at the op and the pile is gone.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx as fx

from torch.utils.weak import WeakIdKeyDictionary

from lynx_compile import _compat
from lynx_compile.memory.storage import GRAD_BYTES, KEEPS_GRAD, aliased_input

OP_NAME = "lynx::accumulate_grad"
_FIX = "compile with options={'accumulate_grad_in_graph': False} to have the backward return them"


_LIB = torch.library.Library("lynx", "FRAGMENT")
_LIB.define("accumulate_grad(Tensor param, Tensor grad, bool keep) -> ()")


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor, keep: bool) -> None:
    """What autograd's ``AccumulateGrad`` does for ``param`` once the backward returned, done here:
    ``param.grad += grad``; where ``.grad`` is None, ``grad`` itself becomes ``.grad`` when
    ``keep`` (nothing in the graph reads or reuses its buffer after this op) and it has the
    parameter's layout, else a copy; nothing where the engine would not accumulate into ``param``."""
    if not (param.is_leaf and param.requires_grad):
        raise RuntimeError("lynx: the compiled backward did not receive the parameter itself (a non-leaf "
                           f"or detached tensor), so it cannot add the gradient into its .grad; {_FIX}")
    if torch.is_grad_enabled():
        raise RuntimeError(f"lynx: backward(create_graph=True) is not supported where lynx adds parameter "
                           f"gradients into .grad inside the compiled backward; {_FIX}")
    if param._backward_hooks:
        raise RuntimeError("lynx: a parameter got a tensor hook (register_hook) after lynx compiled its graph "
                           "to add its gradient into .grad inside the backward; register the hook before the "
                           f"first compiled call (lynx then returns that graph's gradients), or {_FIX}")
    if not _engine_accumulates(param):
        return
    if param.grad is not None:
        param.grad.add_(grad)
    elif keep and _has_layout_of(grad, param):
        param.grad = grad  # autograd's AccumulateGrad steals it alike
    else:
        new = torch.empty_like(param)
        new.copy_(grad)
        param.grad = new


def _has_layout_of(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """``grad`` owns a storage of exactly its own bytes, laid out as ``param``: no view of a
    larger buffer kept alive as ``.grad``."""
    return (grad._base is None and grad.dtype == param.dtype and grad.device == param.device
            and grad.stride() == param.stride() and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == param.untyped_storage().nbytes())


def _engine_accumulates(param: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``param.grad`` (every ``.backward()``; not
    ``backward(inputs=...)`` without it). ``torch.autograd.grad`` asking for ``param`` is an error:
    the gradient is not returned."""
    node = _ACCUMULATORS.get(param)
    if node is None or torch._C._current_graph_task_id() == -1:  # not in autograd's engine
        return True
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError as e:  # the engine captures this leaf's gradient: torch.autograd.grad
        raise RuntimeError("lynx: torch.autograd.grad(..., inputs=<parameters>) asks for parameter gradients "
                           "that lynx adds into .grad inside the compiled backward; use loss.backward() and "
                           f"read .grad, or {_FIX}") from e


#: parameter -> its ``AccumulateGrad`` node, taken when a graph compiles (inside the op, run below
#: autograd, the node cannot be reached); held here, so it stays the one the engine runs
_ACCUMULATORS = WeakIdKeyDictionary()


def _remember_accumulators(params: list[torch.Tensor]) -> None:
    with torch.enable_grad():
        for p in params:
            if isinstance(p, torch.Tensor) and not _compat.is_plain_fake(p) and p not in _ACCUMULATORS:
                _ACCUMULATORS[p] = torch.autograd.graph.get_gradient_edge(p).node


# A plain library kernel, not ``torch.library.custom_op``: the op runs once per parameter per
# step on the host, and custom_op's Python wrappers (its autograd layer among them) cost ~10 us a
# call against ~3 us here (CPU, torch 2.13): gpt-tiny's 52 parameters took 1 ms of a 7 ms backward.
_LIB.impl("accumulate_grad", accumulate_grad, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _(param: torch.Tensor, grad: torch.Tensor, keep: bool) -> None:
    return None


_compat.mark_side_effect(torch.ops.lynx.accumulate_grad.default)


class GradsInGraph(NamedTuple):
    """Where one graph's parameter gradients go (:func:`decide`)."""

    applies: bool
    """Added into ``.grad`` inside the backward; False: returned at its end (the pile)."""
    new_grads: bool
    """A parameter's ``.grad`` was None when the graph compiled: the step allocates ``.grad``
    where each gradient is added, and keeps it (counted by the memory model)."""
    why: str
    """Why the gradients are returned (empty where they are added)."""


def decide(config, example_inputs: list) -> GradsInGraph:
    """Where the parameter gradients of a graph compiled with ``example_inputs`` under ``config``
    (a ``LynxConfig``) go. ``accumulate_grad_in_graph``: None (the default) adds them in the graph
    wherever eager's ``.grad`` is kept and something may be recomputed; True the same, refused with
    ``LynxOptionError`` where it cannot be kept; False returns them."""
    setting = config.accumulate_grad_in_graph
    if setting is False:
        return GradsInGraph(False, False, "accumulate_grad_in_graph=False")
    why = _why_returned(config.weight_split, example_inputs)
    if why and setting:
        raise _error(why)
    if not why and setting is None and _recomputes_nothing(config):
        why = ("no recompute of lynx's (no budget): the step is torch.compile's (with the model's own "
               "checkpointing, if any), gradients returned as it returns them")
    if why:
        return GradsInGraph(False, False, why)
    params = [t for t in example_inputs if isinstance(t, torch.nn.Parameter) and t.requires_grad]
    _remember_accumulators([p for p in params if not _compat.is_plain_fake(p)])
    return GradsInGraph(True, any(p.grad is None for p in params), "")


def remembering(compiled, example_inputs: list):
    """``compiled`` (the graph compiled for ``example_inputs``), taking at each call the
    ``AccumulateGrad`` node of each parameter it receives as a fake one at compile time
    (dynamo's DDPOptimizer compiles each bucket's graph on fake parameters; the real ones
    arrive at the call). The op needs the node to follow the engine: ``backward(inputs=...)``,
    ``torch.autograd.grad``. ``compiled`` itself where every parameter was real."""
    at = [i for i, t in enumerate(example_inputs)
          if isinstance(t, torch.nn.Parameter) and t.requires_grad and _compat.is_plain_fake(t)]
    if not at:
        return compiled
    seen: list = []

    def run(*args):  # (dynamo calls what a backend returns unboxed)
        if len(seen) != len(at) or any(args[i] is not s for i, s in zip(at, seen)):
            seen[:] = [args[i] for i in at]
            _remember_accumulators(seen)
        return compiled(*args)

    return run


def _recomputes_nothing(config) -> bool:
    """Policy ``none``, ``torch`` (torch's own partition, for comparison), or ``lynx`` with no
    budget: the pile is torch.compile's, and the peak is at the backward's start, not at it."""
    no_budget = config.memory_budget is None and config.device_budget is None
    return config.policy in ("none", "torch") or (config.policy == "lynx" and no_budget)


def _why_returned(weight_split: bool, example_inputs: list) -> str:
    if weight_split:
        return "weight_split=True defers the weight gradients to the W graph"
    for t in example_inputs:
        if not (isinstance(t, torch.nn.Parameter) and t.requires_grad):
            continue
        plain = (type(t) is torch.nn.Parameter and type(t.data) is torch.Tensor) or _compat.is_plain_fake(t)
        if not plain:
            return f"a parameter is a tensor subclass ({type(t.data).__name__}, e.g. FSDP2's DTensor)"
        if t._backward_hooks:
            return ("a parameter has a tensor hook (register_hook), which autograd calls where the gradient "
                    "is returned")
    return ""


def param_indices(joint: fx.GraphModule, num_fwd_outputs: int,
                  static_lifetime_input_indices: list[int] | None) -> list[int]:
    """Positions among the joint's primals of the parameters: inputs with a static lifetime
    (dynamo's parameters and buffers) that get a gradient."""
    out = joint.graph.find_nodes(op="output")[0]
    grads = list(out.args[0])[num_fwd_outputs:]
    static = set(static_lifetime_input_indices or ())
    return [i for i, g in enumerate(grads) if i in static and isinstance(g, fx.Node)]


def rewrite_joint(joint: fx.GraphModule, num_fwd_outputs: int, params: list[int], *, new_grads: bool,
                  may_keep: bool) -> int:
    """In place: each parameter gradient output of ``joint`` becomes None, and a
    ``lynx::accumulate_grad(primal, grad, keep)`` node follows the gradient's producer. ``keep``:
    the op is the gradient's only reader and ``may_keep`` (the compiler frees buffers after their
    last reader and reuses none: ``compiler="eager"``, or Inductor under lynx's settings), so a
    ``.grad`` that is None can take the gradient's buffer as autograd would. With ``new_grads``
    (``.grad`` None at compile) the node carries what the memory model keeps to the graph's end:
    the gradient's own storage (``KEEPS_GRAD``) or the copy's bytes (``GRAD_BYTES``). Returns how
    many gradients were moved into the graph."""
    graph = joint.graph
    primals = [n for n in graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    out = graph.find_nodes(op="output")[0]
    outputs = list(out.args[0])
    grads = outputs[num_fwd_outputs:]
    if len(grads) != len(primals):
        raise RuntimeError(f"lynx: {len(grads)} gradient outputs for {len(primals)} inputs in the joint graph; "
                           f"{_FIX}")
    moved = 0
    for i in params:
        grad = grads[i]
        if not isinstance(grad, fx.Node) or grad.op == "placeholder":
            continue
        outputs[num_fwd_outputs + i] = None
        out.args = (tuple(outputs) if isinstance(out.args[0], tuple) else outputs,)  # (its users: the op only)
        keep = may_keep and not grad.users and _is_own_buffer(grad)
        # after the grad's producer (a view of it: after the view)
        with graph.inserting_after(grad):
            acc = graph.call_function(torch.ops.lynx.accumulate_grad.default, (primals[i], grad, keep))
        acc.meta["val"] = None
        if new_grads and keep:
            acc.meta[KEEPS_GRAD] = True
        elif new_grads:
            val = primals[i].meta.get("val")
            acc.meta[GRAD_BYTES] = val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0
        for key in ("seq_nr", "fwd_nn_module_stack", "nn_module_stack", "stack_trace"):
            if key in grad.meta:
                acc.meta[key] = grad.meta[key]
        moved += 1
    joint.recompile()
    return moved


def _is_own_buffer(grad: fx.Node) -> bool:
    """The gradient is a buffer of its own (no view of another value), so that keeping it keeps
    only its bytes."""
    return aliased_input(grad) is None and grad.op == "call_function"


def _error(why: str) -> Exception:
    from lynx_compile.errors import LynxOptionError

    return LynxOptionError(f"accumulate_grad_in_graph=True cannot apply: {why}; compile without it")


__all__ = ["accumulate_grad", "rewrite_joint", "param_indices", "decide", "remembering", "GradsInGraph"]
