"""A line on stderr while lynx works longer than a few seconds on one graph.

Compiling a graph (tracing its backward, planning the recompute, Inductor's code generation) can
take a minute on a large model, and until now nothing was printed: the user could not tell work
from a hang. :class:`Progress` wraps such work: silent when it ends within ``after_s`` seconds,
else one line then (``lynx: graph 0 (194 nodes): tracing, planning and compiling, 5 s so far``), another
every ``every_s`` seconds, and one when it ends (``... done in 41.2 s``; none when it raises:
the error says what happened). The lines come from a
timer thread; the work itself runs undisturbed on the calling thread.

``LYNX_PROGRESS=0`` turns the lines off (``verbose`` / ``LYNX_DEBUG`` logs more detail on its
own); a ``Progress`` entered inside another on the same thread (a backend called while another
graph compiles) prints nothing of its own. A graph's first compile is wrapped
(``LynxBackend.__call__``), and each compile again for the step's plan (``step.recorder``, at step
3: ``graph 3 (412 nodes): planning and compiling again as the step's plan chose ('torch@0.3')``);
Inductor's backward, compiled lazily at the first backward, prints nothing of its own.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

AFTER_S = 5.0
"""Seconds of work before the first line."""
EVERY_S = 15.0
"""Seconds between the lines that follow."""

_active = threading.local()


def enabled() -> bool:
    """Whether progress lines print (``LYNX_PROGRESS`` unset or not ``0``)."""
    return os.environ.get("LYNX_PROGRESS", "1").strip().lower() not in ("0", "false", "no", "off")


class Progress:
    """Context manager: progress lines for the work inside it (module docstring)."""

    def __init__(self, what: str, *, after_s: float = AFTER_S, every_s: float = EVERY_S,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.what, self.after_s, self.every_s = what, after_s, every_s
        self._stream, self._clock = stream, clock
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._start = 0.0
        self._said = False
        self._done = False
        self._outer = False

    def __enter__(self) -> "Progress":
        self._start = self._clock()
        self._outer = not getattr(_active, "on", False) and enabled()
        if self._outer:
            _active.on = True
            self._schedule(self.after_s)
        return self

    def __exit__(self, *exc) -> None:
        if not self._outer:
            return
        _active.on = False
        with self._lock:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()
            if self._said and exc[0] is None:  # (an error says what happened itself)
                self._write(f"lynx: {self.what}: done in {self._clock() - self._start:.1f} s")

    def _schedule(self, delay: float) -> None:
        self._timer = threading.Timer(delay, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        with self._lock:
            if self._done:
                return
            self._said = True
            self._write(f"lynx: {self.what}, {self._clock() - self._start:.0f} s so far")
            self._schedule(self.every_s)

    def _write(self, line: str) -> None:
        stream = self._stream or sys.stderr
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to tell
            pass


__all__ = ["AFTER_S", "EVERY_S", "Progress", "enabled"]
