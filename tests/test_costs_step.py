"""Measured per-node CPU costs: every node is run on real tensors while compiling, and that
must not change the training step (same RNG stream, same parameters: loss and gradients equal
eager's, dropout on), and gives positive forward / backward totals.

Tests do not assert timings. How close the measured per-node costs add up to a measured step
(within 20% on an idle CPU) is checked by ``benchmarks/bench_measured_costs.py``."""
import copy
import math

import torch

import lynx_compile
from lynx_compile.models import build_model, example_batch


def test_measured_node_costs_leave_the_step_unchanged():
    torch.manual_seed(0)
    model = build_model("gpt-small", dropout=0.1)
    reference = copy.deepcopy(model)
    x = example_batch(model, 4)
    options = {"policy": "none", "cost_source": "measured", "measure_repeats": 3, "compiler": "eager"}
    compiled = torch.compile(model, backend="lynx", options=options)
    torch.manual_seed(5)
    loss = compiled(x).loss
    loss.backward()
    torch.manual_seed(5)
    ref_loss = reference(x).loss
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, ref.grad, rtol=1e-5, atol=1e-7), name
    record = lynx_compile.backend(**options).records[-1]
    assert record.stats["cost_source"] == "measured"
    for key in ("forward_s", "backward_s"):
        assert 0 < record.stats[key] < math.inf, key
    assert set(record.segment_costs["blocks"]) == set(range(model.config.n_layers))
