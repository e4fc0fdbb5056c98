"""torch's min-cut knapsack, run off torch's allocator.

Below ``activation_memory_budget`` 1, torch's min-cut partition picks what to save with a 0-1
knapsack; its default solver (``activation_memory_budget_solver = "dp"``, 2.11-2.13) fills a
``(items + 1) x (10000 * budget + 1)`` float32 table of CPU tensors. lynx partitions with torch's
min-cut while it plans (its ``torch@`` candidates), and a graph compiled inside a step (a loss
compiled apart from the model) plans with the step's activations alive: on a CPU that table is
allocated by the allocator the step's peak is made of (gpt-tiny, model and loss apart, at 0.565:
step 1 0.597 of torch.compile's step against 0.549 at every later step). :func:`knapsack_off_the_allocator`
runs torch's "dp" solver on numpy arrays instead: the same quantization, float32 arithmetic and
backtracking, so the same answer (``tests/test_knapsack.py`` checks it against torch's own).
"""
from __future__ import annotations

import contextlib

import numpy as np
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners

# torch's quantization of the memory weights (knapsack.dp_knapsack's S)
_SCALE = 10000


def dp_knapsack(memory: list[float], runtime: list[float], max_memory: float) -> tuple[float, list[int], list[int]]:
    """torch's ``dp_knapsack`` (torch/_functorch/_activation_checkpointing/knapsack.py) on numpy:
    (the largest total runtime saved within ``max_memory``, the items saved, the items left to
    recompute), each list in torch's order."""
    quantized = [round(m * _SCALE) for m in memory]
    runtimes = np.asarray(runtime, dtype=np.float32)
    capacity = round(max_memory * _SCALE)
    n = len(memory)
    dp = np.zeros((n + 1, capacity + 1), dtype=np.float32)
    for i in range(1, n + 1):
        weight, value = quantized[i - 1], runtimes[i - 1]
        dp[i, :] = dp[i - 1, :]
        if weight == 0:
            dp[i, :] = dp[i - 1, :] + value
        else:
            dp[i, weight:] = np.maximum(dp[i - 1, weight:], dp[i - 1, :-weight] + value)
    saved, recomputed = [], []
    j = capacity
    for i in range(n, 0, -1):
        if dp[i, j] != dp[i - 1, j]:
            saved.append(i - 1)
            j -= quantized[i - 1]
        else:
            recomputed.append(i - 1)
    saved.reverse()
    return float(dp[n, capacity]), saved, recomputed


@contextlib.contextmanager
def knapsack_off_the_allocator():
    """A context in which torch's min-cut solves its knapsack with :func:`dp_knapsack` where it
    would use torch's "dp" solver (the default; the experimental ``dynamic_memory_budget_dp``
    calls it too); any other solver the user configured runs as configured."""
    original = getattr(_partitioners, "dp_knapsack", None)
    if original is None or original is dp_knapsack or _functorch_config.activation_memory_budget_solver not in (
            "dp", "dynamic_memory_budget_dp"):
        yield
        return
    _partitioners.dp_knapsack = dp_knapsack
    try:
        yield
    finally:
        _partitioners.dp_knapsack = original
