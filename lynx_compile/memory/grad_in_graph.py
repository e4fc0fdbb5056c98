"""Parameter gradients added into ``.grad`` inside the compiled backward, where each is computed
(issue M's "gradient pile", on by default since issue Q; option ``accumulate_grad_in_graph``).

A model compiled whole has one compiled backward. Left to AOTAutograd, it returns every
parameter gradient at its end; autograd's ``AccumulateGrad`` adds each into ``.grad`` only after
it returns, so the step's peak holds all of them at once (4 bytes per parameter in fp32) on top
of the activations still alive. Eager PyTorch adds each into ``.grad`` as soon as it is computed.

lynx does what eager does. Before it partitions the joint graph, each parameter's gradient
output is replaced by ``lynx::accumulate_grads(params, grads, keep)``, an opaque op with a side
effect placed right after the first extern kernel (a matmul) that follows the gradient's
producer, one op for the gradients that land at one place (:func:`rewrite_joint`), and the
backward returns None for those parameters, so autograd's ``AccumulateGrad`` does not run for
them. The op does at run time what ``AccumulateGrad`` would have done (the parameter itself is
saved for the backward: an input, no memory; a leaf is saved as itself):

- the gradient is added into ``param.grad``, or becomes ``.grad`` when it is None: the buffer
  itself where nothing in the graph reads or reuses it after the op and it has the parameter's
  layout (autograd steals it alike), else a copy;
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
The op finds each parameter's ``AccumulateGrad`` node in the running backward (the next
functions of the compiled graph's backward node), so nothing is held across steps (a model
compiled and dropped is freed) and dynamo's DDPOptimizer, which compiles each bucket's graph on
fake parameters, needs nothing more. A Python
hook registered on the node itself (``grad_fn.next_functions``'s ``register_hook``) receives
None as the gradient: read ``.grad`` there, or compile with ``False``.

When :func:`decide` keeps the gradients returned (``accumulate_grad_in_graph=None``, the
default, where eager's ``.grad`` cannot be promised; ``True`` refuses there instead): a
tensor-subclass parameter (FSDP2's DTensor compiled whole, TP's DTensor), a tensor hook,
``weight_split`` (the weight gradients belong to the deferred W graph). By default also where
nothing is recomputed (policy ``none`` or ``torch``, ``lynx`` with no budget): the step is then
torch.compile's, bit for bit (a tied weight's two gradients are summed in another order once the
sum feeds the op), and its peak is at the backward's start, where the pile has not formed. And,
under a budget, where every ``.grad`` is None as the graph compiles (:data:`RETURNED_NEW`): the
returned gradients become ``.grad`` at the same bytes, and the op's calls cost host time; the
first call that finds a ``.grad`` kept (gradient accumulation) compiles the graph again with
the gradients in it (``step.piece.Piece``). The record says which
(``GraphRecord.grads_in_graph``).

Memory: the graph's memory model frees each gradient after its op. Where a parameter's ``.grad``
is None when the graph compiles (``zero_grad()``'s default, the first step), the step allocates
``.grad`` there and keeps it: the op's node carries those bytes (``GRAD_BYTES``), which the
simulation keeps to the graph's end. Where ``.grad`` is allocated at the step's start, the
gradient dies at the op and the pile is gone.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.memory import inductor_model
from lynx_compile.memory.storage import GRAD_BYTES, KEEPS_GRAD, aliased_input

OP_NAME = "lynx::accumulate_grads"
_FIX = "compile with options={'accumulate_grad_in_graph': False} to have the backward return them"


_LIB = torch.library.Library("lynx", "FRAGMENT")
_LIB.define("accumulate_grads(Tensor[] params, Tensor[] grads, bool[] keep) -> ()")


def accumulate_grads(params: list[torch.Tensor], grads: list[torch.Tensor], keep: list[bool]) -> None:
    """What autograd's ``AccumulateGrad`` does for each parameter once the backward returned, done
    here (one call for the gradients the graph adds at one point: :func:`rewrite_joint`):
    ``param.grad += grad``; where ``.grad`` is None, ``grad`` itself becomes ``.grad`` when its
    ``keep`` (nothing in the graph reads or reuses its buffer after this op) and it has the
    parameter's layout, else a copy; nothing where the engine would not accumulate into the
    parameter. (Runs on the host for every parameter of every step: the checks are per call
    where they can be.)"""
    if torch.is_grad_enabled():
        raise RuntimeError(f"lynx: backward(create_graph=True) is not supported where lynx adds parameter "
                           f"gradients into .grad inside the compiled backward; {_FIX}")
    in_engine = _compat.in_backward()
    for param, grad, k in zip(params, grads, keep):
        if not (param.is_leaf and param.requires_grad):
            raise RuntimeError("lynx: the compiled backward did not receive the parameter itself (a non-leaf "
                               f"or detached tensor), so it cannot add the gradient into its .grad; {_FIX}")
        if param._backward_hooks:
            raise RuntimeError("lynx: a parameter got a tensor hook (register_hook) after lynx compiled its graph "
                               "to add its gradient into .grad inside the backward; register the hook before the "
                               f"first compiled call (lynx then returns that graph's gradients), or {_FIX}")
        if in_engine and not _engine_accumulates(param):
            continue
        have = param.grad
        if have is not None:
            have.add_(grad)
        elif k and _has_layout_of(grad, param):
            param.grad = grad  # autograd's AccumulateGrad steals it alike
        else:
            new = torch.empty_like(param)
            new.copy_(grad)
            param.grad = new


def _has_layout_of(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """``grad`` fills a storage of exactly its own bytes (itself or a view of a buffer of its
    size: Inductor hands a bias gradient as a view of its ``(1, n)`` sum), laid out as
    ``param``: no larger buffer kept alive as ``.grad``."""
    # (dtype and device are the parameter's in the graph; setting .grad checks them anyway)
    return (grad.stride() == param.stride() and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == param.untyped_storage().nbytes())


def _engine_accumulates(param: torch.Tensor) -> bool:
    """Whether the running backward (the caller checks that one runs) accumulates into
    ``param.grad`` (every ``.backward()``; not ``backward(inputs=...)`` without it).
    ``torch.autograd.grad`` asking for ``param`` is an error: the gradient is not returned."""
    node = _accumulator(param)
    try:
        return _compat.will_engine_execute_node(node)
    except RuntimeError as e:  # the engine captures this leaf's gradient: torch.autograd.grad
        raise RuntimeError("lynx: torch.autograd.grad(..., inputs=<parameters>) asks for parameter gradients "
                           "that lynx adds into .grad inside the compiled backward; use loss.backward() and "
                           f"read .grad, or {_FIX}") from e


def _accumulator(param: torch.Tensor):
    """``param``'s ``AccumulateGrad`` node in the running backward: among the next functions of
    the node running now (the compiled graph's backward, an ``autograd.Function``'s context:
    the table of them is kept on it, so it goes with the autograd graph, raised or not), else
    through a view of ``param`` (``get_gradient_edge``: ~6 us). (Until 2026-12-04 the nodes
    were taken when a graph compiled and held for good: a model compiled under a budget and
    dropped was never freed, each node holding its parameter.)"""
    current = _compat.current_autograd_node()
    table = getattr(current, "_lynx_accumulators", None)
    if table is None:
        table = {}
        for nxt, _ in getattr(current, "next_functions", None) or ():
            variable = getattr(nxt, "variable", None)
            if variable is not None:
                table[id(variable)] = nxt
        try:
            current._lynx_accumulators = table
        except (AttributeError, TypeError):  # a node that takes no attributes: looked up again next time
            pass
    node = table.get(id(param))
    if node is None or node.variable is not param:
        with torch.enable_grad():
            node = torch.autograd.graph.get_gradient_edge(param).node
        table[id(param)] = node
    return node


# A plain library kernel, not ``torch.library.custom_op``: the op runs once per parameter per
# step on the host, and custom_op's Python wrappers (its autograd layer among them) cost ~10 us a
# call against ~3 us here (CPU, torch 2.13): gpt-tiny's 52 parameters took 1 ms of a 7 ms backward.
_LIB.impl("accumulate_grads", accumulate_grads, "CompositeExplicitAutograd")


@torch.library.register_fake(OP_NAME)
def _(params: list[torch.Tensor], grads: list[torch.Tensor], keep: list[bool]) -> None:
    return None


_compat.mark_side_effect(torch.ops.lynx.accumulate_grads.default)


def accumulate_grads_op():
    """The op (``torch.ops.lynx.accumulate_grads.default``): what Inductor's buffer reuse must not
    hand a buffer of (``compiler.inductor_partition.BufferReuse``: it may be kept as ``.grad``)."""
    return torch.ops.lynx.accumulate_grads.default


class GradsInGraph(NamedTuple):
    """Where one graph's parameter gradients go (:func:`decide`)."""

    applies: bool
    """Added into ``.grad`` inside the backward; False: returned at its end (the pile)."""
    new_grads: bool
    """A parameter's ``.grad`` was None when the graph compiled: the step allocates ``.grad``
    where each gradient is added, and keeps it (counted by the memory model)."""
    why: str
    """Why the gradients are returned (empty where they are added)."""

    @property
    def returned_while_none(self) -> bool:
        """Returned because every ``.grad`` was None as the graph compiled (:data:`RETURNED_NEW`):
        to be added in the graph once a ``.grad`` is kept (``step.piece.Piece``)."""
        return not self.applies and self.new_grads


def decide(config, example_inputs: list, *, switchable: bool = False) -> GradsInGraph:
    """Where the parameter gradients of a graph compiled with ``example_inputs`` under ``config``
    (a ``LynxConfig``) go. ``accumulate_grad_in_graph``: None (the default) adds them in the graph
    wherever eager's ``.grad`` is kept and something may be recomputed; True the same, refused with
    ``LynxOptionError`` where it cannot be kept; False returns them.

    ``switchable``: the graph runs as a ``step.piece.Piece``, which compiles it again with
    the gradients in the graph at the first call that finds a ``.grad`` kept (gradient
    accumulation). There, by default, a graph whose parameters' ``.grad`` are all None as it
    compiles (``zero_grad()``'s default) returns them (:data:`RETURNED_NEW`)."""
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
    if switchable and setting is None and params and all(p.grad is None for p in params):
        return GradsInGraph(False, True, RETURNED_NEW)
    return GradsInGraph(True, any(p.grad is None for p in params), "")


RETURNED_NEW = ("every .grad is None as the graph compiles: the backward returns the gradients and autograd "
                "makes each the new .grad, the bytes the in-graph op would keep, without its calls; compiled "
                "again with them in the graph at the first call that finds a .grad kept (gradient accumulation)")
"""Why a graph returns its gradients where ``.grad`` is None (:func:`decide`, ``switchable``).

The two regimes hold the same bytes when ``.grad`` is None: each gradient is alive from where it
is computed to the step's end, as a graph output or as the ``.grad`` the op sets. They differ in
time: each op call is a host call between Inductor's kernel groups (gpt-tiny, 4 layers, batch
4 x 64, CPU, one thread, 21 interleaved rounds: the backward at budget 0.9 ran 4.96 ms returned,
5.51 ms with the op, 4.93 ms without a budget). Where ``.grad`` is kept across backward calls,
returned gradients pile up beside it; the op adds each into it where computed."""


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
    """In place: each parameter gradient output of ``joint`` becomes None, and the gradient is
    added into ``.grad`` by a ``lynx::accumulate_grads(params, grads, keep)`` node placed right
    after the first extern kernel (a matmul, attention, a collective, a fallback) that follows the
    gradient's producer, one node for all the gradients that land there (:func:`_add_point`).
    ``keep[i]``: the op is the gradient's only reader and ``may_keep`` (the compiler frees buffers
    after their last reader and reuses none: ``compiler="eager"``, or Inductor under lynx's
    settings), so a ``.grad`` that is None can take the gradient's buffer as autograd would. With
    ``new_grads`` (``.grad`` None at compile) the node carries what the memory model keeps to the
    graph's end: the positions in ``grads`` of those whose storage it keeps (``KEEPS_GRAD``) and
    the copies' bytes (``GRAD_BYTES``). Returns how many gradients were moved into the graph."""
    graph = joint.graph
    primals = [n for n in graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    out = graph.find_nodes(op="output")[0]
    outputs = list(out.args[0])
    grads = outputs[num_fwd_outputs:]
    if len(grads) != len(primals):
        raise RuntimeError(f"lynx: {len(grads)} gradient outputs for {len(primals)} inputs in the joint graph; "
                           f"{_FIX}")
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: dict[fx.Node, list[tuple[fx.Node, fx.Node, bool]]] = {}
    for i in params:
        grad = grads[i]
        if not isinstance(grad, fx.Node) or grad.op == "placeholder":
            continue
        outputs[num_fwd_outputs + i] = None
        out.args = (tuple(outputs) if isinstance(out.args[0], tuple) else outputs,)  # (its users: the op only)
        keep = may_keep and not grad.users and _is_own_buffer(grad)
        groups.setdefault(_add_point(grad), []).append((primals[i], grad, keep))
    for point, members in sorted(groups.items(), key=lambda kv: order[kv[0]]):
        members.sort(key=lambda m: order[m[1]])
        ps, gs, keeps = (list(x) for x in zip(*members))
        with graph.inserting_before(point):
            acc = graph.call_function(torch.ops.lynx.accumulate_grads.default, (ps, gs, keeps))
        acc.meta["val"] = None
        if new_grads:
            kept = tuple(j for j, k in enumerate(keeps) if k)
            copied = sum(_nbytes(p) for p, k in zip(ps, keeps) if not k)
            if kept:
                acc.meta[KEEPS_GRAD] = kept
            if copied:
                acc.meta[GRAD_BYTES] = copied
        last = gs[-1]
        for key in ("seq_nr", "fwd_nn_module_stack", "nn_module_stack", "stack_trace"):
            if key in last.meta:
                acc.meta[key] = last.meta[key]
    joint.recompile()
    return sum(len(m) for m in groups.values())


def _add_point(grad: fx.Node) -> fx.Node:
    """The node before which ``grad`` is added into ``.grad``: the one after the first extern
    kernel that follows its producer (and after that kernel's getitems), or the output.
    Inductor runs the loop kernels between two extern kernels as one group of code on the CPU,
    and every extern call (this op too) ends a group: an op right after each gradient split
    gpt-tiny's backward from 28 kernel calls into 46 and added 52 calls of its own (4 layers;
    5.63 ms against 4.94 ms with gradients returned, CPU, torch 2.13). Before the extern kernel
    was not enough: Inductor lowers the loop values that kernel reads (a clone for a ``bmm``)
    when it reaches the kernel, after the op. Later by a few kernels, the gradient lives a little
    longer where ``.grad`` is allocated (where it is None, the buffer becomes ``.grad`` or its
    copy does, alike)."""
    node = grad.next
    while node.op != "output" and not _runs_apart(node):
        node = node.next
    if node.op == "output":
        return node
    node = node.next
    while node.op == "call_function" and node.target is operator.getitem:
        node = node.next
    return node


def _runs_apart(node: fx.Node) -> bool:
    """An extern kernel or fallback of Inductor's (not a getitem of one's outputs)."""
    return (node.op == "call_function" and node.target is not operator.getitem
            and inductor_model.is_extern_kernel(node))


def _nbytes(primal: fx.Node) -> int:
    val = primal.meta.get("val")
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0


def _is_own_buffer(grad: fx.Node) -> bool:
    """The gradient is a buffer of its own, or a view of one of its size that nothing else reads
    (a bias gradient viewed from its ``(1, n)`` sum), so that keeping it keeps only its bytes."""
    node = grad
    while (base := aliased_input(node)) is not None:
        if not isinstance(base, fx.Node) or len(base.users) != 1:
            return False
        node = base
    if node.op != "call_function":
        return False
    val, own = grad.meta.get("val"), node.meta.get("val")
    return (node is grad or (isinstance(val, torch.Tensor) and isinstance(own, torch.Tensor)
                             and val.numel() == own.numel() and val.dtype == own.dtype))


def _error(why: str) -> Exception:
    from lynx_compile.errors import LynxOptionError

    return LynxOptionError(f"accumulate_grad_in_graph=True cannot apply: {why}; compile without it")


__all__ = ["accumulate_grads", "rewrite_joint", "param_indices", "decide", "GradsInGraph"]
