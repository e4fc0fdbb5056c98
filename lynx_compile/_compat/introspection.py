"""What torch records of a run or a compile: a finished profile's allocator events and
``record_function`` marks (kineto's event tree) and the ops a traced ``record_function`` lowers
to; Inductor's metrics and output code, dynamo's counters, and torch.compile's cache directory."""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def record_function_ops() -> tuple[Any, Any]:
    """The ops a traced ``torch.profiler.record_function`` range lowers to: (enter, exit)."""
    ops = torch.ops.profiler
    return ops._record_function_enter_new.default, ops._record_function_exit._RecordFunction


def cpu_allocation_events(prof: Any, device_type: str = "cpu",
                          totals: bool = False) -> list[tuple[int, ...]]:
    """(time ns, address, signed bytes) of every allocator event on ``device_type`` a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded, in time order (read from the
    kineto event tree: ``torch._C._profiler._EventType.Allocation``). With ``totals`` each tuple
    ends with the allocator's own count of the bytes allocated at that event (its
    ``total_allocated``: on CPU it sees frees on other threads while
    :func:`cpu_allocator_counts_every_thread` is on)."""
    roots = prof.profiler.kineto_results.experimental_event_tree()
    return sorted(event if totals else event[:3] for event in _allocations(roots, device_type))


def _walk(nodes: Any) -> Any:
    """Every node of a kineto event tree below and including ``nodes``."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def _allocations(nodes: Any, device_type: str) -> Any:
    """(time ns, address, signed bytes, allocator's total) of the allocator events on
    ``device_type`` among ``nodes`` and below them, in no order."""
    from torch._C._profiler import _EventType

    for node in _walk(nodes):
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == device_type:
            f = node.typed[1]
            yield node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated


COLLECTIVE_OP_PREFIXES = ("c10d::", "_c10d_functional::")
"""Names of collective calls in a profile: a process group's own (``c10d::_reduce_scatter_base_``,
``c10d::allreduce_``) and the functional collectives compiled graphs call
(``_c10d_functional::all_gather_into_tensor``), which allocate their outputs before calling the
process group's and return them while its work still holds them."""


def collective_held_allocations(prof: Any, device_type: str = "cpu") -> set[tuple[int, int]]:
    """(time ns, address) of the allocations a collective call (:data:`COLLECTIVE_OP_PREFIXES`)
    made and did not free before it returned, in a finished profile with
    ``profile_memory=True``: buffers the collective's work object holds (gloo's
    ``_reduce_scatter_base_`` copies its input there; a functional collective's output, which
    the caller gets while the work holds it too). Which thread frees one, and when, is up to
    whichever drops it last: the step's thread, or the process group's worker as it finishes."""
    from torch._C._profiler import _EventType

    out: set[tuple[int, int]] = set()
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.TorchOp and node.name.startswith(COLLECTIVE_OP_PREFIXES):
            live: dict[int, int] = {}
            for t, ptr, size, _ in sorted(_allocations(node.children, device_type)):
                if size > 0:
                    live[ptr] = t
                else:
                    live.pop(ptr, None)
            out.update((t, ptr) for ptr, t in live.items())
            continue  # a collective inside another is the outer one's
        stack.extend(node.children)
    return out


def tensor_inputs(prof: Any, device_type: str = "cpu") -> list[tuple[int, int, int, bool]]:
    """(start ns, end ns, address, is a collective) per tensor input on ``device_type`` of every
    op a finished profile recorded with ``record_shapes=True`` (a tensor list's tensors each;
    the address is its storage's): which op took which memory, and when the last one that took
    it ended. Ops Inductor fuses into its own kernels are not recorded (only the aten ops and
    collectives its generated code calls)."""
    from torch._C._profiler import _EventType, _TensorMetadata

    out: list[tuple[int, int, int, bool]] = []
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.typed[0] != _EventType.TorchOp:
            continue
        collective = node.name.startswith(COLLECTIVE_OP_PREFIXES)
        for value in node.typed[1].inputs:
            for tensor in value if isinstance(value, list) else (value,):
                if (isinstance(tensor, _TensorMetadata) and tensor.storage_data_ptr
                        and tensor.device.type == device_type):
                    out.append((node.start_time_ns, node.end_time_ns, tensor.storage_data_ptr, collective))
    return out


_REPORT_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@contextlib.contextmanager
def cpu_allocator_counts_every_thread() -> Any:
    """While the block runs, torch's CPU allocator counts every allocation and free, on every
    thread, in the running total the profiler's allocator events carry (``total_allocated``);
    yields whether it does.

    A memory-profiling profiler follows only the threads it was started on (and the work they
    hand to others, while it runs): a free on another thread (gloo's worker dropping a
    collective's buffer after the step's own thread did) is neither recorded nor counted, and
    the buffer reads as live to the end of the profile. The allocator's reporter also counts
    on every thread when c10's flag ``caffe2_report_cpu_memory_usage`` is set (its only other
    effect: INFO-level log lines, below c10's default WARNING level). The flag is a C global
    of ``libc10``, set here through ctypes (no Python API); False where it is not found."""
    import ctypes

    flag = None
    for name in ("libc10.so", "libc10.dylib"):
        try:
            flag = ctypes.c_bool.in_dll(ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", name)),
                                        _REPORT_FLAG)
            break
        except (OSError, ValueError):
            continue
    if flag is None:
        yield False
        return
    before = flag.value
    flag.value = True
    try:
        yield True
    finally:
        flag.value = before


def profiler_marks(prof: Any, prefix: str) -> dict[str, int]:
    """Start time (ns, the clock of :func:`cpu_allocation_events`) of every ``record_function``
    range whose name starts with ``prefix`` in a finished profile, by name."""
    from torch._C._profiler import _EventType

    return {node.name: node.start_time_ns for node in _walk(prof.profiler.kineto_results.experimental_event_tree())
            if node.typed[0] == _EventType.TorchOp and node.name.startswith(prefix)}


def profiler_running() -> bool:
    """Whether an autograd profiler (``torch.profiler.profile``) is collecting in this thread."""
    return bool(torch.autograd._profiler_enabled())


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


@contextlib.contextmanager
def inductor_output_code():
    """Yields a list that receives the output code (wrapper and kernels) of every graph Inductor
    compiles inside the block (``GraphLowering.save_output_code``)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append, create=True):
        yield codes


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters`` (e.g. ``["inductor"]["fxgraph_cache_hit"]``)."""
    from torch._dynamo.utils import counters

    return counters


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
