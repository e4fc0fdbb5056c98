"""lynx runs torch's min-cut knapsack on numpy (``_compat.knapsack``) so that a graph planned
inside a step allocates nothing beside the step's activations. Reference: torch's own
``dp_knapsack``, whose answer it must give exactly (torch's min-cut at a budget is one of
lynx's candidates and the peers' torch.compile)."""
import random

import pytest
import torch
from torch._functorch import partitioners
from torch._functorch._activation_checkpointing.knapsack import dp_knapsack as torch_dp_knapsack

from lynx_compile._compat.knapsack import dp_knapsack, knapsack_off_the_allocator
from lynx_compile.memory.measure import cpu_peak_bytes


def _cases():
    rng = random.Random(0)
    for n in (1, 2, 7, 40):
        for _ in range(6):
            memory = [rng.choice((0.0, rng.random() * 0.3, 1.2)) for _ in range(n)]
            runtime = [rng.choice((rng.random(), 1.0, 0.0)) for _ in range(n)]  # ties too
            yield memory, runtime, rng.choice((0.0, 0.05, rng.random(), 1.0))


@pytest.mark.parametrize("memory,runtime,max_memory", list(_cases()))
def test_numpy_knapsack_gives_torchs_answer(memory, runtime, max_memory):
    assert dp_knapsack(memory, runtime, max_memory) == torch_dp_knapsack(memory, runtime, max_memory)


def test_inside_the_context_the_knapsack_allocates_no_torch_memory():
    memory, runtime = [0.01 * (i % 7 + 1) for i in range(60)], [float(i % 5) for i in range(60)]
    assert cpu_peak_bytes(lambda: torch_dp_knapsack(memory, runtime, 0.5)) > 60 * 5000 * 4  # its DP table
    with knapsack_off_the_allocator():
        assert partitioners.dp_knapsack is dp_knapsack
        assert cpu_peak_bytes(lambda: partitioners.dp_knapsack(memory, runtime, 0.5)) == 0
    assert partitioners.dp_knapsack is torch_dp_knapsack


def test_another_solver_configured_by_the_user_is_left_alone():
    with torch._functorch.config.patch(activation_memory_budget_solver="greedy"), knapsack_off_the_allocator():
        assert partitioners.dp_knapsack is torch_dp_knapsack
