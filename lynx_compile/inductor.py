"""lynx's partition inside Inductor's own pipeline (``compiler="inductor"``, the default).

::

    dynamo graph ─compile_fx─▶ aot_autograd joint graph
        ─Inductor joint passes (RNG → inductor_random(seeds), pattern rewrites)─▶
        LynxPartitioner = lynx_partition(base = torch's min-cut) ─▶ (fw, bw)
        ─Inductor post-grad passes, scheduling, fused Triton / C++ codegen─▶ compiled step

``torch._inductor.config.custom_partitioner_fn`` replaces only the partition step: everything
``torch.compile`` does before and after it runs unchanged, so lynx's graphs are compiled exactly
as torch.compile's own, with three post-grad passes added (:func:`lynx_post_grad`: the tied
weights, shared pointwise values and the windows below). What follows:

* **RNG.** Inductor's ``replace_random`` joint pass has already rewritten every dropout into
  ``inductor_random(shape, inductor_lookup_seed(inductor_seeds(n), i))``. lynx never recomputes
  ``inductor_seeds`` (``recompute.baselines._recomputable``), so it is saved and every recomputed
  random op draws the forward's numbers. lynx creates no new RNG ops after the joint passes.
* **Weight gradients of tied weights.** Inductor's post-grad pattern ``mm + add -> addmm``
  also matches the accumulation of a tied weight's two gradients (GPT-2's embedding and LM
  head), which moves the LM head's weight-gradient matmul from the start of the backward to its
  end, so the logits' gradient (batch x sequence x vocabulary) stays alive through the whole
  backward. :func:`split_late_addmm` (a post-grad pass after Inductor's) puts the matmul back
  where its operands are ready. gpt-small (tied, batch 2, CPU) under ``full``: measured peak
  4.40 MB without it, 3.75 MB with it (lynx's prediction 3.75 MB). Only for lynx's own
  placements (not policies none and torch, which are torch.compile's partition as is).
* **Recompute held for a later matmul.** Inductor fuses a pointwise node with all of its
  pointwise consumers; when one consumer feeds an early matmul and another waits for a later
  one, the early one waits too (Llama's recomputed ``silu(gate) * up`` waited for ``dh``).
  :func:`split_shared_pointwise` gives the late consumer its own copy of the pointwise chain.
  With Inductor's wrapper buffer reuse off for lynx's placements (``_compat``), HF Llama
  (4 layers, seq 64, batch 2, CPU) under ``full`` measured 1077768 B before, 921608 B after
  (lynx's prediction, with its fused model in ``memory.simulate``, 921600 B).
* **Windows.** lynx's FX passes put window recomputes between a collective's issue and its
  wait; :func:`pin_windows` turns that into ordering edges (torch's ``control_deps``) so that
  Inductor's scheduler keeps them there whatever it reorders: on a TP=2
  GPT (gloo, CPU) every recomputed matmul of a window is an extern-kernel call between the
  ``all_reduce_`` and its ``wait_tensor`` in the generated backward (``tests/test_tp_lynx.py``).
* **The compiled peak.** :class:`CompiledPeak` reads Inductor's own memory estimate of the
  fused schedules it generates (forward and backward) and records the step's peak on the plan
  (``RecomputePlan.compiled_peak_bytes``), beside lynx's prediction for the unfused graphs.
  Measured on CPU it is at or above the measured peak: gpt-small, batch 2, by 0.0% (none) to
  21% (full); gpt-tiny by 4% (none) to 46% (full): Inductor's model counts a kernel's output
  and the input it overwrites in place apart. It is a second opinion, not what lynx plans
  against: the budget is checked on lynx's prediction, which the measured peak stays within
  (+4 to +8 B) in every case measured with budgets (gpt-small at 0.4-0.7, the GQA LM and HF
  Llama at 0.5 and 0.7; the table in docs/memory_budget.md). An FX-graph cache hit skips the scheduler: the
  estimate is then the one kept in the plan cache's entry (``plan_cache.keep_compiled_peak`` /
  ``restore_compiled_peak``), when a compile has read it before.
* **Caching.** AOTAutograd's cache serves lynx's graphs as it serves torch.compile's
  (``lynx_compile.autograd_cache``): the partitioner's ``uuid()`` is a digest of the graph and
  of all that decides its plan, and the record of the plan is kept beside torch's entry, so a
  hit restores it without partitioning. Where that cache stays off (several planning ranks, a
  plan file, measured costs, offload, ``plan_cache=False``) the partitioner always runs (its
  plan from lynx's plan cache when it holds one); Inductor's FX-graph cache of the partitioned
  graphs and its kernel caches stay on.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.fx as fx

from lynx_compile import _compat, autograd_cache, plan_cache
from lynx_compile.config import LynxConfig
from lynx_compile.memory.inductor_model import splits_late_addmm
from lynx_compile.memory.storage import aliased_input
from lynx_compile.passes import GraphRecord

log = logging.getLogger("lynx_compile")


class LynxPartitioner(_compat.inductor_partitioner_base()):
    """The partitioner Inductor calls with its joint graph: lynx's decisions, min-cut base.

    ``plan_only``: stop the compile (``PlanningDone``) once the plan is in ``record``, so
    ``lynx plan`` plans exactly the graph a training run compiles (same joint passes, same
    graph hash for ``options={"plan": ...}``)."""

    def __init__(self, config: LynxConfig, record: GraphRecord, *, plan_only: bool = False,
                 peak: "CompiledPeak | None" = None, cache_key: str | None = None):
        self.config = config
        self.record = record
        self.plan_only = plan_only
        self.peak = peak
        self.cache_key = cache_key
        """``autograd_cache.cache_key``: this partitioner's uuid; the record is kept under it."""
        self.ran = False

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        from lynx_compile.errors import PlanningDone
        from lynx_compile.recompute.partition import lynx_partition

        if self.peak is not None:
            self.peak.tangent_bytes = {p.name: _nbytes(p.meta.get("val")) for p in gm.graph.find_nodes(op="placeholder")
                                       if p.name.startswith("tangents")}
        self.ran = True
        fw, bw = lynx_partition(gm, joint_inputs, config=self.config, record=self.record, **kwargs)
        if self.plan_only:
            raise PlanningDone()
        if self.peak is not None:  # a plan-cache hit's estimate: Inductor's FX-graph cache may skip the scheduler
            plan_cache.restore_compiled_peak(self.record)
        if self.cache_key is not None:
            autograd_cache.keep(self.record, self.cache_key)
        return fw, bw

    def uuid(self) -> str | None:
        """Part of AOTAutograd's and Inductor's FX-graph cache keys: None while AOTAutograd's
        cache is off for this graph (``autograd_cache``)."""
        return self.cache_key


def _nbytes(v: Any) -> int:
    if not isinstance(v, torch.Tensor):
        return 0
    return v.untyped_storage().nbytes() if v.device.type != "meta" else v.numel() * v.element_size()


def split_late_addmm(graph: fx.Graph) -> None:
    """Undo ``addmm(inp, a, b)`` fusions whose ``inp`` is computed after both ``a`` and ``b``:
    ``mm(a, b)`` goes right after the later of ``a`` / ``b``, the ``add`` stays where the addmm
    was. Inductor's pattern fuses ``mm + add`` at the add's position, so when ``inp`` comes late
    (the second gradient of a tied weight) the matmul waits for it and keeps ``a`` and ``b``
    alive until then. A bias addmm (``inp`` a parameter or an earlier value) is left alone, as is
    one whose matmul output would be larger than the operands it frees (not a saving)."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
        if n.kwargs or len(n.args) != 3 or not all(isinstance(x, fx.Node) for x in n.args):
            continue
        inp, a, b = n.args
        if not splits_late_addmm(order, inp, a, b, _nbytes(n.meta.get("val")), order[n]):
            continue
        later = max(a, b, key=order.get)
        with graph.inserting_after(later):
            mm = graph.call_function(aten.mm.default, (a, b))
        with graph.inserting_before(n):
            add = graph.call_function(aten.add.Tensor, (inp, mm))
        mm.meta = {k: v for k, v in n.meta.items() if k != "val"}
        add.meta = dict(n.meta)
        if isinstance(n.meta.get("val"), torch.Tensor):
            mm.meta["val"] = n.meta["val"]
        n.replace_all_uses_with(add)
        graph.erase_node(n)


def _fusible(n: fx.Node) -> bool:
    """A node Inductor computes inside a fused kernel: a pointwise op, or a view."""
    if n.op != "call_function":
        return False
    return torch.Tag.pointwise in getattr(n.target, "tags", ()) or aliased_input(n) is not None


def _kernel_bounds(nodes: list[fx.Node]) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Per node, through chains of fusible nodes: ``ready``, the position of the latest
    non-fusible node (a matmul, a reduction) it depends on, -1 for none; ``needed``, the
    position of the earliest non-fusible node (or the output) that reads it."""
    order = {n: i for i, n in enumerate(nodes)}
    ready: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op != "call_function":
            ready[n] = -1
        elif _fusible(n):
            ready[n] = max((ready[i] for i in n.all_input_nodes), default=-1)
        else:
            ready[n] = order[n]
    needed: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        if _fusible(n):
            needed[n] = min((needed[u] for u in n.users), default=len(nodes))
        else:
            needed[n] = order[n]
    return ready, needed


def _pointwise_cone(n: fx.Node, max_nodes: int) -> set[fx.Node] | None:
    """``n`` and the fusible nodes that feed only it (what a copy of ``n`` recomputes); None
    when that is more than ``max_nodes`` nodes."""
    cone, grew = {n}, True
    while grew:
        grew = False
        for m in {i for c in cone for i in c.all_input_nodes} - cone:
            if _fusible(m) and all(u in cone for u in m.users):
                cone.add(m)
                grew = True
        if len(cone) > max_nodes:
            return None
    return cone


def split_shared_pointwise(graph: fx.Graph, max_nodes: int = 16) -> None:
    """Give a pointwise value read by an early and a late consumer a copy for the late one.

    Inductor fuses a pointwise node with all of its pointwise consumers into one kernel, which
    can only run once every consumer's inputs are ready. In Llama's recomputed MLP::

        g = x @ Wg; u = x @ Wu; s = silu(g)
        h = s * u  -> dWd = dy^T @ h                  (early: needs g, u)
        dh = dy @ Wd; dhs = dh * s                    (late: needs the matmul dh)

    ``s``, ``h`` and ``dhs`` became one kernel after ``dh``, so ``h`` waited for ``dh`` and g, u,
    dh, h, dhs were alive at once (HF Llama, 4 layers, batch 2, seq 64, policy full: +88 KB per
    layer above lynx's prediction, which computes ``h`` and frees it before ``dh``). After::

        h = silu(g) * u -> dWd = dy^T @ h; dh = dy @ Wd; dhs = dh * silu(g)   (silu recomputed)

    A copy of ``n``'s cone (``n`` and the pointwise nodes feeding only it, at most ``max_nodes``)
    is made for the consumers that wait for a later matmul, only where an earlier consumer's
    result is read by a matmul before then (so the fusion would delay it) and the cone's inputs
    are alive there anyway (the copy extends no lifetime). The cost is the cone's pointwise ops
    once more, inside a kernel that runs anyway."""
    from lynx_compile.passes import meta

    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    ready, needed = _kernel_bounds(nodes)
    rewrites = []
    for n in nodes:
        if n.op != "call_function" or torch.Tag.pointwise not in getattr(n.target, "tags", ()) \
                or len(n.users) < 2 or not all(_fusible(u) for u in n.users):
            continue
        groups: dict[int, list[fx.Node]] = {}
        for u in n.users:  # consumers by the latest matmul each waits for, besides n
            groups.setdefault(max((ready[i] for i in u.all_input_nodes if i is not n), default=-1), []).append(u)
        if len(groups) < 2:
            continue
        first, *later = sorted(groups)
        early_read = min(needed[u] for u in groups[first])
        later = [b for b in later if early_read < b]  # the fusion would delay an earlier matmul
        cone = _pointwise_cone(n, max_nodes) if later else None
        if cone is None:
            continue
        leaves = {i for c in cone for i in c.all_input_nodes if i not in cone}
        for b in later:
            start = min(order[u] for u in groups[b])
            if all(leaf.op == "get_attr" or max((order[u] for u in leaf.users if u not in cone), default=-1) >= start
                   for leaf in leaves):
                rewrites.append((n, sorted(cone, key=order.get), sorted(groups[b], key=order.get)))
    for n, cone, users in rewrites:
        copies: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(users[0]):
            for c in cone:
                copies[c] = graph.node_copy(c, lambda x: copies.get(x, x))
                copies[c].meta.pop(meta.DECISION, None)  # runs with its consumer, in no window
        for u in users:
            u.replace_input_with(n, copies[n])


@dataclasses.dataclass
class CompiledPeak:
    """Inductor's memory estimate of one lynx graph as compiled: the scheduler's fused nodes in
    run order (``_compat.inductor_schedule_memory``), read by ``_post_fusion_custom_pass``.

    Counted like lynx's measurement of a step (``lynx_compile.memory.measure``): parameters and
    the user's inputs are not step memory; the gradients the backward returns are (they are
    alive together at its end: ``lynx_compile.budget``). The forward counts what it
    allocates, its outputs (the saved activations) alive to its end. The backward starts with
    the saved activations it reads and the tangents (one per differentiable output, as large as
    it; autograd materializes zeros for an output the loss does not use), Inductor frees each
    after its last reader, and counts its own buffers."""

    record: GraphRecord | None = None
    """Its plan gets ``compiled_peak_bytes`` once both graphs are compiled."""
    tangent_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    forward_bytes: int | None = None
    backward_bytes: int | None = None

    def __call__(self, nodes: list) -> list:
        backward = any(k.startswith("tangents") for k in _compat.inductor_graph_input_names())
        peak, counted = _compat.inductor_schedule_memory(
            nodes, count_input=lambda name: backward and not name.startswith("primals"), count_output=True)
        if backward:
            # tangents Inductor does not count (not read, or read through a view) are alive anyway
            peak += sum(b for k, b in self.tangent_bytes.items() if k not in counted)
            self.backward_bytes = peak
        else:
            self.forward_bytes = peak
        plan = self.record.plan if self.record is not None else None
        if self.step_bytes is not None and plan is not None:
            self.record.plan = dataclasses.replace(plan, compiled_peak_bytes=self.step_bytes)
            plan_cache.keep_compiled_peak(self.record, self.step_bytes)
            if self.record.decisions.get("autograd_cache_key"):
                autograd_cache.keep(self.record, self.record.decisions["autograd_cache_key"])
            log.info("lynx graph %d: Inductor's estimate of the compiled step's peak %d B (lynx's "
                     "prediction for the unfused graphs %d B)", self.record.graph_id, self.step_bytes,
                     plan.peak_bytes)
        return nodes

    @property
    def step_bytes(self) -> int | None:
        """The step's peak: the larger of the two; None until both graphs are compiled."""
        if self.forward_bytes is None or self.backward_bytes is None:
            return None
        return max(self.forward_bytes, self.backward_bytes)


def pin_windows(graph: fx.Graph) -> None:
    """Ordering edges that keep lynx's window recomputes between their collective's issue and
    its wait in Inductor's schedule (``passes/insert_recompute.py`` placed them there in the FX
    graph). With peak-memory reordering off for lynx's placements
    (``_compat.INDUCTOR_KEEP_PLACEMENT``) Inductor mostly keeps the FX order, but nothing in its
    scheduler promises to: these edges make the order a dependency.

    Per window: the wait runs after the window's results (its nodes read after the window, so
    they are realized buffers anyway), and each window node that reads nothing else in the
    window runs after the issue. A pointwise node Inductor fuses into a later kernel has no
    operation of its own to order; its kernel then runs wherever its consumer does."""
    from lynx_compile.costs import is_collective_node
    from lynx_compile.costs.comm import is_wait_node
    from lynx_compile.decisions import Window
    from lynx_compile.passes import meta

    issued = {n.name: n for n in graph.nodes if is_collective_node(n)}
    windows: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        decision = n.meta.get(meta.DECISION)
        if isinstance(decision, Window) and n.meta.get(meta.RECOMPUTED) and decision.collective in issued:
            windows.setdefault(decision.collective, []).append(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    deps: dict[fx.Node, list[fx.Node]] = {}
    for name, members in windows.items():
        issue = issued[name]
        # a node shared with an earlier window sits there (insert_recompute moves it once): it
        # is not ordered after this window's issue, which would close a cycle through that wait
        members = [m for m in members if order[m] > order[issue]]
        inside = set(members)
        results = [m for m in members if isinstance(m.meta.get("val"), torch.Tensor)
                   and any(u not in inside for u in m.users)]
        for wait in (u for u in issue.users if is_wait_node(u)):
            deps[wait] = results
        for m in members:
            if m.op == "call_function" and not any(a in inside for a in m.all_input_nodes):
                deps[m] = [issue]
    _compat.inductor_preserve_node_ordering(graph, deps)


def lynx_post_grad(graph: fx.Graph) -> None:
    """The post-grad passes lynx adds for its own placements: :func:`split_late_addmm`,
    :func:`split_shared_pointwise`, then :func:`pin_windows` (last: it orders what the others
    placed). (Offload copies need no pass: their ops carry the order in their arguments,
    ``passes/offload.py``.)"""
    split_late_addmm(graph)
    split_shared_pointwise(graph)
    pin_windows(graph)


class WeightSplitCompile:
    """Inductor's ``inner_compile`` for a graph whose backward is cut into B (input gradients)
    and W (weight gradients) for the zero-bubble pipeline schedules (option ``weight_split``;
    ``runtime.weight_split``). The cut is made on the partitioned backward, before Inductor's
    post-grad passes; B and W are then compiled by Inductor like any backward (fused kernels,
    lynx's post-grad passes), when the backward is compiled.

    Inductor may reuse a backward input's buffer once read (AOTAutograd's donated saved
    tensors): B keeps that for the inputs it does not hand to W; W reuses none of its inputs
    (they are B's outputs and saved tensors, some views of others)."""

    def __init__(self, deferral: Any):
        self.deferral = deferral

    def __call__(self, gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable:
        if not kwargs.get("is_backward"):
            return _compat.inductor_compile_graph(gm, example_inputs, **kwargs)
        donated = _compat.inductor_donated_inputs()

        def compile_b(split: Any) -> Callable:
            keep = [i for i in donated if i not in split.carried_inputs]
            return _compat.inductor_compile_graph(split.b, example_inputs, donated=keep, **kwargs)

        def compile_w(split: Any) -> Callable:
            vals = [p.meta["val"] for p in split.w.graph.find_nodes(op="placeholder")]
            return _compat.inductor_compile_graph(split.w, vals, donated=[], **{**kwargs, "static_input_idxs": []})

        run = self.deferral.wrap_split(gm, compile_b, compile_w)
        return run if run is not None else _compat.inductor_compile_graph(gm, example_inputs, **kwargs)
