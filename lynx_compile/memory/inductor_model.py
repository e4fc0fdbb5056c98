"""The code Inductor generates for a graph, as far as memory goes: which values it computes
inside other kernels, in which order it runs its kernels, which buffers it reuses in place.
``simulate.simulate_graph(fused=True)`` walks a graph with this model.

A first-order model of the code Inductor generates for a graph (lynx's Inductor settings: no peak-memory reordering, no wrapper buffer reuse):

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
  ``split_late_addmm_pass`` leaves there, runs at the add (``late_addmms``);
* a pointwise kernel that shares at least 1 MiB of reads with an earlier one of the same size,
  at most 64 kernels before it, runs with it, its other dependencies moved ahead (``fused_order``:
  the scheduler's fusion of independent kernels, a SwiGLU backward's products of the output
  gradient); the group allocates all its outputs before what dies in it is freed;
* the backward's saved tensors that AOTAutograd donates take a kernel's output in place once they
  die (``donated_inputs``).

* a value that would be computed inside its readers but that Inductor's lowering writes out
  (read by several nodes that cannot be one kernel, with more than 4 buffer reads in its loop
  body or, on CPU, an ``exp``/``log``/``sigmoid``/``tanh`` in it; or more than 12 reads on CPU, 8
  elsewhere) is a buffer where it stands (``realized_on_reuse``): HF Llama's recomputed residual
  stream, read by the final norm and by a block's norm later.

Not modelled under Inductor: its op-count limit on inlining, other fusions that move a kernel
(reductions, kernels of other sizes, reads shared below 1 MiB).
Measured on CPU (``tests/test_compiled_peak.py``, docs/memory_budget.md
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.graph.collectives import is_wait_node
from lynx_compile.memory.storage import HOST_OUTPUT_OPS, _bytes, _value, aliased_input, allocations


INDEX_OPS = frozenset({torch.ops.aten.index.Tensor, torch.ops.aten._unsafe_index.Tensor})
LOOP_OPS = INDEX_OPS | {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
                        torch.ops.aten.embedding.default}
"""Ops Inductor lowers as loop kernels besides pointwise ones: gathers (an embedding's forward
is an indirect load of its weight, a ``Pointwise`` in Inductor's ``lowering.py``; its sparse
form falls back to aten) and scatters into a copy."""

HEAVY_CPU_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh", "silu", "softplus"))
"""Ops whose loop body holds what Inductor calls a heavy op on CPU (``exp``, ``log``, ``log10``,
``log1p``, ``log2``, ``sigmoid``, ``tanh``: ``StorageBox.should_realize_on_reuse``; ``silu``
lowers to ``x * sigmoid(x)``, ``softplus`` to ``log1p(exp(x))``): a CPU value computed with one is
written out once it has more than one reader."""


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
    if node.target is torch.ops.aten.embedding.default:
        return not (node.args[4] if len(node.args) > 4 else node.kwargs.get("sparse", False))
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
    boolean indices, deterministic algorithms, an accumulate its atomics lack:
    ``_compat.inductor_atomic_add_falls_back``)."""
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
    return not (accumulate and _compat.inductor_atomic_add_falls_back(val.dtype))


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
        read_in_scatter: list[fx.Node] = []  # indices, values (and mask): not the copied input
        fx.node.map_arg(node.args[1:], read_in_scatter.append)
        return producer not in read_in_scatter or _scatter_in_loop(node)
    return _is_view(node) and bool(node.users) and all(_reads_in_loop(u, node, extern) for u in node.users)


def view_source(node: fx.Node) -> fx.Node:
    """The value a chain of views of ``node`` reads (``node`` itself when it is no view)."""
    while _is_view(node):
        base = aliased_input(node)
        if not isinstance(base, fx.Node):
            break
        node = base
    return node


def is_loop_kernel(node: fx.Node) -> bool:
    """``node`` is lowered as (part of) a loop kernel: a pointwise op, a gather, a reduction or a
    constant; not a matmul, attention, a collective or another extern kernel or fallback."""
    return node.op == "call_function" and not _is_barrier(node) and not _is_view(node)


def is_extern_kernel(node: fx.Node) -> bool:
    """``node`` runs outside Inductor's loop kernels: a matmul, attention, a collective, another
    extern kernel or fallback (a getitem of one's outputs too)."""
    return _is_barrier(node)


def reads_in_loop(node: fx.Node, producer: fx.Node) -> bool:
    """``node`` reads ``producer`` inside a loop kernel, directly or through views of it."""
    return _reads_in_loop(node, producer)


def _is_constant(node: fx.Node) -> bool:
    """A deterministic op with no tensor inputs (``full``, ``arange``, ``scalar_tensor``)."""
    return (node.op == "call_function" and not node.all_input_nodes and node.target not in HOST_OUTPUT_OPS
            and isinstance(node.meta.get("val"), torch.Tensor)
            and torch.Tag.nondeterministic_seeded not in _tags(node))


def index_values(nodes: list[fx.Node]) -> set[fx.Node]:
    """The values of ``nodes`` (a graph in order) computed from constants alone (``_is_constant``:
    ``iota``, ``full``) through pointwise ops and views: a causal mask built in the graph
    (``ones(T, T).triu(1)``, ``arange(T)[:, None] > arange(T)``), position ids. Inductor computes
    such a value from the loop's indices in every kernel that reads it, reading no memory; saved
    for the backward, it is written once in the forward and read from a buffer in each reader
    (on CPU, a boolean mask loaded as a vector mask: its forward softmax kernel ran 3x slower in
    gpt-tiny, fp32, torch 2.13)."""
    out: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        if _is_constant(n) or ((_is_loop(n) or _is_view(n)) and n.all_input_nodes
                               and torch.Tag.nondeterministic_seeded not in _tags(n)
                               and all(i in out for i in n.all_input_nodes)):
            out.add(n)
    return out


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


def written_to_be_saved(nodes: list[fx.Node]) -> set[fx.Node]:
    """The values of a forward graph ``nodes`` that Inductor writes out only because the graph
    returns them (saved for the backward): pointwise values every other reader reads inside a
    loop kernel, which :func:`realized_on_reuse` leaves unrealized. Not saved, they would be
    computed inside their readers' kernels and never written (a norm's normalized input, read
    only by its affine multiply)."""
    def read_in_loop_or_returned(node: fx.Node, producer: fx.Node) -> bool:
        if node.op == "output":
            return True
        if _is_view(node) and node.users:
            return all(read_in_loop_or_returned(u, node) for u in node.users)
        return _reads_in_loop(node, producer)

    # returned and read by some node: its readers are the output and others
    cands = {n for n in nodes if _is_loop(n) and {r.op == "output" for r in value_readers(n)} == {True, False}
             and all(read_in_loop_or_returned(u, n) for u in n.users)}
    return realized_on_reuse(nodes, cands)


def _expands_to(t: torch.Tensor, out: torch.Tensor) -> bool:
    try:
        return tuple(torch.broadcast_shapes(t.shape, out.shape)) == tuple(out.shape)
    except Exception:  # noqa: BLE001 - symbolic or incompatible shapes: no addmm
        return False


def splits_late_addmm(pos: dict[fx.Node, int], inp: fx.Node, a: fx.Node, b: fx.Node, out_bytes: int,
                      at: int) -> bool:
    """Whether ``split_late_addmm_pass`` moves the matmul ``a @ b``, added to ``inp`` at
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
    ``split_late_addmm_pass`` moves the matmul back to its operands only when ``inp`` comes
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


def interior_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes Inductor computes inside a later kernel: the ``fused_interior`` ones that its
    lowering does not write out (:func:`realized_on_reuse`), and the matmuls of
    :func:`late_addmms` (computed in their ``addmm``, whose add reads its addend from a buffer:
    that addend is no interior value)."""
    late = late_addmms(nodes)
    addmm_adds = frozenset(u for mm in late for u in mm.users)
    return realized_on_reuse(nodes, {n for n in nodes if fused_interior(n, addmm_adds)}) | late


def _fanout(node: fx.Node) -> int:
    """The most readers Inductor's lowering sees the value of ``node`` reused by: its own, or
    those of a view of it (a view's reuse realizes the value it views)."""
    out = len(node.users)
    for u in node.users:
        if _is_view(u):
            out = max(out, _fanout(u))
    return out


def value_readers(node: fx.Node) -> list[fx.Node]:
    """The nodes reading ``node``'s value, through views of it."""
    out = []
    for u in node.users:
        out.extend(value_readers(u) if _is_view(u) else [u])
    return out


def _is_barrier(n: fx.Node) -> bool:
    """A node that is no loop kernel and none of their parts (a matmul, an extern kernel)."""
    return n.op == "call_function" and not (_is_loop(n) or _is_view(n) or _is_constant(n)
                                            or torch.Tag.reduction in _tags(n))


def _readers_apart(node: fx.Node, pos: dict[fx.Node, int], barriers: list[int]) -> bool:
    """Whether ``node``'s readers cannot all be one kernel: a :func:`_is_barrier` node runs
    between the first and the last (``barriers[i]``: how many come before position ``i``).
    Where they can, a value Inductor writes out is read inside that kernel and never allocated
    (a SwiGLU backward's ``silu(gate)``, read by the two products of the output gradient that
    Inductor fuses)."""
    at = sorted(pos[u] for u in value_readers(node) if u in pos)
    return len(at) > 1 and barriers[at[-1]] > barriers[at[0] + 1]


def realized_on_reuse(nodes: list[fx.Node], fused: set[fx.Node]) -> set[fx.Node]:
    """Of the ``fused`` candidates (``fused_interior`` values), those Inductor's lowering leaves
    unrealized, computed inside their readers' kernels; the others it writes out as buffers
    where they stand (``GraphLowering.run_node``, in graph order):

    - a value read by more than one node (directly or through a view of it) whose loop body reads
      more than ``realize_reads_threshold`` buffers (4), or, on CPU, computes a heavy op
      (:data:`HEAVY_CPU_OPS`): HF Llama's recomputed residual stream ``embedding + mm + mm + ...``
      feeds the final norm at the backward's start and a block's norm much later: written out at
      the start, it lives there to the block;
    - any value whose loop body reads more than the accumulated-reads threshold (12 on CPU, 8
      elsewhere).

    Only where the readers are apart (:func:`_readers_apart`): readers that can be one kernel
    read the written-out value inside it. A value's loop body reads what its unrealized inputs
    read (through views), and each written-out input or graph input once. Not modelled: Inductor's op-count limit (a loop body of
    more than 50 ops on CPU, 30 elsewhere) and reads counted per index rather than per buffer."""
    reads: dict[fx.Node, frozenset] = {}
    heavy: dict[fx.Node, bool] = {}
    kept: set[fx.Node] = set()
    thresholds: dict[str, tuple[int, int]] = {}
    pos = {n: i for i, n in enumerate(nodes)}
    barriers = [0]
    for n in nodes:
        barriers.append(barriers[-1] + _is_barrier(n))

    for node in nodes:
        if node not in fused:
            continue
        r: set = set()
        h = node.target in HEAVY_CPU_OPS
        for i in node.all_input_nodes:
            src = view_source(i)
            if src in kept:
                r |= reads[src]
                h = h or heavy[src]
            elif not _is_constant(src):
                r.add(src)
        device = getattr(getattr(node.meta.get("val"), "device", None), "type", "cpu")
        if device not in thresholds:  # (Inductor's config, read once per device and graph)
            thresholds[device] = _compat.inductor_realize_thresholds(device)
        on_reuse, accumulated = thresholds[device]
        if len(r) > accumulated or (_fanout(node) > 1 and (len(r) > on_reuse or (device == "cpu" and h))
                                    and _readers_apart(node, pos, barriers)):
            continue  # written out: a buffer where it stands
        kept.add(node)
        reads[node], heavy[node] = frozenset(r), h
    return kept


def kernel_positions(nodes: list[fx.Node], interior: set[fx.Node]) -> dict[fx.Node, int]:
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
    (:func:`interior_nodes`)."""
    pos = {n: i for i, n in enumerate(nodes)}
    at: dict[fx.Node, int] = {}
    for node in reversed(nodes):
        at[node] = pos[node]
        if node in interior or _is_view(node):
            at[node] = max([at[u] for u in node.users if u.op != "output"] + [pos[node]])
    return at


FUSION_SHARED_BYTES = _compat.RECOMPUTE_FUSION_SHARED_BYTES
"""Bytes two independent kernels must read in common for :func:`fused_order` to fuse them:
below it, lynx's placements refuse a horizontal fusion with a recomputed kernel
(``_compat.refuses_horizontal_fusion``). Inductor fuses other kernels (and all of them in
torch.compile's own partitions) on any shared byte; smaller shared reads than this are not
modelled (a kernel left at its own position holds what it reads longer, never less)."""


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
