"""Compiling with Inductor: ``torch.compile``'s own pipeline with lynx's partitioner in place of
min-cut (and its placement settings, ``INDUCTOR_KEEP_PLACEMENT``), Inductor's compile of one
partitioned graph, and Inductor at an activation-memory budget (the ``torch`` baseline).

``INDUCTOR_KEEP_PLACEMENT`` is read through the package (``lynx_compile._compat``), where its
users read it and a benchmark rebinds it (``benchmarks/bench_codegen.py``)."""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._functorch import config as _functorch_config

from lynx_compile._compat.inductor_reuse import buffer_reuse_within
from lynx_compile._compat.keyed_passes import _chained_post_grad_pass, _keyed_partitioner_class, _scheduler_pass
from lynx_compile._compat.tracing import adopt_unbacked_symbols


def load_inductor_compiler() -> None:
    """Import Inductor's compiler (``torch._inductor.compile_fx``, about 1 s). ``torch.compile(m)``
    with Inductor imports it when ``torch.compile`` is called; lynx's backend module calls this
    when it is loaded, which ``torch.compile(m, backend="lynx")`` does at the same point, so the
    import is not in lynx's first step either."""
    importlib.import_module("torch._inductor.compile_fx")


def inductor_partitioner_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomPartitionerFn`` (2.9.1+): the base class of a
    partitioner that Inductor calls after its joint-graph passes (RNG replacement included)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_compile_with_partitioner(gm: fx.GraphModule, example_inputs: list, partitioner: Any,
                                      keep_placement: bool | Callable[[], bool] = True,
                                      keep_recompute_apart: Callable[[], bool] | None = None,
                                      post_grad: Callable | None = None,
                                      post_fusion: Callable | None = None,
                                      inner_compile: Callable | None = None,
                                      autograd_cache: bool = False, reuse: Any = None, *,
                                      source_digest: str) -> Callable:
    """Compile a dynamo graph with Inductor end to end (``compile_fx``: decompositions, joint
    passes, then ``partitioner`` instead of min-cut, post-grad passes, fused codegen) —
    ``torch.compile``'s own pipeline with only the partition replaced.

    ``keep_placement``: the settings of ``INDUCTOR_KEEP_PLACEMENT``, and no horizontal fusion
    of a recomputed kernel sharing under 1 MiB of reads (``refusing_recompute_fusion``, read
    through the package, where a benchmark rebinds it); a callable is asked at each partitioned
    graph's compile (after the partition: it may depend on it), and where it answers False that
    graph compiles with Inductor's peak-memory reordering as it was when this was called
    (torch.compile's), buffer reuse still off, and, where ``keep_recompute_apart()`` answers True,
    still no horizontal fusion of a recomputed kernel sharing under 1 MiB of reads.
    ``post_grad(graph)``: run
    on every post-grad graph after Inductor's own passes and the user's
    ``post_grad_custom_post_pass``, if any (``CustomGraphPass``, 2.11 and 2.13; its cache key is
    the hash of the file defining it, and its ``uuid()`` if it has one). ``post_fusion``: called
    with the scheduler's fused nodes of every graph this compile schedules (forward, backward),
    in run order (``config._post_fusion_custom_pass``, 2.11 and 2.13); it must return them.
    Inductor's FX-graph cache stays on, keyed on the pass by the hash of the file defining
    ``post_fusion``'s class (2.13: a ``CustomSchedulerPass``; 2.11: the pass pickled as that
    hash); a cache hit skips the scheduler, so ``post_fusion`` is not called. ``inner_compile``: what compiles each
    partitioned graph in place of ``compile_fx_inner`` (it gets the same arguments, the
    backward's with ``is_backward=True``; see :func:`inductor_compile_graph`). ``source_digest``:
    lynx's sources (``caches.source_digest``), part of the partitioner's and ``post_grad``'s keys
    in Inductor's and AOTAutograd's caches, so that a changed lynx never reuses their entries
    (the caller passes it: ``_compat`` imports nothing of lynx). ``reuse``: where the placement
    is kept, Inductor's buffer reuse under lynx's rule (``inductor_reuse.buffer_reuse_within``):
    ``reuse.headroom()`` (bytes) and ``reuse.keep_ops`` are read at each graph's compile and
    ``reuse.done(rule)`` is called after it (a graph served by Inductor's FX-graph cache reports
    no graph: the rule was not consulted); its headroom must be in ``post_grad``'s cache key."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    adopt_unbacked_symbols(gm)
    patches: dict[str, Any] = _cacheable_rng_replay()
    if keep_placement:
        settings = _keep_placement()
        patches.update(settings)
        # around each graph's inner compile: AOTAutograd compiles the backward lazily, at the
        # first backward, after this call has returned
        plain = inner_compile or compile_fx_inner
        inner_compile = sys.modules[__package__].refusing_recompute_fusion(plain)
        if reuse is not None:
            inner_compile = _reusing(reuse, inner_compile)
        if callable(keep_placement):
            inner_compile = _placement_if(keep_placement, inner_compile, plain, keep_recompute_apart,
                                          # buffer reuse stays off here (torch's partitions):
                                          # lynx adds gradients into .grad in the graph, and with
                                          # .grad None a reused buffer became a .grad that a later
                                          # kernel overwrote (wrong gradients, gpt-tiny per block
                                          # at 0.5); lynx's placements reuse under its own rule
                                          # (``reuse``: inductor_reuse)
                                          {k: getattr(inductor_config, k) for k in settings if k != "allow_buffer_reuse"})
    if post_grad is not None:
        patches["post_grad_custom_post_pass"] = _chained_post_grad_pass(inductor_config.post_grad_custom_post_pass,
                                                                        post_grad, source_digest)
    if post_fusion is not None:
        patches.update(_scheduler_pass(post_fusion))
    # ``autograd_cache``: AOTAutograd's cache may return an earlier compile of this graph
    # without calling the partitioner (its key holds the partitioner's uuid); the caller then
    # restores the plan (lynx_compile.caches.autograd). Off, the partitioner always runs.
    # Inductor's FX-graph cache (of each partitioned graph) and its kernel caches stay on.
    # (config_patches, not a patch around the call: the backward may be compiled lazily, at the
    # first backward, and compile_fx re-applies these to every inner compile.)
    with inductor_config.patch(custom_partitioner_fn=_keyed_partitioner_class()(partitioner, source_digest=source_digest)), \
            _functorch_config.patch(enable_autograd_cache=autograd_cache
                                    and _functorch_config.enable_autograd_cache):
        if inner_compile is None:
            return compile_fx(gm, example_inputs, config_patches=patches or None)
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches or None)


def _cacheable_rng_replay() -> dict:
    """Inductor settings under which its FX-graph cache, and so AOTAutograd's, keeps a graph
    that replays CUDA random numbers: empty where torch already marks the replay cacheable.

    On CUDA a recomputed random op (SDPA, dropout) is replayed in the backward by
    ``graphsafe_run_with_rng_state`` with the forward's generator state, a graph input. torch 2.13
    marks that operator cacheable (pytorch/pytorch#185562: the state is a runtime input, so the
    compiled code does not depend on it); 2.11 does not, so every graph in which lynx recomputes a
    random op bypassed both caches and a warm run compiled it again: on an H200 (torch 2.11,
    GPT-1.3B cut to 4 layers, SDPA, budget 0.7) the warm first step took 17.2 s against
    Inductor's 2.7 s (``benchmarks/results/compile_h200.md``). The operator is marked through
    Inductor's own switch for that, ``unsafe_marked_cacheable_functions``, only around lynx's
    compiles (``config_patches``)."""
    from torch._inductor import config as inductor_config
    from torch._prims.rng_prims import graphsafe_run_with_rng_state as replay

    if replay.cacheable():
        return {}
    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    marked[f"{replay.__module__}.{replay.__name__}"] = torch.__version__
    return {"unsafe_marked_cacheable_functions": marked}


def _reusing(reuse: Any, compile_inner: Callable) -> Callable:
    """``compile_inner`` with Inductor's buffer reuse under lynx's rule (``buffer_reuse_within``)."""

    @functools.wraps(compile_inner)
    def compile_reusing(*args: Any, **kwargs: Any) -> Any:
        with buffer_reuse_within(reuse.headroom(), reuse.keep_ops) as rule:
            out = compile_inner(*args, **kwargs)
        reuse.done(rule)
        return out

    return compile_reusing


def _placement_if(keep: Callable[[], bool], keeping: Callable, plain: Callable, apart: Callable[[], bool] | None,
                  defaults: dict) -> Callable:
    """An inner compile that is ``keeping`` where ``keep()``, else ``plain`` under ``defaults``
    (the settings ``_keep_placement`` changes, as they were before), refusing the recompute's
    horizontal fusions too where ``apart()``."""

    from torch._inductor import config as inductor_config

    @functools.wraps(plain)
    def compile_inner(*args: Any, **kwargs: Any) -> Any:
        if keep():
            return keeping(*args, **kwargs)
        with inductor_config.patch(defaults):
            if apart is not None and apart():
                return sys.modules[__package__].refusing_recompute_fusion(plain)(*args, **kwargs)
            return plain(*args, **kwargs)

    return compile_inner


def _keep_placement() -> dict:
    """``INDUCTOR_KEEP_PLACEMENT`` as the package binds it now. Callers read it as
    ``_compat.INDUCTOR_KEEP_PLACEMENT`` and a benchmark rebinds it there; a module of the package
    cannot import the package (an import cycle), and Python loads the package before any module
    of it, so it is in ``sys.modules`` by the time a compile runs."""
    return sys.modules[__package__].INDUCTOR_KEEP_PLACEMENT


INDUCTOR_KEEP_PLACEMENT = {
    # Inductor's scheduler may move a recompute far from where the partition put it: its
    # peak-memory reordering hoisted block 0's recompute to the start of the backward, and
    # horizontal fusion of independent kernels that share a tiny read (the causal mask) fused
    # block 0's recomputed softmax with block 1's. Either keeps both blocks' activations alive at
    # once: measured on gpt-tiny (batch 1, CPU), policy full peaked at 403 KB, above no
    # recompute (380 KB), predicted 214 KB; with both off it peaks at the predicted 214 KB.
    # Not for policies none and torch, whose partition is torch.compile's own (there Inductor's
    # defaults hold less: gpt-tiny batch 2, torch at 0.5 measured 438 KiB with them, 502 KiB
    # without). Horizontal fusion is not a setting here: only a recomputed kernel's fusions with
    # independent kernels sharing under 1 MiB of reads are refused (``_compat.inductor_fusion``);
    # until 2026-11-27 every horizontal fusion sharing under 1 MiB was
    # (``score_fusion_memory_threshold``), +9% of Inductor's kernel objects and +1-4% bytes
    # accessed at torch.compile's own partition (benchmarks/results/codegen.md).
    "reorder_for_peak_memory": False,
    # Inductor's wrapper keeps a freed buffer (no `del`) to hand its storage to a later buffer of
    # the same size, whenever that keeps the graph under its own peak estimate, which counts the
    # gradients and is loose: HF Llama (4 layers, batch 2, seq 64, CPU) under full held a block's
    # attention scores (128 KB) through the MLP's backward, 99 KB above the peak without reuse.
    # Without it each buffer is freed after its last reader; a kernel that overwrites its input
    # in place still does (inplace_buffers).
    "allow_buffer_reuse": False,
}


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
