"""The one place lynx reaches into private torch APIs.

Nothing else in lynx imports ``torch._*``, ``torch.fx.experimental.*``, ``torch.distributed._*``,
``torch.testing._internal`` or ``torch.utils._*``: it calls the wrappers here, as
``_compat.name``. They are called by keyword and filtered against the installed signature where
torch's differ, because these helpers change between releases (lynx supports torch 2.11 on the
GPU machines and 2.13 here); each names where the API differs. When a helper moves, only this
package changes.

Modules, each re-exported here (import from the package, not from a module of it):

- ``versions``: the supported torch releases and the check of the installed one.
- ``partitioner``: AOTAutograd's entry and its partitioners (default, min-cut at a budget), the
  min-cut's solves shared between or stopped on a repeat across partitions of one joint, the
  checkpoint tags both honour.
- ``inductor``: compiling with Inductor with lynx's partitioner (``INDUCTOR_KEEP_PLACEMENT``),
  one partitioned graph, or at an activation-memory budget.
- ``inductor_fusion``: the horizontal fusions refused in lynx's placements (a recomputed kernel
  with an independent one sharing under 1 MiB of reads), through Inductor's choices handler.
- ``inductor_reuse``: Inductor's buffer reuse under a rule lynx's memory model can promise
  (within a headroom, never a buffer kept as ``.grad``).
- ``keyed_passes``: lynx's partitioner and passes as Inductor config entries, pickled in its
  cache keys as their uuid.
- ``inductor_schedule``: from inside Inductor's compile: ordering edges, graph inputs, its
  schedule's memory, its atomic-add fallback.
- ``module_hooks``: where a training step starts (the outermost module call running) and hooks
  on that module.
- ``introspection``: what torch records: profiler events, Inductor's metrics and output code,
  dynamo's counters, the cache directory.
- ``tracing``: tracing contexts of lynx's own, unbacked symbols, fake modes, eager dispatch.
- ``fx_utils``: FX nodes and ops (predicates, names, size hints, renames, boxed code).
- ``autograd_engine``: the backward at run time (the engine's entry and callbacks, what the
  compiled backward holds and donates).
- ``distributed``: c10d, functional collectives, FSDP2, DTensor stand-ins, pipelining schedules.

Tests and benchmarks patch names on this package (``monkeypatch.setattr(_compat, ...)``); lynx
calls them as ``_compat.name``, so a patch is seen. ``INDUCTOR_KEEP_PLACEMENT`` is one dict,
mutated in place by tests and rebound here by a benchmark: ``inductor_compile_with_partitioner``
reads the package's binding of it and of ``refusing_recompute_fusion`` (also rebound there).
"""
from __future__ import annotations

from lynx_compile._compat.autograd_engine import (
    backward_donates_saved,
    backward_holds_grad_inputs,
    backward_roots,
    current_autograd_node,
    engine_run_backward_code,
    in_backward,
    python_backward_code,
    queue_backward_callback,
    saved_symints,
    watch_frame,
    will_engine_execute_node,
)
from lynx_compile._compat.distributed import (
    c10d_bindings,
    default_store,
    dtensor_layout,
    dtensor_stand_in,
    fake_store,
    fsdp2_groups_holding,
    functional_all_gather,
    functional_all_reduce,
    functional_reduce_scatter,
    pipeline_schedule_actions,
    wait_collective,
    work_from_future,
)
from lynx_compile._compat.fx_utils import (
    boxed,
    hint_with_values,
    is_inductor_seeds,
    is_op_overload,
    is_rng_replay,
    is_sym_node,
    mark_side_effect,
    node_is_random,
    optimization_hint,
    qualified_op_name,
    rename_node,
    tree_leaves,
    unbacked_symbol_name,
)
from lynx_compile._compat.inductor import (
    INDUCTOR_KEEP_PLACEMENT,
    inductor_at_activation_budget,
    inductor_compile_graph,
    inductor_compile_with_partitioner,
    inductor_donated_inputs,
    inductor_partitioner_base,
    load_inductor_compiler,
)
from lynx_compile._compat.inductor_fusion import (
    RECOMPUTE_FUSION_SHARED_BYTES,
    CompiledKernels,
    recording_kernels,
    refuses_horizontal_fusion,
    refusing_recompute_fusion,
)
from lynx_compile._compat.inductor_reuse import ReuseRule, buffer_reuse_within
from lynx_compile._compat.inductor_schedule import (
    inductor_atomic_add_falls_back,
    inductor_graph_input_names,
    inductor_preserve_node_ordering,
    inductor_realize_thresholds,
    inductor_schedule_memory,
)
from lynx_compile._compat.introspection import (
    collective_held_allocations,
    cpu_allocation_events,
    cpu_allocator_counts_every_thread,
    dynamo_counters,
    inductor_cache_dir,
    inductor_metrics,
    inductor_output_code,
    profiler_marks,
    profiler_running,
    record_function_ops,
    tensor_inputs,
)
from lynx_compile._compat.module_hooks import ModuleCallHooks, call_is_compiled, outermost_module_call
from lynx_compile._compat.partitioner import (
    SameSavedValues,
    aot_autograd,
    canonicalize_joint,
    clear_min_cut_memos,
    compute_intensive_ops,
    default_partition,
    forward_node_names,
    is_recompute_tagged,
    min_cut_checks_choice,
    min_cut_counts_script_objects_as_zero,
    min_cut_partition,
    min_cut_stops_on_repeat,
    shared_min_cut_solves,
    tag_recompute,
)
from lynx_compile._compat.tracing import (
    REGION_BUDGET_KEY,
    adopt_unbacked_symbols,
    annotate_region,
    detect_fake_mode,
    is_plain_fake,
    dispatch_mode_base,
    dynamo_passthrough_error,
    eager_dispatch,
    refuse_unbacked_retrace,
    static_tracing,
)
from lynx_compile._compat.versions import SUPPORTED_TORCH, TORCH_VERSION, check_torch_version

__all__ = [
    # versions
    "SUPPORTED_TORCH", "TORCH_VERSION", "check_torch_version",
    # partitioner
    "SameSavedValues", "aot_autograd", "canonicalize_joint", "compute_intensive_ops", "default_partition",
    "clear_min_cut_memos", "forward_node_names", "is_recompute_tagged", "min_cut_checks_choice", "min_cut_counts_script_objects_as_zero",
    "min_cut_partition", "min_cut_stops_on_repeat", "shared_min_cut_solves", "tag_recompute",
    # inductor
    "INDUCTOR_KEEP_PLACEMENT", "inductor_at_activation_budget", "inductor_compile_graph", "load_inductor_compiler",
    "inductor_compile_with_partitioner", "inductor_donated_inputs", "inductor_partitioner_base",
    # inductor_fusion
    "RECOMPUTE_FUSION_SHARED_BYTES", "CompiledKernels", "recording_kernels", "refuses_horizontal_fusion",
    "refusing_recompute_fusion",
    # inductor_reuse
    "ReuseRule",
    "buffer_reuse_within",
    # inductor_schedule
    "inductor_atomic_add_falls_back", "inductor_graph_input_names", "inductor_preserve_node_ordering", "inductor_realize_thresholds",
    "inductor_schedule_memory",
    # module_hooks
    "ModuleCallHooks", "call_is_compiled", "outermost_module_call",
    # introspection
    "collective_held_allocations", "cpu_allocation_events", "cpu_allocator_counts_every_thread", "dynamo_counters", "inductor_cache_dir", "inductor_metrics", "inductor_output_code",
    "profiler_marks", "profiler_running", "record_function_ops", "tensor_inputs",
    # tracing
    "REGION_BUDGET_KEY", "adopt_unbacked_symbols", "annotate_region", "detect_fake_mode", "is_plain_fake", "dispatch_mode_base", "dynamo_passthrough_error",
    "eager_dispatch", "refuse_unbacked_retrace", "static_tracing",
    # fx_utils
    "boxed", "hint_with_values", "is_inductor_seeds", "is_op_overload", "is_rng_replay", "is_sym_node", "mark_side_effect",
    "node_is_random", "optimization_hint", "qualified_op_name", "rename_node", "tree_leaves",
    "unbacked_symbol_name",
    # autograd_engine
    "backward_donates_saved", "backward_holds_grad_inputs", "backward_roots", "current_autograd_node",
    "engine_run_backward_code", "in_backward", "python_backward_code", "queue_backward_callback", "saved_symints", "watch_frame",
    "will_engine_execute_node",
    # distributed
    "c10d_bindings", "default_store", "dtensor_layout", "dtensor_stand_in", "fake_store", "fsdp2_groups_holding",
    "functional_all_gather", "functional_all_reduce", "functional_reduce_scatter", "pipeline_schedule_actions",
    "wait_collective", "work_from_future",
]
