"""lynx's partition inside Inductor's own pipeline (``compiler="inductor"``, the default).

::

    dynamo graph ─compile_fx─▶ aot_autograd joint graph
        ─Inductor joint passes (RNG → inductor_random(seeds), pattern rewrites)─▶
        LynxPartitioner = lynx_partition(base = torch's min-cut) ─▶ (fw, bw)
        ─Inductor post-grad passes, scheduling, fused Triton / C++ codegen─▶ compiled step

``torch._inductor.config.custom_partitioner_fn`` replaces only the partition step: everything
``torch.compile`` does before and after it runs unchanged, so lynx's graphs are compiled exactly
as torch.compile's own, with three post-grad passes added (:class:`LynxPostGrad` runs
``passes.POST_GRAD_PIPELINE``: the tied weights, shared pointwise values and the windows below;
each can be disabled by name). What follows:

* **RNG.** Inductor's ``replace_random`` joint pass has already rewritten every dropout into
  ``inductor_random(shape, inductor_lookup_seed(inductor_seeds(n), i))``. lynx never recomputes
  ``inductor_seeds`` (``recompute.baselines._recomputable``), so it is saved and every recomputed
  random op draws the forward's numbers. lynx creates no new RNG ops after the joint passes.
* **Weight gradients of tied weights.** Inductor's post-grad pattern ``mm + add -> addmm``
  also matches the accumulation of a tied weight's two gradients (GPT-2's embedding and LM
  head), which moves the LM head's weight-gradient matmul from the start of the backward to its
  end, so the logits' gradient (batch x sequence x vocabulary) stays alive through the whole
  backward. ``split_late_addmm_pass`` (a post-grad pass after Inductor's) puts the matmul back
  where its operands are ready. gpt-small (tied, batch 2, CPU) under ``full``: measured peak
  4.40 MB without it, 3.75 MB with it (lynx's prediction 3.75 MB). Only for lynx's own
  placements (not policies none and torch, which are torch.compile's partition as is).
* **Recompute held for a later matmul.** Inductor fuses a pointwise node with all of its
  pointwise consumers; when one consumer feeds an early matmul and another waits for a later
  one, the early one waits too (Llama's recomputed ``silu(gate) * up`` waited for ``dh``).
  ``split_shared_pointwise_pass`` gives the late consumer its own copy of the pointwise chain.
  With Inductor's wrapper buffer reuse off for lynx's placements (``_compat``), HF Llama
  (4 layers, seq 64, batch 2, CPU) under ``full`` measured 1077768 B before, 921608 B after
  (lynx's prediction, with its fused model in ``memory.simulate``, 921600 B).
* **Windows.** lynx's FX passes put window recomputes between a collective's issue and its
  wait; ``pin_windows_pass`` turns that into ordering edges (torch's ``control_deps``) so that
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
  (``lynx_compile.caches.autograd``): the partitioner's ``uuid()`` is a digest of the graph and
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

import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.caches import autograd as autograd_cache
from lynx_compile.caches import plans as plan_cache
from lynx_compile.config import LynxConfig
from lynx_compile.graph.values import sizes_seen
from lynx_compile.memory.storage import storage_nbytes
from lynx_compile.passes import POST_GRAD_PIPELINE, GraphRecord, PassContext, run_passes
from lynx_compile.passes.runner import pass_name
from lynx_compile.step.sizes import saved_symbols

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
        """``caches.autograd.cache_key``: this partitioner's uuid; the record is kept under it."""
        self.ran = False

    def __call__(self, gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        from lynx_compile.errors import PlanningDone
        from lynx_compile.recompute.partition import lynx_partition

        if self.peak is not None:
            self.peak.tangent_bytes = {p.name: storage_nbytes(p.meta.get("val"))
                                       for p in gm.graph.find_nodes(op="placeholder") if p.name.startswith("tangents")}
        self.ran = True
        with sizes_seen(self.record.unbacked_sizes):  # data-dependent sizes as step 1 ran them (step.sizes)
            fw, bw = lynx_partition(gm, joint_inputs, config=self.config, record=self.record, **kwargs)
        self.record.saved_symbols = saved_symbols(fw)  # the data-dependent sizes a step shows (step.sizes)
        if self.plan_only:
            raise PlanningDone()
        if self.peak is not None:  # a plan-cache hit's estimate: Inductor's FX-graph cache may skip the scheduler
            plan_cache.restore_compiled_peak(self.record)
        if self.cache_key is not None:
            autograd_cache.keep(self.record, self.cache_key)
        return fw, bw

    def uuid(self) -> str | None:
        """Part of AOTAutograd's and Inductor's FX-graph cache keys: None while AOTAutograd's
        cache is off for this graph (``caches.autograd``)."""
        return self.cache_key


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
            if self.record.stats.get("autograd_cache_key"):
                autograd_cache.keep(self.record, self.record.stats["autograd_cache_key"])
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


class BufferReuse:
    """Inductor's buffer reuse for lynx's own placements (``_compat.buffer_reuse_within``; the
    ``reuse`` of ``_compat.inductor_compile_with_partitioner``): within ``GraphRecord.reuse_headroom``,
    never a gradient ``lynx::accumulate_grads`` may keep as ``.grad``. What each compile held
    goes into the record (``stats["buffer_reuse"]``) and the log; a compile served by Inductor's
    FX-graph cache reports its headroom, the most it may hold."""

    def __init__(self, record: GraphRecord):
        self.record = record

    @property
    def keep_ops(self) -> tuple:
        from lynx_compile.memory import grad_in_graph

        return (grad_in_graph.accumulate_grads_op(),)

    def headroom(self) -> int:
        return self.record.reuse_headroom

    def done(self, rule: Any) -> None:
        stats = self.record.stats.setdefault("buffer_reuse", {"headroom_bytes": rule.headroom, "held_bytes": 0,
                                                              "reused": 0, "refused": 0})
        stats["headroom_bytes"] = rule.headroom
        stats["held_bytes"] = max(stats["held_bytes"], rule.held() if rule.graphs else rule.headroom)
        stats["reused"] += rule.reused
        stats["refused"] += rule.refused
        if rule.graphs:
            log.info("lynx graph %d: Inductor's buffer reuse: %d buffers reused, %d refused, up to %d B held at once "
                     "(headroom %d B above the predicted peak)", self.record.graph_id, rule.reused, rule.refused,
                     rule.held(), rule.headroom)


class LynxPostGrad:
    """Inductor's post-grad hook for lynx's own placements: ``passes.POST_GRAD_PIPELINE``
    (``split_late_addmm_pass``, ``split_shared_pointwise_pass``, then ``pin_windows_pass``, last:
    it orders what the others placed) on every graph Inductor compiles (the forward, the
    backward, their subgraphs), after Inductor's own post-grad passes, through the one pass
    runner: ``options={"disable_passes": (...)}`` skips them by name, their timings go into
    the graph's record (stage ``"post_grad"``) and ``dump_dir`` gets their graphs. (Offload
    copies need no pass: their ops carry the order in their arguments, ``passes/offload.py``.)

    Installed with ``_compat.inductor_compile_with_partitioner(post_grad=...)``, whose
    ``CustomGraphPass`` keys Inductor's FX-graph cache on lynx's sources and on :meth:`uuid`:
    a graph compiled with a pass disabled is not served the code of one compiled with it."""

    def __init__(self, config: LynxConfig, record: GraphRecord):
        self.config = config
        self.record = record
        self.graphs = 0
        """Graphs run so far: the k-th one's dumps are ``post_grad<k>_*`` (Inductor compiles the
        forward first, then the backward, or B and W with ``weight_split``; a higher-order op's
        subgraphs before their graph)."""

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is None:  # Inductor hands its post-grad passes a GraphModule's graph (post_grad_passes)
            raise RuntimeError("lynx's post-grad passes got a graph no GraphModule owns; they rewrite "
                               "(and torch's control_deps register subgraphs on) the owning module")
        if self.record.torch_partition:  # torch.compile's kind of partition: compiled as it compiles it
            return
        # a partitioned graph (forward or backward): no joint outputs to count
        ctx = PassContext(config=self.config, record=self.record, num_fwd_outputs=0)
        k, self.graphs = self.graphs, self.graphs + 1
        with sizes_seen(self.record.unbacked_sizes):
            run_passes(gm, ctx, POST_GRAD_PIPELINE, "post_grad", recompile=False, dump_prefix=f"post_grad{k}")

    def uuid(self) -> tuple[str, ...]:
        """What decides the rewrite besides lynx's sources (``_compat`` keys on those): the names
        of the passes that run. They read nothing else of ``config``; a pass that does must add
        it here."""
        names = map(pass_name, POST_GRAD_PIPELINE)
        if self.record.torch_partition:  # (the fusion refusal is in no other cache key)
            return ("torch_partition", "recompute_apart") if self.record.keep_recompute_apart else ("torch_partition",)
        # (the buffer reuse's headroom decides the wrapper code: BufferReuse)
        reuse = f"reuse_headroom={self.record.reuse_headroom}" if self.config.buffer_reuse else "no_buffer_reuse"
        return (*(name for name in names if name not in self.config.disable_passes), reuse)


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
