"""Measure a training step: peak activation memory and wall time.

On CUDA the peak comes from the caching allocator (``max_memory_allocated`` above the bytes
allocated before the step). On CPU it comes from allocator-level events: the profiler's memory
events (every allocation and free the CPU allocator performs, in order), whose running sum
from the start of the step gives live bytes; the peak is its maximum. Either way the number
is what the step allocates beyond what was already live (parameters, ``.grad``, optimizer
state, inputs), which is what ``lynx_compile.memory.simulate`` predicts and a memory budget
bounds (``lynx_compile.budget``): the gradients a backward returns count until autograd has
added them into ``.grad``.

Step time is measured in separate runs without the profiler (it slows CPU execution): wall
time on CPU, CUDA events on CUDA. The profiler's own log lines (kineto's ``USDT: profiler_start``
/ ``profiler_stop``, written to file descriptor 2 at every start and stop) are dropped.

``grad_snapshot`` / ``grad_rel_diff`` compare the gradients a step left with a reference's.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch


@dataclass(frozen=True)
class StepMeasurement:
    """What one measured step used."""

    peak_bytes: int
    """Peak bytes allocated during the step above the bytes live when it started (with
    ``params``: ``.grad`` allocated before the step, the returned gradients counted)."""
    step_s: float
    """Median time of the step (seconds): wall time on CPU, CUDA events on CUDA."""
    step_times_s: tuple[float, ...]
    device: str
    method: str
    """``cuda-allocator`` or ``cpu-profiler-memory-events``."""
    predicted_peak_bytes: int | None = None
    """The plan's predicted peak (when a plan was passed), for side-by-side reporting."""
    predicted_saved_bytes: int | None = None
    """The plan's predicted saved-activation bytes (when a plan was passed)."""


#: While a measurement runs: storage addresses of every tensor a lynx-compiled backward returns
#: (the gradients, before autograd accumulates or copies them into ``.grad``).
BACKWARD_OUTPUTS: set[int] | None = None


def record_backward_outputs(outputs: Any) -> None:
    """Called by lynx's compiled backward with what it returns (no-op outside a measurement)."""
    if BACKWARD_OUTPUTS is not None:
        BACKWARD_OUTPUTS.update(t.untyped_storage().data_ptr() for t in outputs
                                if isinstance(t, torch.Tensor))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocation_events(prof) -> list[tuple[int, ...]]:
    """(time ns, address, signed bytes, allocator's total) of every CPU-allocator event, in time
    order."""
    from lynx_compile import _compat

    return _compat.cpu_allocation_events(prof, totals=True)


def freed_unseen(events: Sequence[tuple[int, ...]]) -> set[int]:
    """Indices of the allocations in ``events`` (time, address, signed bytes, ...; time order)
    whose free the profiler did not record: memory they hold is allocated again while they are
    still live (the same address, or a block overlapping theirs: the allocator's alignment can
    move a reused block's start by a few bytes). One whose memory is not used again in the
    window is not found: see :func:`live_series` for when this is the measure's only guard."""
    import bisect

    starts: list[int] = []  # live blocks, sorted by address
    index: dict[int, tuple[int, int]] = {}  # address -> (event index, bytes)
    unseen: set[int] = set()
    for i, (_, ptr, size, *_rest) in enumerate(events):
        if size > 0:
            at = bisect.bisect_left(starts, ptr)
            if at > 0 and starts[at - 1] + index[starts[at - 1]][1] > ptr:
                at -= 1  # a live block starting below ptr reaches into it
            while at < len(starts) and starts[at] < ptr + size:
                unseen.add(index.pop(starts.pop(at))[0])
            bisect.insort(starts, ptr)
            index[ptr] = (i, size)
        elif ptr in index:
            del index[ptr]
            starts.pop(bisect.bisect_left(starts, ptr))
    return unseen


def live_series(events: Sequence[tuple[int, ...]], every_thread: bool) -> list[tuple[int, int, int]]:
    """Per allocator event of ``events`` (time, address, signed bytes[, allocator's total]; time
    order): (time, bytes live at it, bytes live just after it), counting what the window
    allocated (0 before its first event).

    A free of memory allocated before the window is not counted: the CPU allocator reports such
    a free with the size it last recorded at that address, which is stale where the address was
    freed and allocated again while nothing counted (between two measurements). gpt-tiny per
    block, the same step measured ten times in one process: read with those frees, 2,238,984 to
    2,634,504 B (the previous step's ``.grad`` set to None inside the window, at stale sizes);
    without them 2,634,504 B each time. A step that frees memory from before the window reads as
    if that memory had been freed before it started (CUDA's allocator knows the sizes, and
    ``cuda_peak_bytes`` counts such frees).

    A memory-profiling profiler records events only on the threads it follows. Under gloo a
    collective's buffers are held by the work object as well as by the step; when the worker
    thread drops the work after the step's own thread dropped its references, the free happens
    there, unrecorded, and the buffer read as live to the end of the window: identical 2-rank
    runs of torchtitan's llama3 read 1.4 MiB apart at every later mark under TP, 3.3 MiB under
    FSDP2 (a reduce-scatter's input), and named other smallest budgets (issue S item 1). With
    ``every_thread`` (the events carry the allocator's total, counted on every thread:
    ``_compat.cpu_allocator_counts_every_thread``) the live bytes are that total, so such a free
    counts from the next recorded event on (a free there of memory from before the window still
    counts, at the size the allocator has for it). Without it an allocation whose memory is
    allocated again while it is live (:func:`freed_unseen`) counts only at the moment it is
    made."""
    made: set[int] = set()
    from_before: list[int] = []  # per event, the bytes it frees of memory from before the window
    for _, ptr, size, *_rest in events:
        freed = 0
        if size > 0:
            made.add(ptr)
        elif ptr in made:
            made.discard(ptr)
        else:
            freed = -size
        from_before.append(freed)
    if every_thread and events and len(events[0]) > 3:
        base = events[0][3] - events[0][2]  # the allocator's total before the first event
        series, uncounted = [], 0
        for (t, _, _, total), b in zip(events, from_before):
            uncounted += b
            series.append((t, total - base + uncounted, total - base + uncounted))
        return series
    unseen = freed_unseen(events)
    series = []
    live = 0
    for i, ((t, _, size, *_rest), b) in enumerate(zip(events, from_before)):
        live += size + b
        at = live
        if i in unseen:  # its free was not recorded: counted only as it is made
            live -= size
        series.append((t, at, live))
    return series


#: Line prefixes of kineto's informational log (its ``STAGE`` and ``USDT`` levels), which it
#: writes straight to file descriptor 2 when a profiler starts and stops.
KINETO_LOG_PREFIXES = ("USDT:", "STAGE:")


@contextlib.contextmanager
def without_kineto_log() -> Iterator[None]:
    """Drop kineto's informational lines written to file descriptor 2 inside the block; anything
    else written there meanwhile (warnings, errors) is written back after it. Setting
    ``KINETO_LOG_LEVEL`` instead only works before the process's first profiler starts."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            kept = [ln for ln in text.splitlines(keepends=True) if not ln.startswith(KINETO_LOG_PREFIXES)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def without_collection() -> Iterator[None]:
    """Python's cyclic garbage collected once, then the collector off in the block. With the
    allocator's totals (frees on every thread counted) the level is relative to the window's
    start, and a collection inside it freeing garbage from before (a dropped model's compiled
    graphs) read as the step allocating less: one step of an Inductor graph allocating 278 KB
    read 0 B in CI (stop 62). (lynx's step recorder collects before it records, too.)"""
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cpu_peak_bytes(fn: Callable[[], Any], exclude: Callable[[], set[int]] | None = None) -> int:
    """Peak of live CPU-allocator bytes while ``fn`` runs, relative to its start.

    ``exclude()`` (called after ``fn``) gives addresses whose *last* allocation in the window is
    left out: the gradients the step leaves in ``.grad``."""
    from torch.profiler import ProfilerActivity, profile

    from lynx_compile import _compat

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with _compat.cpu_allocator_counts_every_thread() as every_thread, without_collection():
        with without_kineto_log():  # only around start / stop: what fn() writes goes through as written
            prof.start()
        try:
            fn()
        finally:
            with without_kineto_log():
                prof.stop()
    events = _allocation_events(prof)
    skipped = [0] * len(events)  # per event, the bytes of left-out allocations made up to it
    if exclude is not None:
        last = {ptr: i for i, (_, ptr, size, _) in enumerate(events) if size > 0}
        for i in {last[p] for p in exclude() if p in last}:
            skipped[i] = events[i][2]
        for i in range(1, len(skipped)):
            skipped[i] += skipped[i - 1]
    peak = 0
    for (_, at, _), skip in zip(live_series(events, every_thread), skipped):
        peak = max(peak, at - skip)
    return peak


def cuda_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Caching-allocator peak above what is allocated when ``fn`` starts."""
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def step_times(step_fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``step_fn``: CUDA events around each run on CUDA
    (runs back to back, one synchronization at the end), ``time.perf_counter`` otherwise."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            step_fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) / 1e3 for start, end in events]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step_fn()
        times.append(time.perf_counter() - start)
    return times


def measure_step(step_fn: Callable[[], Any], *, device: str | torch.device = "cpu",
                 repeats: int = 3, warmup: int = 1, plan: Any = None,
                 params: Iterable[torch.Tensor] | None = None) -> StepMeasurement:
    """Run ``step_fn`` (a forward + backward) ``warmup`` times, then time it ``repeats`` times
    and measure its peak memory once more: the step's peak as a budget bounds it
    (``lynx_compile.budget``), everything the step allocates above what is allocated when it
    starts.

    ``params``: the model's parameters. Each gets a ``.grad`` (zeros where it has none) before
    the measured run, as in steady-state training, so the gradient storage is what is allocated
    when the step starts and the gradients the backward returns count while they are alive
    (a compiled backward returns them all together; autograd then adds each into ``.grad``).
    Without ``params`` the ``.grad`` tensors the step creates count too."""
    device = torch.device(device)
    for _ in range(warmup):
        step_fn()
    times = step_times(step_fn, device, repeats)
    for p in params if params is not None else ():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    if device.type == "cuda":
        peak, method = cuda_peak_bytes(step_fn, device), "cuda-allocator"
    else:
        peak, method = cpu_peak_bytes(step_fn), "cpu-profiler-memory-events"
    return StepMeasurement(peak_bytes=peak, step_s=statistics.median(times),
                           step_times_s=tuple(times), device=str(device), method=method,
                           predicted_peak_bytes=plan.peak_bytes if plan is not None else None,
                           predicted_saved_bytes=plan.saved_bytes if plan is not None else None)


def grad_snapshot(model: torch.nn.Module) -> list[Optional[torch.Tensor]]:
    """A copy of every parameter's ``.grad`` (fp32, on the CPU; None where there is none)."""
    return [None if p.grad is None else p.grad.detach().float().cpu().clone() for p in model.parameters()]


def grad_rel_diff(grads: Sequence[Optional[torch.Tensor]], ref: Sequence[Optional[torch.Tensor]]) -> float:
    """Max over parameters of max|g - r| / max(max|r|, 1e-6 * R), R = the largest |r| of any
    parameter (a missing gradient counts as zeros). The floor keeps gradients that are zero in
    exact arithmetic (e.g. a key projection's bias: softmax ignores a per-query constant) from
    turning rounding noise into a large relative difference."""
    pairs = [(g, r) for g, r in zip(grads, ref, strict=True) if g is not None or r is not None]
    pairs = [(torch.zeros_like(r) if g is None else g, torch.zeros_like(g) if r is None else r) for g, r in pairs]
    floor = 1e-6 * max((r.abs().max().item() for _, r in pairs), default=0.0)
    worst = 0.0
    for g, r in pairs:
        scale = max(r.abs().max().item(), floor) or 1.0
        worst = max(worst, (g - r).abs().max().item() / scale)
    return worst
