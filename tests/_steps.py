"""Training steps with each step's allocator-event peak measured.

``step_peaks`` is the loop: ``.grad`` reset before each step as a training loop leaves it
(``reset_grads``), the step run under ``cpu_peak_bytes`` but for the steps left unmeasured (lynx
records a step of a model in pieces only where no other profiler runs around it).
``measured_steps`` runs it on a zoo model compiled whole or per block, ``.grad`` allocated before
the model is passed in (as the peers are measured): the loop shared by the tests of the model's
own checkpointing and of budgets per region; ``tests/test_ddp.py`` and
``benchmarks/bench_ddp.py`` run it under DDP."""
import torch

from lynx_compile.compiler.dynamo_backend import LynxBackend
from lynx_compile.config import make_config
from lynx_compile.memory.measure import cpu_peak_bytes
from lynx_compile.models import example_batch


def per_block(model, options: dict, **compile_kw) -> LynxBackend:
    """A lynx backend with ``options`` (no plan cache) compiling each of ``model.blocks`` apart
    (``block.compile(backend=..., **compile_kw)``), as torchtitan's trainer compiles."""
    backend = LynxBackend(make_config({**options, "plan_cache": False}))
    for block in model.blocks:
        block.compile(backend=backend, **compile_kw)
    return backend


def reset_grads(params, grads: str) -> None:
    """``grads="none"``: ``zero_grad()``'s default (the step allocates its gradients);
    ``"allocated"``: ``zero_grad(set_to_none=False)`` (allocated first where still None)."""
    for p in params:
        if grads == "none":
            p.grad = None
        elif p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def step_peaks(step, params, steps: int, grads: str = "allocated", unmeasured=()):
    """Yields the measured peak of each of ``steps`` calls of ``step`` (None for the 1-based
    steps in ``unmeasured``), ``params``' ``.grad`` reset as ``grads`` says before each (a
    generator: a caller keeps the peaks of the steps before one that raises)."""
    for i in range(1, steps + 1):
        reset_grads(params, grads)
        if i in unmeasured:
            step()
            yield None
        else:
            yield cpu_peak_bytes(step)


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
    peaks = step_peaks(lambda: run(x).loss.backward(), list(model.parameters()), steps, unmeasured=unmeasured)
    return [p for p in peaks if p is not None], [p.grad.clone() for p in model.parameters()]
