"""Progress lines (``lynx_compile.compiler.progress``): silent for short work, a line while long work
runs and one at its end; off with LYNX_PROGRESS=0; nested work prints under the outer only.
A fake clock and short thresholds: nothing here depends on how fast the machine is."""
from __future__ import annotations

import io
import threading

from lynx_compile.compiler.progress import Progress


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _wait_for(stream: io.StringIO, lines: int, event: threading.Event, limit_s: float = 30.0) -> None:
    """Until ``stream`` holds ``lines`` lines (the timer thread wrote them); fails after ``limit_s``."""
    for _ in range(int(limit_s / 0.01)):
        if stream.getvalue().count("\n") >= lines:
            return
        event.wait(0.01)
    raise AssertionError(f"no progress line within {limit_s} s: {stream.getvalue()!r}")


def test_short_work_is_silent():
    out = io.StringIO()
    with Progress("graph 0", after_s=60.0, stream=out):
        pass
    assert out.getvalue() == ""


def test_long_work_says_so_while_it_runs_and_when_it_ends():
    out, clock, tick = io.StringIO(), _Clock(), threading.Event()
    with Progress("graph 3 (120 nodes): planning", after_s=0.01, every_s=60.0, stream=out, clock=clock):
        clock.t = 107.0
        _wait_for(out, 1, tick)  # the timer's first line, while the work is still inside
        clock.t = 112.25
    lines = out.getvalue().splitlines()
    assert lines == ["lynx: graph 3 (120 nodes): planning, 7 s so far",
                     "lynx: graph 3 (120 nodes): planning: done in 12.2 s"]


def test_work_that_raises_leaves_the_error_to_say_so():
    out, clock, tick = io.StringIO(), _Clock(), threading.Event()
    try:
        with Progress("graph 1", after_s=0.01, every_s=60.0, stream=out, clock=clock):
            clock.t = 103.0
            _wait_for(out, 1, tick)
            raise KeyError("x")
    except KeyError:
        pass
    assert out.getvalue().splitlines() == ["lynx: graph 1, 3 s so far"]


def test_off_with_lynx_progress_0_and_nested_work_prints_once(monkeypatch):
    out = io.StringIO()
    monkeypatch.setenv("LYNX_PROGRESS", "0")
    with Progress("graph 0", after_s=0.0, stream=out):
        threading.Event().wait(0.05)
    assert out.getvalue() == ""
    monkeypatch.delenv("LYNX_PROGRESS")
    outer_out, inner_out, tick = io.StringIO(), io.StringIO(), threading.Event()
    with Progress("outer", after_s=0.01, every_s=60.0, stream=outer_out):
        with Progress("inner", after_s=0.0, stream=inner_out):
            _wait_for(outer_out, 1, tick)
    assert inner_out.getvalue() == "" and outer_out.getvalue().startswith("lynx: outer, ")
