"""Measured per-node CPU costs add up to the measured step (within 20%).

The joint graph's nodes are exactly the ops the partitioned fw/bw run under policy "none", so
their measured times should sum to a training step's forward + backward; the rest is Python and
autograd overhead around the graphs (and gradient accumulation into .grad)."""
import torch

import lynx_compile
from lynx_compile.memory import measure_step
from lynx_compile.models import build_model, example_batch


def test_measured_node_costs_sum_to_step_time():
    torch.manual_seed(0)
    model = build_model("gpt-small", dropout=0.1)
    x = example_batch(model, 4)
    options = {"policy": "none", "cost_source": "measured", "measure_repeats": 7}
    compiled = torch.compile(model, backend="lynx", options=options)
    compiled(x).loss.backward()
    record = lynx_compile.backend(**options).records[-1]
    predicted = record.decisions["forward_s"] + record.decisions["backward_s"]
    step = measure_step(lambda: compiled(x).loss.backward(), repeats=9, warmup=2).step_s
    assert abs(predicted - step) <= 0.20 * step, (predicted, step)
