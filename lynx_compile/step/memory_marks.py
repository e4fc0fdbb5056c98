"""Memory over one training step, between marks the caller places (``lynx_compile.step.recorder``
marks every piece boundary of a model compiled in pieces): per mark, the highest bytes allocated
since the previous one, and the bytes allocated at the mark itself (its level: where the segment
after it starts, ``step.model.Segment.start``).

``ProfilerRecording`` (CPU: the allocator has no counters) reads a memory-profiling profiler's
allocator events; ``AllocatorRecording`` (CUDA) the caching allocator's peak statistics. Both:
``start()`` (False when it cannot start), ``restart()`` (the recording starts again here),
``cancel()`` (stop without reading), ``mark(i)``, ``stop_after_backward(then)`` (called from
inside the backward that ends the step: ``then()`` once it can be read), ``finish(n_marks)`` (per
mark: its segment's peak and its level, None for a mark not seen).
"""
from __future__ import annotations

import bisect
import contextlib
import logging
from typing import Callable, Collection, Sequence

import torch

from lynx_compile import _compat

log = logging.getLogger("lynx_compile")
MARK = "lynx.piece."
"""Prefix of the ``record_function`` names of the marks."""
RESTART = "lynx.restart."
"""Prefix of the ``record_function`` name of a recording's restart (``ProfilerRecording.restart``)."""


class ProfilerRecording:
    """Memory over a step from the profiler's allocator events (CPU: the allocator has no
    counters), cut at ``record_function`` marks (one clock). The profiler is stopped as soon as
    the backward call returns: stopped inside the backward, the autograd engine would switch it
    back on when it restores the thread's state (a watch on Python's profile hook for the
    return of ``torch.autograd.graph._engine_run_backward``; when another tool holds that hook,
    at the next piece call)."""

    def __init__(self):
        self._profiler = None
        self._restarts = 0
        self.peak_bytes: int | None = None
        """Once finished: the window's highest live bytes read as every other step is measured
        (``memory.measure.live_series``, as ``cpu_peak_bytes``: no buffer held), for a tool that
        measures every step and cannot run its own profiler over this one."""

    def start(self) -> bool:
        if _compat.profiler_running():
            log.info("lynx: a profiler is running; the step record that plans the compiled pieces together "
                     "waits for a step without one")
            return False
        from torch.profiler import ProfilerActivity, profile

        from lynx_compile.memory.measure import without_kineto_log

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                 record_shapes=True)  # which op took which tensor: handed_gone_at_last_use
        # frees on threads the profiler does not follow are counted in the events' totals
        self._counting = contextlib.ExitStack()
        self._every_thread = self._counting.enter_context(_compat.cpu_allocator_counts_every_thread())
        with without_kineto_log():
            self._profiler.start()
        return True

    def mark(self, i: int) -> None:
        with torch.profiler.record_function(f"{MARK}{i}"):
            pass

    def restart(self) -> None:
        """The recording starts again here: what the profiler recorded before is left out when it
        is read (``finish``). The profiler is not stopped and started again: stopped inside
        profiler ranges that began under it (the frames dynamo compiled), its freed event storage
        is written to when they end while another profiler is on (``StepRecorder.outside_recording``)."""
        self._restarts += 1
        with torch.profiler.record_function(f"{RESTART}{self._restarts}"):
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
        if self._restarts:  # the window starts at the last restart
            start = _compat.profiler_marks(prof, RESTART)[f"{RESTART}{self._restarts}"]
            events = [e for e in events if e[0] >= start]
        from lynx_compile.memory.measure import live_series

        self.peak_bytes = max((at for _, at, _ in live_series(events, self._every_thread)), default=0)
        return segment_memory(events, [times.get(f"{MARK}{i}") for i in range(n_marks)], self._every_thread,
                              held=_compat.collective_held_allocations(prof), inputs=_compat.tensor_inputs(prof))


def segment_memory(events: list[tuple[int, ...]], mark_times: list[int | None],
                   every_thread: bool = False,
                   held: Collection[tuple[int, int]] = (),
                   inputs: Sequence[tuple[int, int, int, bool]] = ()) -> tuple[list[int | None], list[int | None]]:
    """Per mark, the highest live bytes between the previous mark and it, and the live bytes at
    the mark, from allocator ``events`` (time, address, signed bytes[, allocator's total])
    relative to the first event's start; None for a mark with no time. How the live bytes are
    read (frees of tensors from before the window, frees on threads the profiler does not
    follow, ``every_thread``): ``memory.measure.live_series``. The allocations ``held`` (time,
    address) are counted live to the first mark after their free: :func:`held_to_next_mark`; the
    tensors handed to a collective (``inputs``, the ops' tensor inputs) and freed by the process
    group's worker, to the end of their last use: :func:`handed_gone_at_last_use`."""
    from lynx_compile.memory.measure import live_series

    order = sorted((t, i) for i, t in enumerate(mark_times) if t is not None)
    drops = unexplained_drops(events)
    series = held_to_next_mark(events, live_series(events, every_thread), held, [t for t, _ in order],
                               every_thread, drops)
    series = handed_gone_at_last_use(events, series, inputs, held, every_thread, drops)
    out: list[int | None] = [None] * len(mark_times)
    levels: list[int | None] = [None] * len(mark_times)
    live = peak = 0
    e = 0
    for t, i in order:
        while e < len(series) and series[e][0] < t:
            _, at, live = series[e]
            peak = max(peak, at)
            e += 1
        out[i], levels[i] = peak, live
        peak = live
    return out, levels


def held_to_next_mark(events: Sequence[tuple[int, ...]], series: list[tuple[int, int, int]],
                      held: Collection[tuple[int, int]], marks: Sequence[int],
                      every_thread: bool = True, drops: list[int] | None = None) -> list[tuple[int, int, int]]:
    """``series`` (``memory.measure.live_series``: per event of ``events``, time, bytes live at it,
    bytes live after it) with each allocation in ``held`` (time, address: buffers a collective's
    work holds, ``_compat.collective_held_allocations``) counted live up to the first of the
    sorted ``marks`` after its free as the step's own thread made it (not at the mark itself: the
    next segment starts without it).

    Such a buffer is freed by whichever thread drops the work last: the step's thread after it
    waits, or the process group's worker when it gets the CPU after finishing (a free the
    profiler does not record; the allocator's total, the events' fourth field, shows it gone at
    the first event after it). Which one, and when, changes from run to run: gloo's copy of
    FSDP2's reduce-scatter input (22 MB, deepseek_v3's MoE block) was freed before the next
    block's parameters were all-gathered in one run and after them in another, and that step
    read 16.85 MB higher (issue S items 1 and 4). A functional collective's output (a compiled TP
    block's all-gather: the work holds it too, and gloo's worker freed it in some runs, the block
    in others, moving llama3's backward segment by 256 KiB) is held like the process group's own
    buffers since session 40; the tensors a caller makes and hands to a collective are not
    (``docs/budget_pieces.md``): :func:`handed_gone_at_last_use` reads those.

    - A free the step's thread made (recorded): live to the first mark after it.
    - A free the worker made (not recorded; ``every_thread``: read from the total's unexplained
      drops) means the step's thread had dropped the buffer before, at a point the events do not
      show: it is read as made in the segment the buffer was allocated in, so live to the first
      mark after its allocation, whenever the worker got to it. In session 42 the worker freed
      FSDP2's reduce-scatter copy (199,936 B, gpt-tiny's block) after the next backward's mark in
      1 of 24 runs, and the step's plan came out another (1,420,168 B predicted, 1,425,544 in the
      others): read so, the step reads the same in every run. It under-counts the worker's
      delay (CPU only: a CUDA step is read from the caching allocator, ``AllocatorRecording``).
    """
    if not held or not marks:
        return series
    held = set(held)
    sizes = {k: e[2] for k, e in enumerate(events) if e[2] > 0 and (e[0], e[1]) in held}
    if not sizes:
        return series
    freed_at, by_worker = _frees(events, sizes, {}, every_thread,
                                 unexplained_drops(events) if drops is None else drops)
    out = list(series)
    for i in sorted(freed_at.keys() | by_worker):
        k = freed_at.get(i, len(events))  # the worker's free not seen at all: after the window
        if i in by_worker:  # read as freed in the segment it was allocated in
            release = bisect.bisect_right(marks, events[i][0])
            if release < len(marks) and (k == len(events) or events[k][0] >= marks[release]):
                _gone_from_mark(out, range(i, k), marks[release], sizes[i])
                continue
        at = bisect.bisect_right(marks, events[k][0]) if k < len(events) else len(marks)
        _live_to_mark(out, k, marks[at] if at < len(marks) else None, sizes[i])
    return out


def handed_gone_at_last_use(events: Sequence[tuple[int, ...]], series: list[tuple[int, int, int]],
                            inputs: Sequence[tuple[int, int, int, bool]], held: Collection[tuple[int, int]],
                            every_thread: bool = True, drops: list[int] | None = None) -> list[tuple[int, int, int]]:
    """``series`` with each tensor the step made and handed to a collective (``inputs``:
    ``_compat.tensor_inputs``) that the process group's worker freed read as freed where the
    last op that took it ended.

    The work holds what it was handed until it finishes; whichever thread drops such a tensor
    last frees it. The step's own thread drops it just after its last use (the generated code
    deletes a buffer after the call that takes it last): a free recorded there. When the work is
    still running then, the worker frees it as it finishes, unrecorded (the allocator's total,
    ``every_thread``, shows it at the first event after), and it read live up to there: a
    sequence-parallel all-gather's 128 KiB input in llama3's TP block read through its
    segment's peak in 1 of 16 runs of the eager compiler's refusal (0.859 named, 0.857 in the
    others). The worker freeing it means the step's thread let go first, after the last use:
    read so, the step reads alike whichever thread freed it. A free the total shows is taken for
    a handed tensor's only where the drop is exactly its size, after its last use (a handed
    tensor that lives on past the window, a gradient handed to an all-reduce, must not take
    another buffer's free: read early, it would be counted gone while it is live); otherwise
    the tensor is read as before. The buffers a collective's work holds of its own (``held``:
    :func:`held_to_next_mark`) are not read here; ``drops`` are the total's unexplained drops
    that reading left."""
    if not every_thread or drops is None or not inputs:
        return series
    held = set(held)
    last = {k: end for k, end in _last_uses(events, inputs).items() if (events[k][0], events[k][1]) not in held}
    if not last:
        return series
    freed_at, by_worker = _frees(events, {k: events[k][2] for k in last}, last, every_thread, drops, exact=True)
    out = list(series)
    for i in sorted(by_worker & freed_at.keys()):  # gone from the end of its last use to the worker's free
        _gone_from_mark(out, range(i, freed_at[i]), last[i], events[i][2])
    return out


def _last_uses(events: Sequence[tuple[int, ...]], inputs: Sequence[tuple[int, int, int, bool]]) -> dict[int, int]:
    """Per allocation (index in ``events``) a collective took (``inputs``: (start, end, address,
    is a collective) per op's tensor input), the end of the last op that took it: the
    allocation at that address most recently made when the op started."""
    made: dict[int, list[tuple[int, int]]] = {}  # address -> (time, index) of its allocations
    for k, (t, ptr, size, *_rest) in enumerate(events):
        if size > 0:
            made.setdefault(ptr, []).append((t, k))
    last: dict[int, int] = {}
    handed: set[int] = set()
    for start, end, ptr, collective in inputs:
        at = made.get(ptr)
        n = bisect.bisect_right(at, (start, len(events))) if at else 0
        if not n:
            continue
        k = at[n - 1][1]
        last[k] = max(last.get(k, end), end)
        if collective:
            handed.add(k)
    return {k: last[k] for k in handed}


def unexplained_drops(events: Sequence[tuple[int, ...]]) -> list[int] | None:
    """Per event (time, address, signed bytes, allocator's total), the bytes the total lost
    between the previous event and it that no recorded event explains (frees on threads the
    profiler does not follow); None without totals."""
    if not events or len(events[0]) <= 3:
        return None
    return [0] + [events[k - 1][3] - (events[k][3] - events[k][2]) for k in range(1, len(events))]


def _frees(events: Sequence[tuple[int, ...]], sizes: dict[int, int], after: dict[int, int],
           every_thread: bool, drops: list[int] | None, exact: bool = False) -> tuple[dict[int, int], set[int]]:
    """For the allocations ``sizes`` (index in ``events`` -> bytes): the index of the first event
    after each one's free (a free recorded, or one the allocator's total shows: ``drops``, used
    up here, matched to the allocations waiting, each from its allocation or from the time
    ``after`` gives it on: first come first served by size, or with ``exact`` the first whose
    size is the whole drop), and those the events do not record a free of (freed by another
    thread: read so only with ``every_thread``)."""
    from lynx_compile.memory.measure import freed_unseen

    unseen = freed_unseen(events) & sizes.keys()
    freed_at: dict[int, int] = {}
    open_: dict[int, int] = {}  # address -> allocation whose free may be recorded
    for k, (_, ptr, size, *_rest) in enumerate(events):
        if size > 0:
            open_.pop(ptr, None)
            if k in sizes and k not in unseen:
                open_[ptr] = k
        elif ptr in open_:
            freed_at[open_.pop(ptr)] = k
    waiting = sorted(set(open_.values()) | unseen)  # frees not recorded: from the total's unexplained drops
    by_worker = set(waiting) if every_thread and drops is not None else set()
    if waiting and drops is not None:
        times = [e[0] for e in events]
        # the first event whose drop can be its free: after its allocation and after ``after``
        ready = sorted((max(i + 1, bisect.bisect_left(times, after[i]) + 1) if i in after else i + 1, i)
                       for i in waiting)
        queue: list[int] = []
        by_size: dict[int, list[int]] = {}  # exact: the waiting by size, first come first
        r = 0
        for k in range(1, len(events)):
            while r < len(ready) and ready[r][0] <= k:
                i = ready[r][1]
                r += 1
                if exact:
                    by_size.setdefault(sizes[i], []).append(i)
                else:
                    queue.append(i)
            if exact:  # the first waiting whose size is the whole drop
                if drops[k] > 0 and by_size.get(drops[k]):
                    freed_at[by_size[drops[k]].pop(0)] = k
                    drops[k] = 0
                continue
            while queue and 0 < sizes[queue[0]] <= drops[k]:
                drops[k] -= sizes[queue[0]]
                freed_at[queue.pop(0)] = k
    return freed_at, by_worker


def _ends_before(out: list[tuple[int, int, int]], j: int, mark: int) -> bool:
    """Event ``j`` is the last one before ``mark``."""
    return j + 1 == len(out) or out[j + 1][0] >= mark


def _live_to_mark(out: list[tuple[int, int, int]], start: int, mark: int | None, nbytes: int) -> None:
    """``nbytes`` more live in the series ``out`` from event ``start`` up to ``mark`` (to the end
    without one), and after the last event before it (gone at the mark)."""
    for j in range(start, len(out)):
        t, level, after = out[j]
        if mark is not None and t >= mark:
            break
        last = mark is not None and _ends_before(out, j, mark)
        out[j] = (t, level + nbytes, after + (0 if last else nbytes))


def _gone_from_mark(out: list[tuple[int, int, int]], span: range, mark: int, nbytes: int) -> None:
    """``nbytes`` less live in the series ``out`` over ``span`` from ``mark`` (a time) on, and
    after the last event before it (what follows ``mark`` starts without it)."""
    for j in span:
        t, level, after = out[j]
        if t >= mark:
            out[j] = (t, level - nbytes, after - nbytes)
        elif _ends_before(out, j, mark):
            out[j] = (t, level, after - nbytes)


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

    def restart(self) -> None:
        self.start()

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
        self.peak_bytes = max(self._peaks, default=None)  # the allocator's own: nothing held
        return pad(self._peaks), pad(self._levels)
