"""compiler="inductor": lynx's partition, then Inductor kernels for the fw/bw graphs."""
import copy

import pytest
import torch

import lynx_compile
from lynx_compile.models import build_model, example_batch


@pytest.mark.slow
def test_inductor_compiled_graphs_match_eager():
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)  # Inductor draws its own random numbers
    x = example_batch(model, 2)
    twin = copy.deepcopy(model)
    ref = model(x).loss
    ref.backward()
    backend = lynx_compile.backend(policy="full", compiler="inductor", disable_passes=("annotate_costs_pass",))
    loss = torch.compile(twin, backend=backend)(x).loss
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert backend.plans[-1].recomputed
