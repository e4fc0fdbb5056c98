"""Memory over one training step, between marks the caller places (``lynx_compile.step.recorder``
marks every piece boundary of a model compiled in pieces): per mark, the highest bytes allocated
since the previous one, and the bytes allocated at the mark itself (its level: where the segment
after it starts, ``step.model.Segment.start``).

``ProfilerRecording`` (CPU: the allocator has no counters) reads a memory-profiling profiler's
allocator events; ``AllocatorRecording`` (CUDA) the caching allocator's peak statistics. Both:
``start()`` (False when it cannot start), ``cancel()`` (stop without reading), ``mark(i)``, ``stop_after_backward(then)`` (called from
inside the backward that ends the step: ``then()`` once it can be read), ``finish(n_marks)`` (per
mark: its segment's peak and its level, None for a mark not seen).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from lynx_compile import _compat

log = logging.getLogger("lynx_compile")
MARK = "lynx.piece."
"""Prefix of the ``record_function`` names of the marks."""


class ProfilerRecording:
    """Memory over a step from the profiler's allocator events (CPU: the allocator has no
    counters), cut at ``record_function`` marks (one clock). The profiler is stopped as soon as
    the backward call returns: stopped inside the backward, the autograd engine would switch it
    back on when it restores the thread's state (a watch on Python's profile hook for the
    return of ``torch.autograd.graph._engine_run_backward``; when another tool holds that hook,
    at the next piece call)."""

    def __init__(self):
        self._profiler = None

    def start(self) -> bool:
        if _compat.profiler_running():
            log.info("lynx: a profiler is running; the step record that plans the compiled pieces together "
                     "waits for a step without one")
            return False
        from torch.profiler import ProfilerActivity, profile

        from lynx_compile.memory.measure import without_kineto_log

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        # frees on threads the profiler does not follow are counted in the events' totals
        self._counting = contextlib.ExitStack()
        self._every_thread = self._counting.enter_context(_compat.cpu_allocator_counts_every_thread())
        with without_kineto_log():
            self._profiler.start()
        return True

    def mark(self, i: int) -> None:
        with torch.profiler.record_function(f"{MARK}{i}"):
            pass

    def cancel(self) -> None:
        """Stop without reading (the step did not start where the recording did)."""
        from lynx_compile.memory.measure import without_kineto_log

        try:
            with without_kineto_log():
                self._profiler.stop()
        finally:
            self._counting.close()
            self._profiler = None

    def stop_after_backward(self, then: Callable[[], None]) -> None:
        _compat.watch_frame(_compat.engine_run_backward_code(), "return", lambda frame: then())

    def finish(self, n_marks: int) -> tuple[list[int | None], list[int | None]]:
        from lynx_compile.memory.measure import without_kineto_log

        try:
            with without_kineto_log():
                self._profiler.stop()
        finally:
            self._counting.close()
        prof, self._profiler = self._profiler, None
        events = _compat.cpu_allocation_events(prof, "cpu", totals=True)
        times = _compat.profiler_marks(prof, MARK)
        return segment_memory(events, [times.get(f"{MARK}{i}") for i in range(n_marks)], self._every_thread)


def segment_memory(events: list[tuple[int, ...]], mark_times: list[int | None],
                   every_thread: bool = False) -> tuple[list[int | None], list[int | None]]:
    """Per mark, the highest live bytes between the previous mark and it, and the live bytes at
    the mark, from allocator ``events`` (time, address, signed bytes[, allocator's total])
    relative to the first event's start; None for a mark with no time. How the live bytes are
    read (frees of tensors from before the window, frees on threads the profiler does not
    follow, ``every_thread``): ``memory.measure.live_series``."""
    from lynx_compile.memory.measure import live_series

    start, series = live_series(events, every_thread)
    order = sorted((t, i) for i, t in enumerate(mark_times) if t is not None)
    out: list[int | None] = [None] * len(mark_times)
    levels: list[int | None] = [None] * len(mark_times)
    live = peak = start
    e = 0
    for t, i in order:
        while e < len(series) and series[e][0] < t:
            _, at, live = series[e]
            peak = max(peak, at)
            e += 1
        out[i], levels[i] = peak, live
        peak = live
    return out, levels


class AllocatorRecording:
    """Memory over a step from CUDA's caching allocator: at each mark the peak since the last
    one (``max_memory_allocated``, then ``reset_peak_memory_stats``: a user reading the peak of
    the recorded step reads the last segment's)."""

    def start(self) -> bool:
        torch.cuda.synchronize()
        self._base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._peaks: list[int] = []
        self._levels: list[int] = []
        return True

    def mark(self, i: int) -> None:
        self._peaks.append(torch.cuda.max_memory_allocated() - self._base)
        self._levels.append(torch.cuda.memory_allocated() - self._base)
        torch.cuda.reset_peak_memory_stats()

    def cancel(self) -> None:
        pass

    def stop_after_backward(self, then: Callable[[], None]) -> None:
        then()

    def finish(self, n_marks: int) -> tuple[list[int | None], list[int | None]]:
        pad = lambda xs: [*xs, *([None] * (n_marks - len(xs)))][:n_marks]  # noqa: E731
        return pad(self._peaks), pad(self._levels)
