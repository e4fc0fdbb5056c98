"""AOTAutograd's entry and its partitioners: torch's default and min-cut partitions of a joint
graph, the min-cut's solves shared or cut short between partitions of one joint, and the
checkpoint tags (``node.meta["recompute"]``) both partitioners honour.

Partitioners are called by keyword and filtered against the installed signature
(``_call_by_keyword``): their arguments change between releases.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch.utils.checkpoint import CheckpointPolicy

from lynx_compile._compat.fx_utils import is_sym_node
from lynx_compile._compat.knapsack import knapsack_off_the_allocator
from lynx_compile._compat.tracing import detect_fake_mode, refuse_unbacked_retrace


@contextlib.contextmanager
def _no_fresh_unbacked_symbols(joint_gm: fx.GraphModule):
    """Leave the joint's ShapeEnv with the unbacked symbols it had pending. Below budget 1
    torch's min-cut prices each node by running it on fake tensors (``estimate_runtime`` under
    the flop counter); a ``.item()`` there (``_local_scalar_dense``: an MoE block's routed
    counts) makes a fresh unbacked symbol that no graph binds, and Inductor's fake propagation
    of the compiled graph then fails with ``PendingUnbackedSymbolNotFound`` (torch.compile with
    ``activation_memory_budget`` < 1 alike; lynx partitions with min-cut several times per
    graph). Private: ``ShapeEnv.pending_fresh_unbacked_symbols`` (2.11-2.13; torch's own
    ``bucketing`` pass restores it the same way)."""
    mode = detect_fake_mode([n.meta.get("val") for n in joint_gm.graph.find_nodes(op="placeholder")])
    env = getattr(mode, "shape_env", None)
    pending = getattr(env, "pending_fresh_unbacked_symbols", None)
    before = list(pending) if pending is not None else None
    try:
        yield
    finally:
        if before is not None:
            env.pending_fresh_unbacked_symbols[:] = before


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
    fw, bw = _call_by_keyword(
        _partitioners.default_partition, joint_gm, joint_inputs,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
    )
    _saved_as_aot_autograd_needs(fw, bw, num_fwd_outputs)  # (it replays recomputed RNG ops alike)
    return fw, bw


def canonicalize_joint(joint_gm: fx.GraphModule) -> fx.GraphModule:
    """Dead code out and common subexpressions merged (``functorch.config.cse``), in place:
    what torch's min-cut partitioner does to the joint graph on every call. Done once before
    any decision, so every decision names nodes every later partition still has."""
    from torch._functorch.compile_utils import fx_graph_cse

    joint_gm.graph.eliminate_dead_code()
    if _functorch_config.cse:
        joint_gm.graph = fx_graph_cse(joint_gm.graph)
        setattr(joint_gm.graph, _MERGED, len(joint_gm.graph.nodes))
    joint_gm.recompile()
    return joint_gm


_MERGED = "_lynx_subexpressions_merged"
"""Set by :func:`canonicalize_joint` on the graph it merged: its node count then."""


def _merged_already(graph: fx.Graph) -> bool:
    """``graph`` is one :func:`canonicalize_joint` merged, with no node added since (lynx's
    passes on the joint only tag it; torch's partitioner only removes dead code): merging it
    again would rebuild the same graph. A copy of it (``copy.deepcopy``) is not marked."""
    count = getattr(graph, _MERGED, None)
    return count is not None and len(graph.nodes) <= count


def min_cut_partition(joint_gm: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                      static_lifetime_input_indices: list[int] | None = None,
                      memory_budget: float = 1.0, compiler: str = "inductor"):
    """torch's min-cut partitioner with ``activation_memory_budget`` set for this call only.

    It honours ``meta["recompute"]`` tags (MUST_RECOMPUTE / PREFER_RECOMPUTE nodes are never
    saved, MUST_SAVE nodes never recomputed) and, for untagged nodes, recomputes what it judges
    free once Inductor fuses it (cheap pointwise chains): what ``torch.compile`` does by default.

    On a joint :func:`canonicalize_joint` merged, torch's own merging of common subexpressions
    (``functorch.config.cse``, a rebuild of the whole graph on every call) is skipped: it would
    give the same graph (lynx partitions one joint up to ~15 times while planning).

    Its choice of saved values is remembered in this process (:func:`_remembered_choices`): the
    same graph, tags and setting partitioned again is not solved again.

    Its knapsack runs off torch's allocator (:func:`knapsack_off_the_allocator`): a graph planned
    inside a step would otherwise allocate torch's DP table beside the step's activations."""
    cse = _functorch_config.cse and not _merged_already(joint_gm.graph)
    with _functorch_config.patch(activation_memory_budget=float(memory_budget), cse=cse), \
            knapsack_off_the_allocator(), _no_fresh_unbacked_symbols(joint_gm), _remembered_choices():
        fw, bw = _call_by_keyword(
            _partitioners.min_cut_rematerialization_partition, joint_gm, joint_inputs,
            num_fwd_outputs=num_fwd_outputs, compiler=compiler,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    _saved_as_aot_autograd_needs(fw, bw, num_fwd_outputs)
    return fw, bw


def _saved_as_aot_autograd_needs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """What every partition torch makes for lynx gets before AOTAutograd compiles it: saved RNG
    states before the opaque saved values (:func:`tensors_before_opaque`), a graph input's wait
    saved as the input (:func:`inputs_saved_for_their_waits`)."""
    tensors_before_opaque(fw, bw, num_fwd_outputs)
    inputs_saved_for_their_waits(fw, num_fwd_outputs)


def inputs_saved_for_their_waits(fw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """A saved ``_c10d_functional.wait_tensor(x)`` of a graph input ``x`` saved as ``x`` itself,
    in place; True if any was.

    ``wait_tensor`` returns its argument (the same storage) though its schema says it makes a new
    tensor. AOTAutograd donates the backward the saved values that are not forward inputs or
    outputs, and Inductor then writes into a donated buffer once its last use is read: a
    recomputed ``pow`` of the saved ``wait_tensor`` of a block's input (torchtitan's TP
    sequence-parallel input, an unwaited collective) was written over that input, which the
    backward read again (deepseek_v3's RMSNorm under TP, 2 gloo ranks: gradient norms 3e-4 apart
    from Inductor's at step 1). Saved as the input it is, it is not donated. Same values, same
    storage: the forward waited on it already."""
    out = fw.graph.output_node()
    outs = list(out.args[0])
    changed = False
    for i in range(num_fwd_outputs, len(outs)):
        n = outs[i]
        if (isinstance(n, fx.Node) and n.op == "call_function"
                and n.target is torch.ops._c10d_functional.wait_tensor.default
                and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder"):
            outs[i] = n.args[0]
            changed = True
    if changed:
        out.args = (tuple(outs), *out.args[1:])
        fw.recompile()
    return changed


try:
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node as _is_opaque
except ImportError:  # torch 2.11: no opaque saved values
    def _is_opaque(node: Any) -> bool:
        return False


def tensors_before_opaque(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Saved RNG states moved before the saved opaque objects, in place; True if any moved.

    AOTAutograd saves a forward's outputs for the backward as (tensors, opaque objects such
    as a DTensor graph's ``DeviceMesh``, SymInts), in that order. torch's min-cut appends the
    RNG state of each recomputed random op (``functionalize_rng_ops``) just before the SymInts,
    after the opaque objects, and its backward's placeholders likewise: a graph that saves a
    ``DeviceMesh`` and recomputes a random op then fails at its first forward ("expected all
    tensors_saved_with_vc_check to be Tensors", torchtitan's llama3 with TP under a budget,
    torch 2.13). The tensors after the first opaque output (those states) go before it, in the
    forward's outputs and the backward's matching placeholders."""
    out = fw.graph.output_node()
    outs = list(out.args[0])
    saved = outs[num_fwd_outputs:]
    first = next((i for i, n in enumerate(saved) if _is_opaque(n)), None)
    if first is None:
        return False
    late = [i for i, n in enumerate(saved) if i > first and isinstance(n, fx.Node) and not _is_opaque(n)
            and not is_sym_node(n)]
    if not late:
        return False
    order = list(range(first)) + late + [i for i in range(first, len(saved)) if i not in late]
    # the backward reads them as its placeholders after its SymInts (which lead there; the
    # forward returns its SymInts last)
    syms = sum(1 for n in saved if isinstance(n, fx.Node) and is_sym_node(n))
    mine = list(bw.graph.find_nodes(op="placeholder"))[syms:len(saved)]
    if len(mine) != len(saved) - syms or not all(isinstance(n, fx.Node) and is_sym_node(n) for n in saved[len(mine):]):
        raise AssertionError("lynx: the backward's saved placeholders do not match the forward's saved outputs")
    anchor = mine[first]
    for i in late:
        anchor.prepend(mine[i])
    out.args = (tuple(outs[:num_fwd_outputs] + [saved[i] for i in order]), *out.args[1:])
    fw.recompile()
    bw.recompile()
    return True


def min_cut_counts_script_objects_as_zero():
    """A context in which torch's min-cut partition (below budget 1) counts an opaque graph
    input (a DTensor graph's process group, a ``FakeScriptObject``) as zero bytes instead of
    raising (``unsafe_treat_script_objects_as_zero_size``, torch 2.13; a no-op where the flag is
    missing). Sound for lynx's candidates: a process group holds no activations, and lynx
    simulates whatever partition it gets back exactly."""
    if hasattr(_functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        return _functorch_config.patch(unsafe_treat_script_objects_as_zero_size=True)
    return contextlib.nullcontext()


def compute_intensive_ops() -> list:
    """The ops torch's min-cut partitioner never recomputes (``get_default_op_list()
    .compute_intensive_ops``: matmuls, convolutions, attention), as OpOverloadPackets."""
    from torch._functorch.partitioners import get_default_op_list

    return list(get_default_op_list().compute_intensive_ops)


_MIN_CUT_META = ("recompute", "ac_graph_id", "partitioner_tag")


def _min_cut_key(graph: fx.Graph, node_info: Any, options: Any, dont_ban: Any) -> str:
    """What ``solve_min_cut`` answers depends on: the graph and its classification
    (:func:`_answer_key`), the options, the nodes not to ban; of functorch's config, all but the
    budget (a solve does not read it, and every setting shares the solve)."""
    return _answer_key(graph, node_info, (repr(options), sorted(x.name for x in dont_ban or ())),
                       config_but=("activation_memory_budget",))


def _answer_key(graph: fx.Graph, node_info: Any, asked: Any, config_but: tuple[str, ...] = ()) -> str:
    """The key of an answer of torch's min-cut remembered for the process: the graph (structure,
    shapes and the recompute tags it honours), the node classification, what was ``asked``
    (its ``repr``), functorch's config but ``config_but``."""
    def names(nodes: Any) -> list[str]:
        return sorted(n.name for n in nodes)

    h = hashlib.sha256(_structure_digest(graph).encode())
    h.update(repr([tuple(str(n.meta.get(k)) for k in _MIN_CUT_META) for n in graph.nodes]).encode())
    h.update(repr(([i.name for i in node_info.inputs], names(node_info.required_fw_nodes),
                   names(node_info.required_bw_nodes), names(getattr(node_info, "unclaimed_nodes", ())),
                   names(getattr(node_info, "static_lifetime_input_nodes", ())), asked)).encode())
    h.update(_config_digest(but=config_but).encode())
    return h.hexdigest()


def _config_digest(but: tuple[str, ...] = ()) -> str:
    """functorch's config as it stands (the min-cut's bans, ``recompute_views``,
    ``max_dist_from_bw``, the knapsack's solver and runtime estimator, ...) but the settings
    ``but``, for the keys of answers remembered across partitions."""
    return repr(sorted((k, v) for k, v in _functorch_config.get_config_copy().items() if k not in but))


_STRUCTURE = "_lynx_min_cut_structure"
_GRAPHS = itertools.count()


def _structure_digest(graph: fx.Graph) -> str:
    """The graph's nodes (their code, shapes and dtypes) hashed; kept on the graph with its node
    count and hashed again when the count changes. A graph with symbolic sizes also hashes a
    number of its own (its sizes' hints are not in the digest: nothing is shared with another
    graph). One joint is partitioned up to ~15 times
    while planning and torch's partitioner only removes nodes from it (dead code); lynx's passes
    on the joint only tag it, and the tags are hashed on every call (:func:`_min_cut_key`)."""
    count = len(graph.nodes)
    cached = getattr(graph, _STRUCTURE, None)
    if cached is not None and cached[0] == count:
        return cached[1]
    h = hashlib.sha256()
    symbolic = False
    for n in graph.nodes:
        h.update(n.format_node().encode())
        val = n.meta.get("val")
        shape = tuple(getattr(val, "shape", ()))
        symbolic = symbolic or isinstance(val, torch.SymInt) or any(not isinstance(d, int) for d in shape)
        h.update(repr((shape, getattr(val, "dtype", None))).encode())
    if symbolic:  # sizes named by symbols whose hints this digest does not see: this graph's own
        h.update(f"graph {next(_GRAPHS)}".encode())
    digest = h.hexdigest()
    setattr(graph, _STRUCTURE, (count, digest))
    return digest


_MEMO_SIZE = 4096
"""Entries each of the memos below keeps (least recently used dropped first): names only."""
_SOLVES: "OrderedDict[str, tuple[list[str], list[str]]]" = OrderedDict()
"""``solve_min_cut``'s answers (saved, banned node names) by :func:`_min_cut_key`, this process."""
_CHOICES: "OrderedDict[str, list[str]]" = OrderedDict()
"""``choose_saved_values_set``'s answers (saved node names, in its order) by :func:`_choice_key`."""


def _remembered(memo: OrderedDict, key: str) -> Any:
    value = memo.get(key)
    if value is not None:
        memo.move_to_end(key)
    return value


def _remember(memo: OrderedDict, key: str, value: Any) -> None:
    memo[key] = value
    while len(memo) > _MEMO_SIZE:
        memo.popitem(last=False)


def clear_min_cut_memos() -> None:
    """Forget every min-cut solve and choice remembered in this process (tests: a reference
    partition computed afresh)."""
    _SOLVES.clear()
    _CHOICES.clear()


@contextlib.contextmanager
def shared_min_cut_solves():
    """A context in which torch's min-cut solves are shared between partitions.

    ``choose_saved_values_set`` solves the min-cut up to three times per partition (runtime-
    optimized, more aggressive, aggressive; then a knapsack picks between them for the
    ``activation_memory_budget``) and the first three solves do not depend on the budget. lynx
    partitions one joint many times (the no-recompute reference, torch's min-cut at several
    settings, the baselines), and the same graph again at each decision of it (step 1, the
    step's plan, a piece compiled again): each distinct solve (same graph, tags, options,
    unbanned nodes: :func:`_min_cut_key`) runs once in this process and is replayed by node name.
    Nested uses share the memo; torch's own partitions outside the context are not served."""
    original = _partitioners.solve_min_cut
    if getattr(original, "_lynx_shared", False):
        yield
        return

    def solve(joint_graph, node_info, min_cut_options, dont_ban=None):
        key = _min_cut_key(joint_graph, node_info, min_cut_options, dont_ban)
        names = _remembered(_SOLVES, key)
        if names is None:
            saved, banned = original(joint_graph, node_info, min_cut_options, dont_ban)
            _remember(_SOLVES, key, ([n.name for n in saved], [n.name for n in banned]))
            return saved, banned
        by_name = {n.name: n for n in joint_graph.nodes}
        saved, banned = names
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


def min_cut_stops_on_repeat(seen: dict, label: Any):
    """A context in which torch's min-cut partition stops, raising :class:`SameSavedValues`,
    right after ``choose_saved_values_set`` returns saved values (as a set of node names) already
    in ``seen``; otherwise records them there under ``label``. What follows that choice in
    ``min_cut_rematerialization_partition`` (extracting the forward and backward modules,
    functionalizing RNG, reordering the backward) depends only on the joint and the saved
    values, and costs ~3x the choice itself: torch's min-cut at several budgets often saves the
    same values (a 4-layer GPT-1.3B: 12 budgets, 6 distinct sets)."""
    def repeated(saved: frozenset) -> None:
        if saved in seen:
            raise SameSavedValues(seen[saved])
        seen[saved] = label

    return min_cut_checks_choice(repeated)


_CHECKS: list[Callable[[frozenset], None]] = []
"""The checks of the open :func:`min_cut_checks_choice` contexts, outermost first."""


@contextlib.contextmanager
def min_cut_checks_choice(check: Callable[[frozenset], None]):
    """A context in which ``check(saved)`` (``saved``: the names of the values torch's min-cut
    chose to save, ``choose_saved_values_set``'s answer) is called right after the choice, before
    the forward and backward are extracted from the joint, in each :func:`min_cut_partition`; an
    exception it raises leaves the partition there, uncompleted. Nested: the outer context's
    check first (inside :func:`min_cut_stops_on_repeat` a repeated choice stops before ``check``
    is called)."""
    _CHECKS.append(check)
    try:
        yield
    finally:
        _CHECKS.remove(check)


def _choice_key(graph: fx.Graph, node_info: Any, memory_budget: float) -> str:
    """What ``choose_saved_values_set`` answers depends on: the graph and its classification
    (:func:`_answer_key`), the budget and all of functorch's config (the min-cut's bans, the
    knapsack's solver and runtime estimator)."""
    return _answer_key(graph, node_info, float(memory_budget))


@contextlib.contextmanager
def _remembered_choices():
    """torch's ``choose_saved_values_set`` answered from :data:`_CHOICES` where this process
    chose for the same graph, tags, classification, budget and config before (by node name, in
    the order torch returned them), then the :data:`_CHECKS` called. lynx decides one graph
    several times (step 1, the step's plan, a piece compiled again), each at ~10-16 min-cut
    settings: the choice (its solves, its knapsack, torch's runtime estimates) is made once;
    extracting the forward and backward from the joint still runs on every partition."""
    original = _partitioners.choose_saved_values_set
    signature = inspect.signature(original)
    first, second = list(signature.parameters)[:2]  # (joint_graph, node_info) in 2.11-2.13

    def choose(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        graph, node_info = bound.arguments[first], bound.arguments[second]
        key = _choice_key(graph, node_info, bound.arguments.get("memory_budget", 1.0))
        names = _remembered(_CHOICES, key)
        if names is None:
            saved = original(*args, **kwargs)
            _remember(_CHOICES, key, [n.name for n in saved])
        else:
            by_name = {n.name: n for n in graph.nodes}
            saved = [by_name[n] for n in names]
        chosen = frozenset(n.name for n in saved)
        for check in list(_CHECKS):
            check(chosen)
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


def tag_recompute(node: fx.Node, group: int | None) -> None:
    """Tag a joint-graph node for recomputation in checkpoint region ``group``.

    Consecutive regions with different ids keep their boundary tensor saved (torch's
    ``cleanup_recompute_tags``), which is how each block input stays saved under ``full``.
    ``group`` None: a value every region recomputes from constants alone (a causal mask,
    position ids), which no region boundary may pin saved: its id is ``NO_REGION``, above every
    block's, so no reader's region id is greater (torch 2.11's ``cleanup_recompute_tags`` reads
    ``ac_graph_id`` on every tagged node; torch 2.13's skips a node without one)."""
    node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    node.meta["ac_graph_id"] = NO_REGION if group is None else group


NO_REGION = 1 << 30
"""The checkpoint-region id of a value recomputed from constants alone (``tag_recompute``)."""


def is_recompute_tagged(node: fx.Node) -> bool:
    return node.meta.get("recompute") in (
        CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
