"""The one place lynx reaches into private torch APIs.

Everything here is called by keyword and filtered against the installed signature, because
these helpers change between releases (lynx supports torch 2.11 on the GPU machines and 2.13
here). When a helper moves, only this file changes.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch.utils.checkpoint import CheckpointPolicy

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED_TORCH = ((2, 11), (2, 13))


def check_torch_version() -> None:
    """Raise a clear error when the installed torch is outside the supported range."""
    lo, hi = SUPPORTED_TORCH
    if not (lo <= TORCH_VERSION <= hi):
        raise RuntimeError(
            f"lynx_compile supports torch {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]}, found {torch.__version__}; "
            f"install a supported build first, e.g. `pip install torch==2.13.0`."
        )


def _call_by_keyword(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` passing only the keyword arguments its installed signature accepts."""
    params = inspect.signature(fn).parameters
    accepts_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not accepts_var_kw:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def aot_autograd(**kwargs: Any) -> Any:
    """``torch._dynamo.backends.common.aot_autograd`` (stable across 2.11-2.13); a graph with
    data-dependent sizes compiled outside dynamo is refused (``refuse_unbacked_retrace``)."""
    from torch._dynamo.backends.common import aot_autograd as _aot

    compile_ = _aot(**kwargs)

    def compile_graph(gm: fx.GraphModule, example_inputs: Any, **kw: Any) -> Any:
        refuse_unbacked_retrace(gm)
        return compile_(gm, example_inputs, **kw)

    return compile_graph


def default_partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None):
    """torch's default partitioner. With ``node.meta["recompute"]`` tags it is the
    selective-activation-checkpoint partitioner: tagged nodes are recomputed, untagged
    producers of tagged nodes are saved, recomputed RNG ops replay their saved RNG state."""
    return _call_by_keyword(
        _partitioners.default_partition, joint_gm, joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )


def mark_side_effect(op: Any) -> None:
    """Keep ``op`` out of dead-code elimination (FX, AOTAutograd's partitioners, Inductor) though
    nothing reads its result: ``torch.fx.node.has_side_effect``."""
    from torch.fx.node import has_side_effect

    has_side_effect(op)


def canonicalize_joint(joint_gm: fx.GraphModule) -> fx.GraphModule:
    """Dead code out and common subexpressions merged (``functorch.config.cse``), in place:
    what torch's min-cut partitioner does to the joint graph on every call. Done once before
    any decision, so every decision names nodes every later partition still has."""
    from torch._functorch.compile_utils import fx_graph_cse

    joint_gm.graph.eliminate_dead_code()
    if _functorch_config.cse:
        joint_gm.graph = fx_graph_cse(joint_gm.graph)
    joint_gm.recompile()
    return joint_gm


def min_cut_partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None,
                      memory_budget: float = 1.0, compiler: str = "inductor"):
    """torch's min-cut partitioner with ``activation_memory_budget`` set for this call only.

    It honours ``meta["recompute"]`` tags (MUST_RECOMPUTE / PREFER_RECOMPUTE nodes are never
    saved, MUST_SAVE nodes never recomputed) and, for untagged nodes, recomputes what it judges
    free once Inductor fuses it (cheap pointwise chains): what ``torch.compile`` does by default."""
    with _functorch_config.patch(activation_memory_budget=float(memory_budget)):
        return _call_by_keyword(
            _partitioners.min_cut_rematerialization_partition, joint_gm, joint_inputs,
            num_fwd_outputs=num_fwd_outputs, compiler=compiler,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )


_MIN_CUT_META = ("recompute", "ac_graph_id", "partitioner_tag")


def _min_cut_key(graph: fx.Graph, node_info: Any, options: Any, dont_ban: Any) -> str:
    """What ``solve_min_cut`` answers depends on: the graph (structure and the recompute tags
    it honours), the node classification, the options, the nodes not to ban."""
    h = hashlib.sha256()
    for n in graph.nodes:
        h.update(n.format_node().encode())
        val = n.meta.get("val")
        h.update(repr((tuple(getattr(val, "shape", ())), getattr(val, "dtype", None),
                       *(str(n.meta.get(k)) for k in _MIN_CUT_META))).encode())
    h.update(repr(([i.name for i in node_info.inputs], sorted(x.name for x in node_info.required_fw_nodes),
                   sorted(x.name for x in node_info.required_bw_nodes), repr(options),
                   sorted(x.name for x in dont_ban or ()))).encode())
    return h.hexdigest()


@contextlib.contextmanager
def shared_min_cut_solves():
    """A context in which torch's min-cut solves are shared between partitions of one joint.

    ``choose_saved_values_set`` solves the min-cut up to three times per partition (runtime-
    optimized, more aggressive, aggressive; then a knapsack picks between them for the
    ``activation_memory_budget``) and the first three solves do not depend on the budget. lynx
    partitions one joint many times (the no-recompute reference, torch's min-cut at several
    settings, the baselines): each distinct solve (same graph, tags, options, unbanned nodes)
    runs once and is replayed by node name. Nested uses share the outer memo."""
    original = _partitioners.solve_min_cut
    if getattr(original, "_lynx_shared", False):
        yield
        return
    memo: dict[str, tuple[list[str], list[str]]] = {}

    def solve(joint_graph, node_info, min_cut_options, dont_ban=None):
        key = _min_cut_key(joint_graph, node_info, min_cut_options, dont_ban)
        if key not in memo:
            saved, banned = original(joint_graph, node_info, min_cut_options, dont_ban)
            memo[key] = ([n.name for n in saved], [n.name for n in banned])
            return saved, banned
        by_name = {n.name: n for n in joint_graph.nodes}
        saved, banned = memo[key]
        return [by_name[n] for n in saved], _partitioners.OrderedSet(by_name[n] for n in banned)

    solve._lynx_shared = True
    _partitioners.solve_min_cut = solve
    try:
        yield
    finally:
        _partitioners.solve_min_cut = original


class SameSavedValues(Exception):
    """Raised from inside torch's min-cut partition (``min_cut_stops_on_repeat``) once it has
    chosen a set of saved values that an earlier partition of the same joint chose: the rest of
    the partition would repeat that one. ``first``: the label that earlier partition was given."""

    def __init__(self, first: Any):
        super().__init__(first)
        self.first = first


@contextlib.contextmanager
def min_cut_stops_on_repeat(seen: dict, label: Any):
    """A context in which torch's min-cut partition stops, raising :class:`SameSavedValues`,
    right after ``choose_saved_values_set`` returns saved values (as a set of node names) already
    in ``seen``; otherwise records them there under ``label``. What follows that choice in
    ``min_cut_rematerialization_partition`` (extracting the forward and backward modules,
    functionalizing RNG, reordering the backward) depends only on the joint and the saved
    values, and costs ~3x the choice itself: torch's min-cut at several budgets often saves the
    same values (a 4-layer GPT-1.3B: 12 budgets, 6 distinct sets)."""
    original = _partitioners.choose_saved_values_set

    def choose(*args: Any, **kwargs: Any):
        saved = original(*args, **kwargs)
        key = frozenset(n.name for n in saved)
        if key in seen:
            raise SameSavedValues(seen[key])
        seen[key] = label
        return saved

    _partitioners.choose_saved_values_set = choose
    try:
        yield
    finally:
        _partitioners.choose_saved_values_set = original


def forward_node_names(joint_gm: fx.GraphModule) -> set[str]:
    """Names of the joint-graph nodes traced in the forward.

    aot_autograd traces the forward first and appends the backward, whose first node reads a
    tangent (named ``tangents_*``). Forward nodes are the ones before that point that do not
    depend on a tangent. This includes values only the backward reads (e.g. the ``detach`` of a
    softmax output saved by autograd), which torch's ``classify_nodes`` leaves unclaimed, and
    excludes backward-generated nodes that happen not to read a tangent (``t(weight)``)."""
    backward: set[fx.Node] = set()
    forward: set[str] = set()
    seen_backward = False
    for node in joint_gm.graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or any(
                a in backward for a in node.all_input_nodes):
            backward.add(node)
            seen_backward = seen_backward or node.op != "placeholder"
        elif not seen_backward and node.op != "output":
            forward.add(node.name)
    return forward


def is_sym_node(node: fx.Node) -> bool:
    from torch.fx.experimental.proxy_tensor import is_sym_node as _is_sym

    return bool(_is_sym(node))


def tag_recompute(node: fx.Node, group: int) -> None:
    """Tag a joint-graph node for recomputation in checkpoint region ``group``.

    Consecutive regions with different ids keep their boundary tensor saved (torch's
    ``cleanup_recompute_tags``), which is how each block input stays saved under ``full``."""
    node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    node.meta["ac_graph_id"] = group


def is_recompute_tagged(node: fx.Node) -> bool:
    return node.meta.get("recompute") in (
        CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def boxed(gm: fx.GraphModule) -> Callable[[list], Any]:
    """Compile ``gm`` to a Python function with the boxed calling convention.

    The generated code takes one list and clears it, so saved activations passed to the
    backward are freed at their last use instead of living until the backward returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def inductor_partitioner_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomPartitionerFn`` (2.9.1+): the base class of a
    partitioner that Inductor calls after its joint-graph passes (RNG replacement included)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_compile_with_partitioner(gm: fx.GraphModule, example_inputs: list, partitioner: Any,
                                      keep_placement: bool = True, post_grad: Callable | None = None,
                                      post_fusion: Callable | None = None,
                                      inner_compile: Callable | None = None,
                                      autograd_cache: bool = False) -> Callable:
    """Compile a dynamo graph with Inductor end to end (``compile_fx``: decompositions, joint
    passes, then ``partitioner`` instead of min-cut, post-grad passes, fused codegen) —
    ``torch.compile``'s own pipeline with only the partition replaced.

    ``keep_placement``: the settings of ``INDUCTOR_KEEP_PLACEMENT``. ``post_grad(graph)``: run
    on every post-grad graph after Inductor's own passes and the user's
    ``post_grad_custom_post_pass``, if any (``CustomGraphPass``, 2.11 and 2.13; its cache key is
    the hash of the file defining it, and its ``uuid()`` if it has one). ``post_fusion``: called
    with the scheduler's fused nodes of every graph this compile schedules (forward, backward),
    in run order (``config._post_fusion_custom_pass``, 2.11 and 2.13); it must return them.
    Inductor's FX-graph cache stays on, keyed on the pass by the hash of the file defining
    ``post_fusion``'s class (2.13: a ``CustomSchedulerPass``; 2.11: the pass pickled as that
    hash); a cache hit skips the scheduler, so ``post_fusion`` is not called. ``inner_compile``: what compiles each
    partitioned graph in place of ``compile_fx_inner`` (it gets the same arguments, the
    backward's with ``is_backward=True``; see :func:`inductor_compile_graph`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    adopt_unbacked_symbols(gm)
    patches: dict[str, Any] = {}
    if keep_placement:
        patches.update(INDUCTOR_KEEP_PLACEMENT)
    if post_grad is not None:
        patches["post_grad_custom_post_pass"] = _chained_post_grad_pass(inductor_config.post_grad_custom_post_pass,
                                                                        post_grad)
    if post_fusion is not None:
        patches.update(_scheduler_pass(post_fusion))
    # ``autograd_cache``: AOTAutograd's cache may return an earlier compile of this graph
    # without calling the partitioner (its key holds the partitioner's uuid); the caller then
    # restores the plan (lynx_compile.autograd_cache). Off, the partitioner always runs.
    # Inductor's FX-graph cache (of each partitioned graph) and its kernel caches stay on.
    # (config_patches, not a patch around the call: the backward may be compiled lazily, at the
    # first backward, and compile_fx re-applies these to every inner compile.)
    with inductor_config.patch(custom_partitioner_fn=_keyed_partitioner_class()(partitioner)), \
            _functorch_config.patch(enable_autograd_cache=autograd_cache
                                    and _functorch_config.enable_autograd_cache):
        if inner_compile is None:
            return compile_fx(gm, example_inputs, config_patches=patches or None)
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches or None)


def inductor_compile_graph(gm: fx.GraphModule, example_inputs: Any, donated: Any = None, **kwargs: Any) -> Callable:
    """Inductor's compile of one partitioned graph (``compile_fx_inner``: post-grad passes,
    fusion, codegen; a boxed callable), for an ``inner_compile`` of
    :func:`inductor_compile_with_partitioner` (``kwargs``: the ones it was given). ``donated``:
    the backward inputs whose buffers Inductor may reuse once read (AOTAutograd's
    ``bw_donated_idxs``, read from the compile's tracing context); None keeps the context's."""
    from torch._inductor.compile_fx import compile_fx_inner

    meta = _tracing_fw_metadata()
    if donated is None or meta is None or not hasattr(meta, "bw_donated_idxs"):
        return compile_fx_inner(gm, example_inputs, **kwargs)
    before = meta.bw_donated_idxs
    meta.bw_donated_idxs = list(donated)
    try:
        return compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        meta.bw_donated_idxs = before


def inductor_donated_inputs() -> list[int]:
    """The backward inputs AOTAutograd lets Inductor reuse (``bw_donated_idxs`` of the
    compile's tracing context; [] outside one)."""
    return list(getattr(_tracing_fw_metadata(), "bw_donated_idxs", None) or [])


def _tracing_fw_metadata() -> Any:
    """AOTAutograd's ``fw_metadata`` of the compile in progress (its tracing context), or None."""
    context = torch._guards.TracingContext.try_get()
    return context.fw_metadata if context is not None else None


def compute_intensive_ops() -> list:
    """The ops torch's min-cut partitioner never recomputes (``get_default_op_list()
    .compute_intensive_ops``: matmuls, convolutions, attention), as OpOverloadPackets."""
    from torch._functorch.partitioners import get_default_op_list

    return list(get_default_op_list().compute_intensive_ops)


def inductor_at_activation_budget(budget: float) -> Callable:
    """A dynamo backend: Inductor (``compile_fx``, what ``backend="inductor"`` runs) with
    ``torch._functorch.config.activation_memory_budget = budget`` while it compiles, where the
    min-cut partition reads it (the backward, compiled later, is already partitioned)."""
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
        with _functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs, **kwargs)

    inductor_at_budget.__name__ = f"inductor_at_budget_{budget:g}"
    return inductor_at_budget


def _scheduler_pass(fn: Callable[[list], list]) -> dict[str, Any]:
    """Inductor config patches installing ``fn`` as the post-fusion scheduler pass."""
    return {"_post_fusion_custom_pass": _scheduled_pass_class()(fn)}


@functools.lru_cache(maxsize=None)
def _keyed_partitioner_class() -> type:
    """A ``CustomPartitionerFn`` calling a partitioner, pickled as its class and lynx's source
    digest only. Inductor's FX-graph cache key pickles the whole config, this object included,
    for the forward (compiled inside the compile that partitions): the partitioner itself (with
    its per-compile record and timings) made that key differ in every process, so the forward
    never hit. The key is that of an already partitioned graph, which its code holds; what made
    the partition is not part of what Inductor compiles from it."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class KeyedPartitioner(CustomPartitionerFn):
        def __init__(self, fn: Any, uuid: Any = None):
            self.fn = fn
            self._uuid = uuid if fn is None else (type(fn).__qualname__, _lynx_source_digest())

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return self.fn(*args, **kwargs)

        def uuid(self) -> Any:
            return self.fn.uuid() if self.fn is not None else None

        def __reduce__(self) -> tuple:
            return (_unpickled_partitioner, (self._uuid,))

    KeyedPartitioner.__qualname__ = KeyedPartitioner.__name__ = "KeyedPartitioner"
    return KeyedPartitioner


def _unpickled_partitioner(uuid: Any) -> Any:
    """What a pickled ``KeyedPartitioner`` (in a cache key) loads as: one that partitions nothing."""
    return _keyed_partitioner_class()(None, uuid)


def _lynx_source_digest() -> str:
    from lynx_compile.source_digest import lynx_source_digest

    return lynx_source_digest()


@functools.lru_cache(maxsize=None)
def _scheduled_pass_class() -> type:
    """A ``CustomSchedulerPass`` (2.13) calling a function; its ``uuid`` (the hash of the file
    defining the function's class) is what Inductor's FX-graph cache key holds, and what it
    pickles of the config (the function itself may hold anything). 2.11 has no such class and
    pickles the config's ``_post_fusion_custom_pass`` as it is: the same object, pickled as its
    uuid, keys it there (lynx's pass reads the schedule, it changes nothing in it)."""
    from torch._inductor import custom_graph_pass

    base = getattr(custom_graph_pass, "CustomSchedulerPass", object)

    class ScheduledPass(base):
        def __init__(self, fn: Callable[[list], list] | None, uuid: Any = None):
            self.fn = fn
            self._uuid = uuid if fn is None else custom_graph_pass.get_hash_for_files(
                (inspect.getfile(type(fn)),), type(fn).__qualname__)

        def __call__(self, nodes: list) -> list:
            return self.fn(nodes) if self.fn is not None else nodes

        def uuid(self) -> Any:
            return self._uuid

        def __reduce__(self) -> tuple:
            return (_unpickled_scheduled_pass, (self._uuid,))

    ScheduledPass.__qualname__ = ScheduledPass.__name__ = "ScheduledPass"
    return ScheduledPass


def _unpickled_scheduled_pass(uuid: Any) -> Any:
    """What a pickled ``ScheduledPass`` (in a cache key) loads as: one that does nothing."""
    return _scheduled_pass_class()(None, uuid)


def _chained_post_grad_pass(user_pass: Any, fn: Callable[[fx.Graph], None]) -> Any:
    """A ``CustomGraphPass`` running the user's own post-grad pass(es), if any, then ``fn`` (a
    function, or an object whose ``uuid()`` says what else decides its rewrite)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    users = [p for p in (user_pass if isinstance(user_pass, (list, tuple)) else [user_pass]) if p is not None]

    class Chained(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            for p in users:
                p(graph)
            fn(graph)

        def uuid(self) -> Any:
            # fn's file and lynx's sources: fn calls helpers in other lynx modules, and a changed
            # helper must not reuse Inductor's FX-graph cache entries compiled with the old one
            src = fn if inspect.isfunction(fn) else type(fn)
            own = get_hash_for_files((inspect.getfile(src),), getattr(src, "__qualname__", ""))
            extra = (fn.uuid(),) if hasattr(fn, "uuid") else ()
            return (own, _lynx_source_digest(), *extra, *(p.uuid() if hasattr(p, "uuid") else repr(p) for p in users))

    return Chained()


def inductor_preserve_node_ordering(graph: fx.Graph, deps: dict) -> None:
    """Make each node in ``deps`` run after the nodes it maps to, in Inductor's schedule: torch's
    own ``control_deps`` ordering edges (``fx_passes.control_dependencies.preserve_node_ordering``,
    2.11 and 2.13, what Inductor's compute/communication overlap uses). Call from a post-grad pass."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    preserve_node_ordering(graph, {n: OrderedSet(d) for n, d in deps.items() if d})


def inductor_graph_input_names() -> list[str]:
    """Names of the inputs of the graph Inductor is compiling now (``V.graph.graph_inputs``,
    2.11 and 2.13); call from a ``post_fusion`` callback."""
    from torch._inductor.virtualized import V

    return list(V.graph.graph_inputs)


def inductor_schedule_memory(nodes: list, *, count_input: Callable[[str], bool],
                             count_output: bool) -> tuple[int, dict[str, int]]:
    """Inductor's own memory estimate of the graph it is scheduling now (call it from a
    ``post_fusion`` callback; ``torch._inductor.memory``, the model behind Inductor's
    ``reorder_for_peak_memory``, 2.11 and 2.13): buffers are allocated at their fused node and
    freed after their last reader; graph inputs Inductor can free (read by the graph) count from
    the start until their last reader.

    ``count_input(name)``: whether graph input ``name`` counts (parameters and the user's inputs
    do not: they are alive regardless). ``count_output``: whether the graph's outputs count (a
    forward's saved activations do; a backward's gradients are not activation memory). Returns
    (peak bytes, {counted input: bytes}); the peak is computed here from Inductor's buffer
    lifetimes (2.11's ``estimate_peak_memory`` mis-frees graph outputs)."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    graph_inputs = OrderedSet(V.graph.graph_inputs.keys())
    outputs = OrderedSet(V.graph.get_output_names())
    name_to_buf = {b.get_name(): b for n in nodes for b in n.get_outputs()}
    name_to_fused = {sn.get_name(): n for n in nodes for sn in n.get_nodes()}
    # prepare_planning_info stores its analysis on the nodes and buffers (mpi_node, mpi_buffer),
    # which the scheduler reads later (its topological sorts): put back what was there, so that
    # measuring the schedule does not change the code generated (it did: +12% peak on gpt-tiny).
    missing = object()
    saved = [(n, "mpi_node", getattr(n, "mpi_node", missing)) for n in nodes]
    saved += [(b, "mpi_buffer", getattr(b, "mpi_buffer", missing)) for b in name_to_buf.values()]
    try:
        _, freeable = memory.prepare_planning_info(nodes, name_to_buf, name_to_fused, graph_inputs, outputs)
        freeable = {k: v for k, v in freeable.items() if count_input(k)}
        infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
    finally:
        for obj, attr, value in saved:
            if value is missing:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
            else:
                setattr(obj, attr, value)
    delta = [0] * (len(nodes) + 2)
    for b in infos:
        name = b.buffer.get_name()
        if b.end_step == -1 and name in outputs and name not in freeable and not count_output:
            continue
        delta[b.start_step] += b.size_alloc
        if b.end_step != -1:
            delta[b.end_step + 1] -= b.size_free
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak, {k: v.mpi_buffer.size_free for k, v in freeable.items()}


INDUCTOR_KEEP_PLACEMENT = {
    # Inductor's scheduler may move a recompute far from where the partition put it: its
    # peak-memory reordering hoisted block 0's recompute to the start of the backward, and
    # horizontal fusion of independent kernels that share a tiny read (the causal mask) fused
    # block 0's recomputed softmax with block 1's. Either keeps both blocks' activations alive at
    # once: measured on gpt-tiny (batch 1, CPU), policy full peaked at 403 KB, above no
    # recompute (380 KB), predicted 214 KB; with both off it peaks at the predicted 214 KB.
    # Vertical (producer-consumer) fusion is untouched; only fusions of unrelated nodes sharing
    # less than this many bytes are refused. Not for policies none and torch, whose partition is
    # torch.compile's own (there Inductor's defaults hold less: gpt-tiny batch 2, torch at 0.5
    # measured 438 KiB with them, 502 KiB without).
    "reorder_for_peak_memory": False,
    "score_fusion_memory_threshold": 1 << 20,
    # Inductor's wrapper keeps a freed buffer (no `del`) to hand its storage to a later buffer of
    # the same size, whenever that keeps the graph under its own peak estimate, which counts the
    # gradients and is loose: HF Llama (4 layers, batch 2, seq 64, CPU) under full held a block's
    # attention scores (128 KB) through the MLP's backward, 99 KB above the peak without reuse.
    # Without it each buffer is freed after its last reader; a kernel that overwrites its input
    # in place still does (inplace_buffers).
    "allow_buffer_reuse": False,
}


def dynamo_passthrough_error() -> type:
    """``torch._dynamo.exc.ShortenTraceback``: an exception a backend raises that dynamo re-raises
    as is (any other is wrapped in ``BackendCompilerFailed``, whose message starts with dynamo's
    text); a subclass must set ``first_useful_frame`` (None: keep the whole traceback)."""
    from torch._dynamo.exc import ShortenTraceback

    return ShortenTraceback


def is_inductor_seeds(node: fx.Node) -> bool:
    """``prims.inductor_seeds``: the one nondeterministic node Inductor's RNG replacement leaves.

    Inductor's joint pass rewrites every ``rand``/dropout into ``inductor_random(shape,
    inductor_lookup_seed(seeds, i))``, which is a pure function of the ``seeds`` tensor: saving
    that small int64 tensor makes every recomputed random op draw the forward's numbers."""
    prims = getattr(torch.ops, "prims", None)
    op = getattr(getattr(prims, "inductor_seeds", None), "default", None)
    return op is not None and node.op == "call_function" and node.target is op


def node_is_random(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and hasattr(target, "tags")
            and torch.Tag.nondeterministic_seeded in target.tags)


def is_rng_replay(node: fx.Node) -> bool:
    """A backward node that re-runs an RNG op from its saved state (``run_with_rng_state``)."""
    return node.target is getattr(torch._prims.rng_prims, "run_with_rng_state", None)


@contextlib.contextmanager
def eager_dispatch():
    """Run real ops at eager speed from inside a compile.

    aot_autograd calls the partitioner with the Python dispatcher enabled and its fake mode on
    the mode stack; real ops run under them cost ~100 us of Python each (measured: a 256x64x192
    mm took 150 us inside the partitioner, 35 us outside). Measured costs must not include that."""
    from torch._dispatch.python import no_python_dispatcher
    from torch.utils._python_dispatch import _disable_current_modes

    with no_python_dispatcher(), _disable_current_modes():
        yield


# ---------------------------------------------------------------------------------------------
# Version-portable wrappers for the private APIs the rest of lynx uses (torch 2.11-2.13).
# Nothing outside this file imports torch._*, torch.fx.experimental.*, torch.distributed._*,
# torch.testing._internal or torch.utils._*; each wrapper names where the API differs.
# ---------------------------------------------------------------------------------------------

def optimization_hint(x: Any, fallback: int | None = None) -> int:
    """The size hint of an int / SymInt: ``symbolic_shapes.optimization_hint`` (2.13), else
    ``size_hint`` (2.11-2.12, where ``hint_int`` is its deprecated alias); all take
    ``(a, fallback=None)``."""
    from torch.fx.experimental import symbolic_shapes

    fn = (getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "size_hint", None)
          or symbolic_shapes.hint_int)
    return fn(x, fallback=fallback)


@contextlib.contextmanager
def static_tracing(example_inputs: list):
    """A tracing context like dynamo's, for compiling a graph again outside dynamo (a piece
    recompiled with the step's plan): a fake mode with its own ``ShapeEnv``, and the example
    inputs as fake tensors of static shapes in it (yielded). Without a shape env AOTAutograd's
    and Inductor's caches bypass the compile ("No shape env"); real inputs would be fakified
    with dynamic sizes there, a symbolic compile of another graph."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(t, static_shapes=True) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with tracing(TracingContext(mode)):
        yield fakes


def detect_fake_mode(values: Any) -> Any:
    """The FakeTensorMode of ``values`` (``torch._guards.detect_fake_mode``), or None."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(values)


def tree_leaves(tree: Any) -> list:
    """``torch.utils._pytree.tree_leaves`` (no public pytree module on 2.11-2.13)."""
    import torch.utils._pytree as pytree

    return pytree.tree_leaves(tree)


def rename_node(node: fx.Node, name: str) -> None:
    """Rename an FX node in place, keeping the graph's namespace unique (``Node._rename``)."""
    node._rename(name)


def is_op_overload(op: Any) -> bool:
    """An ``OpOverload`` or ``OpOverloadPacket`` (``torch.ops.ns.name[.overload]``)."""
    return isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def qualified_op_name(op: Any) -> str:
    """"ns::name[.overload]" for an OpOverload / OpOverloadPacket, else ``str(op)``."""
    if isinstance(op, torch._ops.OpOverload):
        return op.name()
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return str(op)


def record_function_ops() -> tuple[Any, Any]:
    """The ops a traced ``torch.profiler.record_function`` range lowers to: (enter, exit)."""
    ops = torch.ops.profiler
    return ops._record_function_enter_new.default, ops._record_function_exit._RecordFunction


def cpu_allocation_events(prof: Any, device_type: str = "cpu") -> list[tuple[int, int, int]]:
    """(time ns, address, signed bytes) of every allocator event on ``device_type`` a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order (read from the
    kineto event tree: ``torch._C._profiler._EventType.Allocation``)."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == device_type:
            out.append((node.start_time_ns, node.typed[1].ptr, node.typed[1].alloc_size))
        stack.extend(node.children)
    return sorted(out)


def inductor_metrics() -> Any:
    """``torch._inductor.metrics``: Inductor's counters of what it generated (kernels, bytes
    accessed, IR nodes; ``reset()`` before a compile). Turns on ``num_bytes_accessed``, which
    Inductor counts only while its ``inductor_metrics`` log is on (2.11 and 2.13): that log is
    enabled here with its output discarded."""
    import logging

    from torch._inductor import compile_fx, metrics

    log = compile_fx.inductor_metrics_log
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    return metrics


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters`` (e.g. ``["inductor"]["fxgraph_cache_hit"]``)."""
    from torch._dynamo.utils import counters

    return counters


@contextlib.contextmanager
def inductor_output_code():
    """Yields a list that receives the output code (wrapper and kernels) of every graph Inductor
    compiles inside the block (``GraphLowering.save_output_code``)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append, create=True):
        yield codes


def profiler_marks(prof: Any, prefix: str) -> dict[str, int]:
    """Start time (ns, the clock of :func:`cpu_allocation_events`) of every ``record_function``
    range whose name starts with ``prefix`` in a finished profile, by name."""
    from torch._C._profiler import _EventType

    out: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.TorchOp and node.name.startswith(prefix):
            out[node.name] = node.start_time_ns
        stack.extend(node.children)
    return out


def profiler_running() -> bool:
    """Whether an autograd profiler (``torch.profiler.profile``) is collecting in this thread."""
    return bool(torch.autograd._profiler_enabled())


def engine_run_backward_code() -> Any:
    """The code object of the Python function that calls the autograd engine
    (``torch.autograd.graph._engine_run_backward``: ``Tensor.backward`` and ``autograd.grad``
    both go through it), or None where it is not there. Once it returns, the engine has
    restored the thread's state it saved when the backward started."""
    try:
        from torch.autograd.graph import _engine_run_backward

        return _engine_run_backward.__code__
    except (ImportError, AttributeError):
        return None


def backward_roots(frame: Any) -> Any:
    """The roots (tensors or gradient edges) of a backward, from the frame of a call of
    :func:`engine_run_backward_code`'s function (its first argument, ``t_outputs``)."""
    return frame.f_locals.get("t_outputs", ())


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass now executing ends (call from inside it: a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


@functools.lru_cache(maxsize=None)
def backward_holds_grad_inputs() -> bool:
    """Whether aot_autograd's ``CompiledFunction.backward`` keeps the incoming output gradients
    (the backward graph's ``tangents_*``) alive until the compiled backward returns.

    torch 2.11 passes them as the ``*flat_args`` tuple of ``backward(ctx, *flat_args)`` and holds
    it for the whole call, so the boxed backward cannot free them at their last use (measured: a
    gpt-tiny step peaks one logits gradient, 64 KiB, above the prediction). torch 2.13's
    generated backward prologue clears ``flat_args`` first (``flat_args.clear()``), so they die
    at their last use like every other input."""
    try:
        from torch._functorch._aot_autograd import runtime_wrappers

        return "flat_args.clear()" not in inspect.getsource(runtime_wrappers)
    except (ImportError, OSError, TypeError):
        return TORCH_VERSION < (2, 13)


def backward_donates_saved() -> bool:
    """Whether AOTAutograd lets Inductor write into the backward's saved tensors once they die
    (``torch._functorch.config.donated_buffer``, on by default in 2.11 and 2.13: the saved
    tensors that alias no forward input or output are ``bw_donated_idxs``)."""
    from torch._functorch import config as functorch_config

    return bool(getattr(functorch_config, "donated_buffer", False))


# --- torch.distributed (private parts) -------------------------------------------------------

def c10d_bindings() -> Any:
    """``torch._C._distributed_c10d``: the option structs (``AllgatherOptions`` is not
    re-exported by ``torch.distributed``) and ``ProcessGroupGloo``."""
    from torch._C import _distributed_c10d

    return _distributed_c10d


def work_from_future(fut: Any) -> Any:
    """A c10d ``Work`` that completes with ``fut`` (``_create_work_from_future``)."""
    return c10d_bindings()._create_work_from_future(fut)


def default_store() -> Any:
    """The default process group's store (``distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: importing ``fake_pg`` registers the
    "fake" backend (collectives trace but move no data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def _functional_collectives() -> Any:
    import torch.distributed._functional_collectives as fc

    return fc


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    """Wait an eager functional collective's ``AsyncCollectiveTensor``; other tensors (under
    tracing they already end in ``wait_tensor``) pass through."""
    fc = _functional_collectives()
    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def functional_all_reduce(x: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``_c10d_functional.all_reduce`` (+ ``wait_tensor``); not waited."""
    return _functional_collectives().all_reduce(x, op, group)


def functional_all_gather(x: torch.Tensor, gather_dim: int, group: Any) -> torch.Tensor:
    """All-gather concatenated along ``gather_dim`` (``_c10d_functional.all_gather_into_tensor``,
    then chunk + cat): ``all_gather_single`` on 2.13. Before it (2.11), ``all_gather_tensor``
    re-concatenates through ``torch._utils._maybe_view_chunk_cat``, which dynamo skips: inside an
    autograd.Function that is a graph break. So there lynx gathers along dim 0 and does the chunk
    + cat itself (the same ops, traceable)."""
    fc = _functional_collectives()
    single = getattr(fc, "all_gather_single", None)
    if single is not None:
        return single(x, gather_dim, group)
    out = fc.all_gather_tensor(x, 0, group)
    if gather_dim % x.dim() == 0:
        return out
    out = wait_collective(out)
    return torch.cat(torch.chunk(out, out.size(0) // x.size(0), dim=0), dim=gather_dim)


def functional_reduce_scatter(x: torch.Tensor, op: str, scatter_dim: int, group: Any) -> torch.Tensor:
    """Reduce-scatter along ``scatter_dim`` (``_c10d_functional.reduce_scatter_tensor``):
    ``reduce_scatter_single`` on 2.13, ``reduce_scatter_tensor`` before."""
    fc = _functional_collectives()
    fn = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
    return fn(x, op, scatter_dim, group)


# --- torch.distributed.pipelining (private parts) ----------------------------------------------

def pipeline_schedule_actions(schedule_class: type, ranks: int, stages_per_rank: int,
                              num_microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per rank, the compute actions of a ``torch.distributed.pipelining`` schedule class in the
    order it runs them: ``(type, stage, micro-batch)`` with torch's type letters (``"F"``
    forward, ``"I"`` input-gradient backward, ``"W"`` weight-gradient backward, ``"B"`` whole
    backward); its bubbles (``None``) and non-compute actions dropped.

    torch builds the order (``schedule.pipeline_order``: rank -> list of ``_Action`` or None) in
    the schedule's constructor from the stages' ``group_size`` / ``num_stages`` alone, for every
    rank, so mock stages stand in for a process group. This is the construction of torch's own
    ``pipelining._schedule_visualizer.get_schedule_ops`` (2.11 and 2.13), which lynx does not call
    because it refuses one stage per rank for the multi-stage classes. Checked on torch 2.11 and
    2.13 for ``ScheduleZBVZeroBubble`` and ``ScheduleInterleavedZeroBubble``."""
    from unittest import mock

    from torch.distributed.pipelining import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, ranks, None
    stage.num_stages = ranks * stages_per_rank
    schedule = schedule_class([stage] * stages_per_rank, num_microbatches)
    return [[(a.computation_type.value, a.stage_index, a.microbatch_index)
             for a in schedule.pipeline_order[rank]
             if a is not None and a.computation_type.value in ("F", "I", "W", "B")]
            for rank in range(ranks)]


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base class of a mode that sees
    every aten op a forward runs (same module and interface on 2.11 and 2.13)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def min_cut_counts_script_objects_as_zero():
    """A context in which torch's min-cut partition (below budget 1) counts an opaque graph
    input (a DTensor graph's process group, a ``FakeScriptObject``) as zero bytes instead of
    raising (``unsafe_treat_script_objects_as_zero_size``, torch 2.13; a no-op where the flag is
    missing). Sound for lynx's candidates: a process group holds no activations, and lynx
    simulates whatever partition it gets back exactly."""
    if hasattr(_functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        return _functorch_config.patch(unsafe_treat_script_objects_as_zero_size=True)
    return contextlib.nullcontext()


def inductor_atomic_add_falls_back(dtype: torch.dtype) -> bool:
    """Whether Inductor computes an accumulating scatter of ``dtype`` with aten's kernel instead
    of its own (``torch._inductor.utils.needs_fallback_due_to_atomic_add_limitations``: its
    atomics lack int64, bool, and bfloat16 below compute capability 9.0)."""
    from torch._inductor.utils import needs_fallback_due_to_atomic_add_limitations

    return needs_fallback_due_to_atomic_add_limitations(dtype)


def inductor_cache_dir() -> str:
    """torch.compile's on-disk cache directory (``TORCHINDUCTOR_CACHE_DIR``, else torch's
    default under the temp directory), where lynx keeps what must be the same in every process
    of a machine (the calibrated CPU profile)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - present on 2.11-2.13
        import getpass
        import tempfile

        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return cache_dir()


def fsdp2_groups_holding(tensors: list) -> list[tuple[int, bool, int]]:
    """Per FSDP2 (``fully_shard``) parameter group whose unsharded parameters are among
    ``tensors`` (by identity: dynamo hands a block's unsharded parameters to the backend during
    its forward): ``(shard world size, resharded after forward, unsharded bytes of the group)``.
    Empty without FSDP2. Reads ``torch.distributed._composable_state._module_state_mapping``
    and each state's param groups (``_fsdp_param_groups`` on 2.13, ``_fsdp_param_group`` on 2.11)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # pragma: no cover - present on 2.11-2.13
        return []
    ids = {id(t) for t in tensors if isinstance(t, torch.Tensor)}
    out = []
    for state in list(_module_state_mapping.values()):
        state = state() if isinstance(state, weakref.ref) else state  # weak references on 2.13
        if not isinstance(state, FSDPState):
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = state.__dict__.get("_fsdp_param_group")
            groups = [group] if group is not None else []
        for group in groups:
            params = [getattr(fp, "_unsharded_param", None) for fp in group.fsdp_params]
            if not any(p is not None and id(p) in ids for p in params):
                continue
            nbytes = sum(p.numel() * p.element_size() for p in params if p is not None)
            mesh = group.mesh_info
            out.append((int(getattr(mesh, "shard_mesh_size", 1)), group.post_forward_mesh_info is not None, nbytes))
    return out



# --- unbacked SymInts (data-dependent sizes: expert-parallel token counts) ----------------------

def adopt_unbacked_symbols(gm: fx.GraphModule) -> None:
    """Declare the unbacked symbols ``gm``'s nodes bind (``node.meta["unbacked_bindings"]``:
    ``u0``, ``u1``, ... of a ``.tolist()`` / ``.item()``, e.g. expert-parallel token counts) in
    the current tracing context's ``ShapeEnv`` where it lacks them, and number its new ones past
    them. Needed when a dynamo graph is traced again in a ``ShapeEnv`` of its own
    (``static_tracing``: a piece compiled again with the step's plan): the retrace makes new
    symbols and ``rebind_unbacked`` renames each to the name the node recorded, which fails
    when the new one has that name ("u0 possible memo disaster", counters that both start at 0)
    or when the name is unknown to the ShapeEnv (``var_to_range`` None). A no-op in dynamo's
    own ShapeEnv (it made them). Private: ``ShapeEnv.unbacked_symint_counter``,
    ``create_unbacked_symint``, ``var_to_range``, ``pending_fresh_unbacked_symbols`` (torch 2.13)."""
    from torch._guards import TracingContext
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    ctx = TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if env is None:
        return
    names = {s for n in gm.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})}
    missing = sorted((s for s in names if s not in env.var_to_range and symbol_is_type(s, SymT.UNBACKED_INT)),
                     key=lambda s: int(str(s)[1:]))
    if not missing:
        return
    top = max(int(str(s)[1:]) for s in names if symbol_is_type(s, SymT.UNBACKED_INT))
    for s in missing:
        env.unbacked_symint_counter = int(str(s)[1:])
        made = env.create_unbacked_symint().node.expr
        if made != s:
            raise RuntimeError(f"lynx: cannot declare the unbacked symbol {s} of a graph compiled again "
                               f"(made {made}); compile without the step's plan (budget_scope 'saved')")
        # declared, not the output of an op being traced: nothing is to bind it
        env.pending_fresh_unbacked_symbols[:] = [p for p in env.pending_fresh_unbacked_symbols if p != s]
    env.unbacked_symint_counter = max(env.unbacked_symint_counter, top + 1)


def refuse_unbacked_retrace(gm: fx.GraphModule) -> None:
    """Raise (one line) when ``gm`` binds unbacked symbols and no tracing context is active:
    AOTAutograd would fakify real example inputs without a ``ShapeEnv`` and fail deep inside
    with ``DataDependentOutputException: aten._local_scalar_dense`` (the ``.item()`` /
    ``.tolist()`` that made them). Seen when ``compiler="eager"`` compiles a piece again with
    the step's plan (real inputs, no ``static_tracing``) on expert-parallel MoE."""
    from torch._guards import TracingContext

    if TracingContext.try_get() is not None:
        return
    names = sorted({str(s) for n in gm.graph.nodes for s in (n.meta.get("unbacked_bindings") or {})})
    if names:
        raise NotImplementedError(
            f"lynx: compiler='eager' cannot compile again, for the step's plan, a graph with data-dependent "
            f"sizes (aten._local_scalar_dense: .item()/.tolist(), unbacked {', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}; e.g. expert-parallel token counts); use compiler='inductor' "
            "(the default)")


# --- DTensor stand-ins (a piece compiled again after its inputs are gone) ---------------------

def dtensor_layout(t: Any) -> tuple | None:
    """What a stand-in for the DTensor ``t`` needs (``dtensor_stand_in``): its local shard's shape
    and stride, mesh, placements, global shape and stride, and whether the local shard is an
    ``AsyncCollectiveTensor`` (a collective's output not yet waited on: sequence-parallel TP's
    block inputs); None when ``t`` is no DTensor. Private: ``DTensor._local_tensor``,
    ``torch.distributed._functional_collectives.AsyncCollectiveTensor``."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return None
    if not isinstance(t, DTensor):
        return None
    local = t._local_tensor
    return (tuple(local.shape), local.stride(), t.device_mesh, tuple(t.placements), tuple(t.shape), t.stride(),
            isinstance(local, AsyncCollectiveTensor))


def dtensor_stand_in(local: torch.Tensor, layout: tuple) -> Any:
    """A DTensor laid out as ``layout`` (``dtensor_layout``) over the plain tensor ``local``, its
    local shard wrapped as an ``AsyncCollectiveTensor`` where the original's was: AOTAutograd
    unwraps nested subclasses when it compiles, so a compile on a plain local shard makes code
    that is handed the unwaited wrapper itself at run time (its data pointer is null: a
    segfault in the first kernel, seen on torchtitan's TP at a budget). No communication."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    _, _, mesh, placements, shape, stride, async_local = layout
    if async_local:
        local = AsyncCollectiveTensor(local)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)
