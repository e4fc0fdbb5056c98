"""Training steps of a zoo model compiled whole or per block, each step's allocator-event peak
measured (``.grad`` allocated before the model is passed in, zeroed before each step, as the
peers are measured): the loop shared by the tests of the model's own checkpointing and of
budgets per region."""
import torch

from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import example_batch


def measured_steps(model, backend, style="whole", steps=2, unmeasured=()):
    """(peak of each measured step, the last step's gradients) of ``model`` compiled with
    ``backend`` whole (``torch.compile``) or per block (``block.compile`` on ``model.blocks``), on
    a seeded batch of 4. Steps in ``unmeasured`` (1-based) run without the profiler."""
    x = example_batch(model, 4, generator=torch.Generator().manual_seed(1))
    if style == "whole":
        run = torch.compile(model, backend=backend)
    else:
        for block in model.blocks:
            block.compile(backend=backend)
        run = model
    peaks = []
    for step in range(1, steps + 1):
        for p in model.parameters():
            p.grad.zero_()
        if step in unmeasured:
            run(x).loss.backward()
            continue
        peaks.append(cpu_peak_bytes(lambda: run(x).loss.backward()))
    return peaks, [p.grad.clone() for p in model.parameters()]
