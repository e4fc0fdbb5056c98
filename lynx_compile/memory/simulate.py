"""Predict a training step's activation memory from the partitioned fw/bw graphs.

The model is the one the generated code actually follows (eager execution of fx code with the
boxed calling convention): a node's output is allocated when it runs; a view or other aliasing
output shares its base's storage; a storage is freed right after the last node that reads any
alias of it, unless it is a graph output. Forward outputs that the backward reads (saved
tensors) stay live from the end of the forward until their last use in the backward.
Parameters and inputs (forward placeholders) are the baseline and not counted. The gradients
the backward returns are counted from where they are computed to the end of the backward: a
compiled backward returns them together, and only then does autograd add them into ``.grad``
(the gradient storage, allocated before the step in steady state: ``lynx_compile.budget``).

Offloaded tensors (``lynx.offload``, ``passes/offload.py``): the host copy allocates no device
bytes; the device tensor lives until ``lynx.offload_wait`` (the copy is done), the reloaded one
from ``lynx.reload``. On CPU "host" is a second CPU buffer, but the prediction is still the
device-side bytes, as if host memory were separate (the CPU allocator's measured peak includes
the host copies).

Not modelled: workspace an op allocates internally and frees before returning (matmul packing,
softmax temporaries). That is what keeps prediction and measurement apart by a few percent.

Under Inductor (``fused=True``), a first-order model of the code Inductor generates for the same
graph (lynx's Inductor settings: no peak-memory reordering, no wrapper buffer reuse):

* a pointwise op (or an ``index``, lowered as one) or a constant (``full``, ``arange``) whose
  every reader reads it inside a loop kernel (a pointwise op or a reduction, directly or
  through views) is computed inside those kernels (``fused_interior``): it allocates nothing,
  and what it reads lives until the latest of those kernels runs, at its reader's position
  (``kernel_positions``). HF Llama's MLP backward: ``dh * up`` is computed inside the
  silu-backward kernel after the input-gradient matmuls, so dh and up are freed there, not at
  the multiply;
* an ``index_put`` (an embedding's gradient) is a copy of its first input that a scatter
  kernel writes into (``SCATTER_OPS``): the zeros it starts from are computed inside the copy;
* a kernel (pointwise or reduction) writes its output into a same-sized buffer it reads that
  this graph computed and that dies there (``inplace_outputs``, Inductor's in-place buffers);
  when that output is a gradient, the buffer was one from the start (a tied weight's LM-head
  gradient matmul, to which the embedding's gradient is added in place);
* a matmul that Inductor's ``mm + add -> addmm`` moves to its add, and lynx's
  ``split_late_addmm`` leaves there, runs at the add (``late_addmms``);
* a pointwise kernel that shares at least 1 MiB of reads with an earlier one of the same size,
  at most 64 kernels before it, runs with it, its other dependencies moved ahead (``fused_order``:
  the scheduler's fusion of independent kernels, a SwiGLU backward's products of the output
  gradient); the group allocates all its outputs before what dies in it is freed;
* the backward's saved tensors that AOTAutograd donates take a kernel's output in place once they
  die (``donated_inputs``).

Not modelled under Inductor: values it realizes although they feed only loop kernels (one read
by several kernels with more than ``realize_reads_threshold`` reads or an ``exp`` on CPU), other
fusions that move a kernel (reductions, kernels of other sizes, reads shared below 1 MiB).
Measured on CPU (``tests/test_compiled_peak.py``, docs/memory_budget.md
"Measured peaks against the budget under Inductor")
the prediction is within bytes of the allocator's peak for gpt-small, a GQA LM and HF Llama.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.costs.comm import is_wait_node
from lynx_compile.costs.types import per_op_cached


def _nbytes(val) -> int:
    if isinstance(val, torch.Tensor):
        numel = 1
        for d in val.shape:
            numel *= _hint(d)
        return numel * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_nbytes(v) for v in val)
    return 0


def _hint(d) -> int:
    if isinstance(d, int):
        return d
    # an unbacked size (expert-parallel token counts) as the cost model sizes it
    # (``costs.types.UNBACKED_SIZE_HINT``), so a tensor's bytes and its time agree
    from lynx_compile.costs.types import hint_int

    return hint_int(d)


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output shares (views, in-place ops), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    if is_wait_node(node):  # wait_tensor hands back its input, the collective's output buffer
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    if not _returns_alias(node.target):
        return None
    for arg in node.args:
        if isinstance(arg, fx.Node):
            return arg
    return None


@per_op_cached
def _returns_alias(target) -> bool:
    """Whether the op's first output aliases an input (its schema says so)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.returns) and schema.returns[0].alias_info is not None


@dataclass
class GraphMemory:
    """Live-bytes timeline of one graph."""

    peak_bytes: int = 0
    peak_node: str = ""
    end_bytes: int = 0
    timeline: list[tuple[str, int]] = field(default_factory=list)


def _value(node: fx.Node):
    """``meta["val"]``; for an op inserted without one whose users are all getitems (torch's
    ``run_and_save_rng_state`` in the forward), the tuple its getitems take."""
    if "val" in node.meta or not node.users or any(u.target is not operator.getitem for u in node.users):
        return node.meta.get("val")
    taken = {u.args[1]: u.meta.get("val") for u in node.users}
    return tuple(taken.get(i) for i in range(max(taken) + 1))


def _is_multi_output(node: fx.Node) -> bool:
    return isinstance(_value(node), (tuple, list)) and aliased_input(node) is None


def _tuple_prefix(node: fx.Node) -> str:
    """Key prefix of a tuple value: the op's name, or ``<prefix>[i]`` for a nested tuple taken
    by a getitem (``run_and_save_rng_state`` returns ``(state, (out, mask))``)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and _is_multi_output(node.args[0]):
        return f"{_tuple_prefix(node.args[0])}[{node.args[1]}]"
    return node.name


def storage_keys(gm: fx.GraphModule, inputs: dict[str, str]) -> dict[fx.Node, str]:
    """Storage key per node: its own name when it allocates; its base's key when it aliases;
    ``"<op>[i]"`` for output i of a multi-output op, taken by ``getitem(op, i)``."""
    keys: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            keys[node] = inputs.get(node.name, node.name)
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and _is_multi_output(node.args[0]):
            keys[node] = _tuple_prefix(node)
            continue
        base = aliased_input(node)
        keys[node] = keys[base] if base is not None else node.name
    return keys


def _leaves(prefix: str, val) -> list[tuple[str, int]]:
    if isinstance(val, (tuple, list)):
        return [leaf for i, v in enumerate(val) for leaf in _leaves(f"{prefix}[{i}]", v)]
    size = _nbytes(val)
    return [(prefix, size)] if size else []


def allocations(node: fx.Node) -> list[tuple[str, int]]:
    """(storage key, bytes) of what ``node`` allocates when it runs: nothing for views,
    placeholders and getitems; one storage per tensor output of a multi-output op (nested
    tuples flattened)."""
    if node.op != "call_function" or aliased_input(node) is not None or node.target is operator.getitem:
        return []
    if node.target in _host_ops():
        return []          # host memory, not device memory
    val = _value(node)
    if isinstance(val, (tuple, list)):
        return _leaves(node.name, val)
    return [(node.name, _nbytes(val))]


@functools.lru_cache(maxsize=1)
def _host_ops() -> frozenset:
    from lynx_compile.runtime.offload import HOST_OPS

    return HOST_OPS


#: Ops Inductor lowers to a pointwise loop although they are not tagged pointwise (its
#: ``lowering.py``: ``Pointwise.create`` with an indirect or masked load).
INDEX_OPS = frozenset({torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor})
LOOP_OPS = INDEX_OPS | {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default}


def _tags(node: fx.Node) -> tuple:
    return getattr(node.target, "tags", ()) if node.op == "call_function" else ()


def _is_view(node: fx.Node) -> bool:
    """A view (not a getitem, a wait or an in-place op): Inductor indexes its base."""
    if node.op != "call_function" or node.target is operator.getitem or is_wait_node(node):
        return False
    schema = getattr(node.target, "_schema", None)
    return aliased_input(node) is not None and schema is not None and not schema.is_mutable


def _is_loop(node: fx.Node) -> bool:
    """A pointwise op, or one of ``LOOP_OPS`` (an ``index`` with boolean indices excepted: a
    fallback kernel)."""
    if node.op != "call_function":
        return False
    if torch.Tag.pointwise in _tags(node):
        return True
    if node.target not in LOOP_OPS:
        return False
    indices = node.args[1] if node.target in INDEX_OPS else ()
    return not any(isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) == torch.bool
                   for i in indices)


#: Ops Inductor lowers as a copy of their first input that a scatter kernel then writes into
#: (its ``lowering.py``: ``index_put_impl_(clone(x), ...)``; torch 2.13's embedding backward,
#: ``_unsafe_masked_index_put_accumulate``, lowers to the same): one new buffer, the first input
#: read inside the copy's loop, the others inside the scatter's unless it falls back to aten
#: (:func:`_scatter_in_loop`). An embedding's gradient: ``index_put(full(0), [ids], grad)``
#: allocates the gradient once, the zeros never (counting both put a 4-layer GPT-1.3B's step
#: floor at the embedding's backward 364 MiB above what ran on an H200, torch 2.11).
SCATTER_OPS = frozenset({torch.ops.aten.index_put.default, torch.ops.aten._unsafe_index_put.default,
                         torch.ops.aten._unsafe_masked_index_put_accumulate.default})


def _scatter_in_loop(node: fx.Node) -> bool:
    """Whether Inductor computes the ``SCATTER_OPS`` node ``node`` as a scatter kernel (reading
    its values and indices in its loop) rather than aten's ``index_put_`` (``index_put_fallback``:
    boolean indices, deterministic algorithms, an accumulate its atomics lack: int64, bool, and
    bfloat16 below compute capability 9.0)."""
    x = node.args[0]
    if node.target is torch.ops.aten._unsafe_masked_index_put_accumulate.default:  # (x, mask, indices, values)
        indices, accumulate = node.args[2], True
    else:  # (x, indices, values, accumulate=False)
        indices = node.args[1]
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if torch.are_deterministic_algorithms_enabled():
        return False
    if any(isinstance(i, fx.Node) and getattr(i.meta.get("val"), "dtype", None) in (torch.bool, torch.uint8)
           for i in indices):
        return False
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    if accumulate and val.dtype in (torch.int64, torch.bool):
        return False
    if accumulate and val.dtype == torch.bfloat16 and val.device.type == "cuda":
        return torch.cuda.get_device_capability(val.device) >= (9, 0)
    return True


def _reads_in_loop(node: fx.Node, producer: fx.Node, extern: frozenset = frozenset()) -> bool:
    """``node`` reads ``producer`` inside a loop kernel (a pointwise op, a reduction, the copy or
    the scatter of a ``SCATTER_OPS`` op), directly or through views, never as the graph's
    output; a node in ``extern`` (an add Inductor turns into an ``addmm``) reads as an extern
    kernel."""
    if node in extern:
        return False
    if _is_loop(node) or torch.Tag.reduction in _tags(node):
        return True
    if node.op == "call_function" and node.target in SCATTER_OPS:
        rest = [a for a in node.args[1:] for a in (a if isinstance(a, (list, tuple)) else (a,))]
        return producer not in rest or _scatter_in_loop(node)
    return _is_view(node) and bool(node.users) and all(_reads_in_loop(u, node, extern) for u in node.users)


def _is_constant(node: fx.Node) -> bool:
    """A deterministic op with no tensor inputs (``full``, ``arange``, ``scalar_tensor``)."""
    return (node.op == "call_function" and not node.all_input_nodes and node.target not in _host_ops()
            and isinstance(node.meta.get("val"), torch.Tensor)
            and torch.Tag.nondeterministic_seeded not in _tags(node))


def fused_interior(node: fx.Node, extern: frozenset = frozenset()) -> bool:
    """A value Inductor computes inside the kernels that read it, so it never materializes: a
    pointwise op or a constant whose every reader reads it in a loop kernel (a pointwise op or
    a reduction, directly or through views; not the graph's output). Inductor's lowering inlines
    such an unrealized value into its readers' loop bodies. ``extern``: pointwise readers that
    Inductor computes as an extern kernel (the adds of :func:`late_addmms`: ``addmm`` reads its
    addend from a buffer, so a tied embedding's bf16 gradient materializes)."""
    if not (_is_loop(node) or _is_constant(node)):
        return False
    return bool(node.users) and all(_reads_in_loop(u, node, extern) for u in node.users)


def _bytes(node: fx.Node) -> int:
    return _nbytes(node.meta.get("val"))


def _expands_to(t: torch.Tensor, out: torch.Tensor) -> bool:
    try:
        return tuple(torch.broadcast_shapes(t.shape, out.shape)) == tuple(out.shape)
    except Exception:  # noqa: BLE001 - symbolic or incompatible shapes: no addmm
        return False


def splits_late_addmm(pos: dict[fx.Node, int], inp: fx.Node, a: fx.Node, b: fx.Node, out_bytes: int,
                      at: int) -> bool:
    """Whether ``inductor.split_late_addmm`` moves the matmul ``a @ b``, added to ``inp`` at
    position ``at``, back to where its operands are ready: ``inp`` comes after both, and the
    matmul's output (``out_bytes``) is smaller than the operands it frees (those read nowhere after
    ``at``). The one rule for the pass and for this model of it (``late_addmms``)."""
    later = max(a, b, key=pos.get)
    freed = sum(_bytes(x) for x in {a, b} if all(pos.get(u, -1) <= at for u in x.users))
    return pos[inp] >= pos[later] and out_bytes < freed


def late_addmms(nodes: list[fx.Node]) -> set[fx.Node]:
    """The matmuls Inductor computes at the ``add`` that reads them: its post-grad pattern turns
    ``add(mm(a, b), inp)`` into ``addmm(inp, a, b)`` at the add (mm read only there, one dtype,
    ``inp`` broadcastable; on a GPU only when the add has a non-pointwise reader), and lynx's
    ``inductor.split_late_addmm`` moves the matmul back to its operands only when ``inp`` comes
    after both and the matmul's output is smaller than the operands it frees. A tied weight's
    gradient (gpt-tiny's LM head) is such an add: held, its operands live to the add. (lynx
    splits only its own placements; for policies none and torch this assumes it does too.)"""
    aten = torch.ops.aten
    pos = {n: i for i, n in enumerate(nodes)}
    late: set[fx.Node] = set()
    for add in nodes:
        if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs \
                or not all(isinstance(x, fx.Node) for x in add.args):
            continue
        for mm, inp in (add.args, add.args[::-1]):
            if mm.target is not aten.mm.default or len(mm.users) != 1 \
                    or not isinstance(inp.meta.get("val"), torch.Tensor):
                continue
            a, b = mm.args
            out, ival = mm.meta.get("val"), inp.meta["val"]
            if not isinstance(out, torch.Tensor) or ival.dtype != out.dtype or not _expands_to(ival, out):
                continue
            if out.device.type == "cuda" and all(torch.Tag.pointwise in _tags(u) for u in add.users):
                continue  # Inductor keeps it unfused on a GPU
            if splits_late_addmm(pos, inp, a, b, _bytes(mm), pos[add]):
                continue  # lynx splits it: the matmul runs where its operands are ready
            late.add(mm)
            break
    return late


def kernel_positions(nodes: list[fx.Node], interior: set[fx.Node] | None = None) -> dict[fx.Node, int]:
    """Position (index in ``nodes``) at which each node's value is computed under Inductor.

    A node that materializes runs where it stands. A ``fused_interior`` node is computed inside
    the kernel of each reader that materializes (through chains of interior nodes and views);
    it reads its inputs there, so its position is the latest such kernel's (a value read by
    several kernels is computed in each). Why the reader's position: Inductor's lowering inlines
    an unrealized pointwise value into the loop body of the buffer that reads it, and that
    buffer is created, and scheduled, where its own FX node is lowered (the scheduler places a
    fused group at its earliest member and moves only the group's dependencies ahead of it,
    ``Scheduler.fuse_nodes_once``). A view counts at its latest reader's position too (its
    readers read its base there anyway). ``interior``: the nodes computed inside a later kernel
    (default: the ``fused_interior`` ones; ``simulate_graph`` adds ``late_addmms``)."""
    if interior is None:
        interior = {n for n in nodes if fused_interior(n)}
    pos = {n: i for i, n in enumerate(nodes)}
    at: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        at[node] = pos[node]
        if node in interior or _is_view(node):
            at[node] = max([at[u] for u in node.users if u.op != "output"] + [pos[node]])
    return at


FUSION_SHARED_BYTES = 1 << 20
"""Bytes two independent kernels must read in common for :func:`fused_order` to fuse them:
lynx's ``score_fusion_memory_threshold`` (``_compat.INDUCTOR_KEEP_PLACEMENT``). torch.compile's
own partitions compile with Inductor's default (any shared byte); smaller shared reads than
this are not modelled there (a kernel left at its own position holds what it reads longer,
never less)."""


FUSION_MAX_DISTANCE = 64
"""Inductor's scheduler fuses no two nodes farther apart than this in its order
(``Scheduler.are_long_distant_nodes``: fusing recomputed nodes of different checkpointed regions
lengthened their tensors' lives)."""


def fused_order(nodes: list[fx.Node], keys: dict[fx.Node, str], interior: set[fx.Node],
                sizes: dict[str, int]) -> tuple[list[fx.Node], dict[fx.Node, int]]:
    """``nodes`` in the order Inductor runs them once its scheduler has fused pointwise kernels
    into earlier ones, and the fused groups (kernel -> group number; kernels left alone are not
    in it). A kernel ``k2`` (a pointwise op that materializes) joins the earlier kernel ``k1`` of
    the same size with which it shares the most bytes of reads (at least
    :data:`FUSION_SHARED_BYTES`, storages of ``sizes``), unless something it depends on reads
    ``k1`` (a cycle) or the two stand more than :data:`FUSION_MAX_DISTANCE` kernels apart.
    ``Scheduler.fuse_nodes_once`` runs a fused group where its earliest member stood and moves
    the group's other dependencies ahead of it: what ``k2`` depends on that
    stands between them moves before ``k1`` (a matmul), or with ``k2`` (values computed inside
    it, views). A SwiGLU backward (torchtitan's qwen3 and llama3 blocks, HF Llama's MLP): the
    kernels computing ``dh * silu(gate)``, silu's backward (and, where the MLP is recomputed,
    ``silu(gate) * up``) read the same ``gate`` and ``up``; Inductor computes them in one
    kernel, after the ``dh`` matmul and before the weight-gradient matmuls, so gate and up die
    there (measured: the separate kernels' model held them across the matmuls, 7-19% above
    Inductor's backward peak)."""
    order = list(nodes)
    at = {n: i for i, n in enumerate(order)}
    # Inductor's scheduler order (a node per kernel or extern call: no views, nothing computed
    # inside another kernel), for its refusal to fuse nodes far apart (``are_long_distant_nodes``)
    sched: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "call_function" and n not in interior and not _is_view(n):
            sched[n] = len(sched)
    span: dict[int, tuple[int, int]] = {}  # a fused group's first and last scheduler positions
    reads: dict[fx.Node, set[str]] = {}
    readers: dict[str, list[fx.Node]] = {}  # storage -> the kernels before that read it
    group: dict[fx.Node, int] = {}
    numel = lambda n: _bytes(n) // max(1, _value(n).element_size())  # noqa: E731
    for k2 in nodes:
        if k2 in interior or k2.op != "call_function" or not _is_loop(k2) or len(allocations(k2)) != 1 \
                or not isinstance(_value(k2), torch.Tensor):
            continue
        reads[k2] = set(_kernel_reads(k2, keys, interior))
        best, best_shared = None, 0
        for k1 in dict.fromkeys(k for key in sorted(reads[k2]) for k in readers.get(key, ())):
            if numel(k1) != numel(k2):
                continue
            lo, hi = span.get(group.get(k1, -1), (sched[k1], sched[k1]))
            if max(abs(lo - sched[k2]), abs(sched[k2] - hi)) > FUSION_MAX_DISTANCE:
                continue
            shared = sum(sizes.get(k, 0) for k in reads[k1] & reads[k2])
            if shared >= FUSION_SHARED_BYTES and shared > best_shared:
                moves = _fusion_moves(k2, k1, at, interior)
                if moves is not None:
                    best, best_shared = (k1, moves), shared
        for key in reads[k2]:
            readers.setdefault(key, []).append(k2)
        if best is None:
            continue
        k1, (ahead, along) = best
        rest = [n for n in order if n not in ahead and n not in along]
        i = rest.index(k1)
        order = rest[:i] + sorted(ahead, key=at.get) + [k1] + sorted(along, key=at.get) + rest[i + 1:]
        at = {n: i for i, n in enumerate(order)}
        g = group[k2] = group.setdefault(k1, len(group))
        lo, hi = span.get(g, (sched[k1], sched[k1]))
        span[g] = (min(lo, sched[k2]), max(hi, sched[k2]))
    return order, group


def _fusion_moves(k2: fx.Node, k1: fx.Node, at: dict[fx.Node, int],
                  interior: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """What moves when ``k2`` joins ``k1``'s kernel: (the dependencies of ``k2`` standing after
    ``k1`` that run ahead of it, ``k2`` with the values computed inside it and views); None when
    one of those dependencies reads ``k1`` (fusing would make a cycle)."""
    after = at[k1]
    closure, todo = {k2}, list(k2.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in closure or n is k1 or at[n] <= after:
            continue
        closure.add(n)
        todo.extend(n.all_input_nodes)
    ahead: set[fx.Node] = set()
    for n in closure:
        if n is not k2 and n not in interior and not _is_view(n):  # a kernel of its own
            ahead.add(n)
            stack = list(n.all_input_nodes)
            while stack:
                m = stack.pop()
                if m is k1:
                    return None
                if m in closure and m not in ahead:
                    ahead.add(m)
                    stack.extend(m.all_input_nodes)
                elif at[m] > after and m not in closure:
                    stack.extend(m.all_input_nodes)
    return ahead, closure - ahead


def _kernel_reads(node: fx.Node, keys: dict[fx.Node, str], interior: set[fx.Node]) -> list[str]:
    """Storage keys the kernel of ``node`` reads, in argument order, through interior producers
    (and views of them)."""
    out: dict[str, None] = {}
    for a in node.all_input_nodes:
        if a in interior or (_is_view(a) and aliased_input(a) in interior):
            out.update(dict.fromkeys(_kernel_reads(a, keys, interior)))
        else:
            out[keys[a]] = None
    return list(out)


def inplace_outputs(nodes: list[fx.Node], keys: dict[fx.Node, str], last_use: dict[str, int],
                    pinned: set[str], interior: set[fx.Node], groups: dict[fx.Node, int] | None = None,
                    donated: dict[str, int] | None = None, pos: dict[fx.Node, int] | None = None) -> dict[str, str]:
    """Inductor's in-place buffers (``config.inplace_buffers``): the kernel of a pointwise op or
    a reduction that materializes writes its output into the first buffer it reads that has the
    same size, was computed in this graph or is a ``donated`` input (storage key -> bytes: the
    backward's saved tensors AOTAutograd lets Inductor reuse), is no graph output, and has no
    reader left but this kernel (it dies there, ``last_use``: positions in ``nodes``; and no
    other kernel of its fused group, ``groups`` from :func:`fused_order`, reads it: Inductor
    decides per node before the group's kernel runs; ``pos``: where each kernel runs, a fused
    group's members at its last). Returns output key -> the reused buffer's
    key, chains resolved (a kernel may write into a buffer that itself took another's storage)."""
    alloc = {k: b for n in nodes if n not in interior for k, b in allocations(n)}
    alloc.update(donated or {})
    groups = groups or {}
    members: dict[int, list[fx.Node]] = {}
    for n, g in groups.items():
        members.setdefault(g, []).append(n)
    merged: dict[str, str] = {}
    for i, node in enumerate(nodes):
        out = allocations(node)
        addmm = any(a in interior and a.target is torch.ops.aten.mm.default for a in node.all_input_nodes)
        if len(out) != 1 or node in interior or addmm or not (_is_loop(node) or torch.Tag.reduction in _tags(node)):
            continue  # (an add holding a matmul is Inductor's extern addmm, not a loop kernel)
        others = {k for m in members.get(groups.get(node, -1), ()) if m is not node
                  for k in _kernel_reads(m, keys, interior)}
        for key in _kernel_reads(node, keys, interior):
            if alloc.get(key) == out[0][1] and last_use.get(key) == (pos[node] if pos else i) \
                    and key not in pinned and key not in others:
                merged[out[0][0]] = merged.get(key, key)
                break
    return merged


def simulate_graph(gm: fx.GraphModule, *, live_inputs: dict[str, int], input_keys: dict[str, str],
                   keep_outputs: bool = True, count_outputs: bool = True, fused: bool = False,
                   held_inputs: frozenset[str] = frozenset(), donated: frozenset[str] = frozenset()) -> GraphMemory:
    """Walk ``gm`` and track live bytes.

    ``live_inputs``: storage key → bytes of inputs already counted as live (freed at their last
    use). ``input_keys``: placeholder name → storage key (several placeholders may share one).
    Placeholders not in ``input_keys``/``live_inputs`` are baseline (not counted).
    ``count_outputs=False``: storages the graph returns are not counted (the backward's
    gradients, which become ``.grad``: gradient memory, not activation memory).
    ``fused=True`` (the graph is compiled by Inductor): the module docstring's Inductor model
    (``fused_interior`` nodes allocate nothing and read at :func:`kernel_positions`; kernels
    write in place, :func:`inplace_outputs`). ``fused=False`` is the exact op-by-op model.
    ``held_inputs``: storage keys of inputs the caller keeps alive until the graph returns.
    ``donated``: storage keys of ``live_inputs`` Inductor may write a kernel's output into once
    they die (:func:`donated_inputs`)."""
    keys = storage_keys(gm, input_keys)
    nodes = list(gm.graph.nodes)
    late = late_addmms(nodes) if fused else set()
    addmm_adds = frozenset(u for mm in late for u in mm.users)
    interior = {n for n in nodes if fused_interior(n, addmm_adds)} | late if fused else set()
    groups: dict[fx.Node, int] = {}
    if fused:
        sizes = {k: b for n in nodes for k, b in allocations(n)}
        sizes.update({keys[n]: _bytes(n) for n in nodes if n.op == "placeholder"})
        nodes, groups = fused_order(nodes, keys, interior, sizes)
    pos = kernel_positions(nodes, interior) if fused else {n: i for i, n in enumerate(nodes)}
    if groups:  # a fused group's kernel allocates all its outputs, then frees what dies in it
        index = {n: i for i, n in enumerate(nodes)}
        end: dict[int, int] = {}
        for n, g in groups.items():
            end[g] = max(end.get(g, -1), index[n])
        last = {index[n]: end[g] for n, g in groups.items()}
        pos = {n: last.get(p, p) for n, p in pos.items()}
    output = nodes[-1]
    last_use = _last_uses(nodes, keys, pos)
    pinned = {keys[n] for n in output.all_input_nodes} if keep_outputs else set()
    reused: dict[str, str] = {}
    if fused:  # one storage for a kernel's output and the input it overwrites, to the later end
        reused = inplace_outputs(nodes, keys, last_use, pinned, interior, groups,
                                 {k: live_inputs[k] for k in donated if k in live_inputs and k not in held_inputs},
                                 pos)
        keys = {n: reused.get(k, k) for n, k in keys.items()}
        last_use = _last_uses(nodes, keys, pos)
        pinned = {keys[n] for n in output.all_input_nodes} if keep_outputs else set()

    live = dict(live_inputs)
    mem = GraphMemory()
    total = sum(live.values())
    mem.peak_bytes, mem.peak_node = total, "<start>"
    frees: dict[int, list[str]] = {}
    for key, i in last_use.items():
        if key not in pinned and key not in held_inputs:
            frees.setdefault(i, []).append(key)
    uncounted = set() if count_outputs else pinned
    for i, node in enumerate(nodes):
        for key, size in () if node in interior else allocations(node):
            if key in reused or reused.get(key, key) in uncounted:  # nothing new, or a gradient
                continue
            live[key] = size
            total += size
        if total > mem.peak_bytes:
            mem.peak_bytes, mem.peak_node = total, node.name
        mem.timeline.append((node.name, total))
        for k in frees.get(i, ()):
            total -= live.pop(k, 0)
    mem.end_bytes = total
    return mem


def _last_uses(nodes: list[fx.Node], keys: dict[fx.Node, str], pos: dict[fx.Node, int]) -> dict[str, int]:
    """Storage key → position of its last reader (the graph's output excluded)."""
    output = nodes[-1]
    last_use: dict[str, int] = {}
    for node in nodes:
        for key, _ in allocations(node):  # an output nobody takes dies right away
            k = keys[node] if key == node.name else key  # written in place: the reused storage
            last_use[k] = max(last_use.get(k, -1), pos[node])
        for user in node.users:  # a read by an interior node counts where its kernel runs
            if user is not output:
                last_use[keys[node]] = max(last_use.get(keys[node], -1), pos[user])
        last_use.setdefault(keys[node], pos[node])
    return last_use


@dataclass(frozen=True)
class StepMemory:
    """Predicted activation memory of one fw+bw step (bytes)."""

    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    peak_bytes: int
    peak_at: str


def backward_inputs(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule) -> tuple[dict[str, str], dict[str, int]]:
    """Map the backward's placeholders onto forward storages.

    Returns (placeholder name → storage key, storage key → bytes live when the backward
    starts). Saved tensors keep their forward storage identity, so two saved views of one
    tensor count once; parameters and inputs (and views of them) count zero; placeholders that
    are no forward value (tangents, replayed RNG states) count their own size."""
    fw_keys = storage_keys(fw_gm, {})
    fw_by_name = {n.name: n for n in fw_gm.graph.nodes}
    fw_alloc = {k: b for n in fw_gm.graph.nodes for k, b in allocations(n)}
    input_keys: dict[str, str] = {}
    live: dict[str, int] = {}
    for ph in bw_gm.graph.find_nodes(op="placeholder"):
        src = fw_by_name.get(ph.name)
        key = fw_keys[src] if src is not None else f"bw:{ph.name}"
        input_keys[ph.name] = key
        if key not in live:
            live[key] = fw_alloc.get(key, 0) if src is not None else _nbytes(ph.meta.get("val"))
    return input_keys, live


def held_tangents(keys) -> frozenset[str]:
    """The backward inputs torch keeps alive for the whole backward call (pass them as
    ``simulate_graph(held_inputs=...)``): the output gradients (``tangents_*``, keys as given by
    :func:`backward_inputs` or plain placeholder names) on torch 2.11, none on 2.13
    (``_compat.backward_holds_grad_inputs``)."""
    if not _compat.backward_holds_grad_inputs():
        return frozenset()
    return frozenset(k for k in keys if k.removeprefix("bw:").startswith("tangents"))


def donated_inputs(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, input_keys: dict[str, str]) -> frozenset[str]:
    """Storage keys of the backward's inputs AOTAutograd donates to Inductor (the saved tensors
    that share no storage with a forward input or a forward output the user gets), when it
    donates them at all (``_compat.backward_donates_saved``)."""
    if not _compat.backward_donates_saved():
        return frozenset()
    fw_keys = storage_keys(fw_gm, {})
    fw_names = {n.name for n in fw_gm.graph.nodes}
    # the forward returns the user's outputs (mutated inputs first), then what the backward takes
    # of its values: not the tangents, nor the RNG states a recomputed random op replays
    # (``bwd_rng_state_<i>`` on CUDA: counted as saved, they made the user's logits donatable,
    # and a 4-layer GPT-1.3B on an H200 ran 136 MiB above its plan's predicted peak)
    saved = [ph for ph in bw_gm.graph.find_nodes(op="placeholder") if ph.name in fw_names]
    outputs = next(n for n in reversed(fw_gm.graph.nodes) if n.op == "output").args[0]
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    user = {fw_keys[o] for o in outputs[:max(0, len(outputs) - len(saved))] if isinstance(o, fx.Node)}
    inputs = {fw_keys[n] for n in fw_gm.graph.find_nodes(op="placeholder")}
    return frozenset(k for name, k in input_keys.items()
                     if not k.startswith("bw:") and k not in user and k not in inputs)


def simulate_step(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, *, fused: bool = False) -> StepMemory:
    """Peak activation memory of forward then backward, and the bytes saved between them
    (``fused``: see ``simulate_graph``)."""
    fw_mem = simulate_graph(fw_gm, live_inputs={}, input_keys={}, fused=fused)
    input_keys, live_inputs = backward_inputs(fw_gm, bw_gm)
    saved = sum(v for k, v in live_inputs.items() if not k.startswith("bw:tangents"))
    bw_mem = simulate_graph(bw_gm, live_inputs=live_inputs, input_keys=input_keys, count_outputs=True,
                            fused=fused, held_inputs=held_tangents(live_inputs),
                            donated=donated_inputs(fw_gm, bw_gm, input_keys) if fused else frozenset())
    peak = max(fw_mem.peak_bytes, bw_mem.peak_bytes)
    at = f"forward:{fw_mem.peak_node}" if fw_mem.peak_bytes >= bw_mem.peak_bytes else f"backward:{bw_mem.peak_node}"
    return StepMemory(saved_bytes=saved, forward_peak_bytes=fw_mem.peak_bytes,
                      backward_peak_bytes=bw_mem.peak_bytes, peak_bytes=peak, peak_at=at)
