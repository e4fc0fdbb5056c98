"""``lynx_compile.memory.measure.cpu_peak_bytes`` against sizes computed by hand."""
import gc

import torch

from lynx_compile.memory.measure import cpu_peak_bytes


class _Cycle:
    """An object in a reference cycle: freed only by Python's cyclic collector."""


def test_garbage_from_before_the_window_does_not_lower_the_peak():
    """A 4 MB tensor left in a reference cycle, allocated while an earlier measurement ran (so
    the allocator knows its size), becomes garbage before the window. The measured step
    allocates 400,000 B (100 x 1000 float32) and triggers a collection itself: its peak is those
    bytes, not 0 (before the fix the collection's 4 MB free pulled the level below the start)."""
    held = {}

    def make():
        node = _Cycle()
        node.self, node.tensor = node, torch.randn(1000, 1000)
        held["node"] = node

    cpu_peak_bytes(make)
    del held["node"]
    kept = []

    def step():
        gc.collect()
        kept.append(torch.empty(100, 1000))

    peak = cpu_peak_bytes(step)
    assert 100 * 1000 * 4 <= peak < 100 * 1000 * 4 + 4096, peak
    assert gc.isenabled()
