"""``runtime.prefetch.GraphRuntime`` (option ``recompute_in_wait``, a pipeline stage's early
recompute) keeps a micro-batch's saved tensors from its forward only until its backward (or its
early run) takes them. Reference: eager PyTorch running the same micro-batches, after which
nothing but the gradients stays allocated."""
import pytest
import torch

import lynx_compile
from lynx_compile import _compat
from lynx_compile.models import build_model, example_batch
from lynx_compile.runtime.prefetch import microbatch

MICRO = 3


def _left_allocated(step, params) -> int:
    """Bytes ``step()`` allocated and left allocated (CPU allocator events), ``.grad`` excluded."""
    from torch.profiler import ProfilerActivity, profile

    from lynx_compile.memory.measure import without_kineto_log

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with without_kineto_log():
        prof.start()
    step()
    with without_kineto_log():
        prof.stop()
    live: dict[int, int] = {}
    for _, ptr, size in _compat.cpu_allocation_events(prof):
        if size > 0:
            live[ptr] = size
        else:
            live.pop(ptr, None)
    grads = {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    return sum(size for ptr, size in live.items() if ptr not in grads)


def _microbatches(fn, xs, early=None):
    """Forwards of every micro-batch (a pipeline's warm-up), then their backwards out of order."""
    losses = []
    for j, x in enumerate(xs):
        with microbatch(j):
            losses.append(fn(x).loss)
    for j in (2, 0, 1):
        if early is not None:
            early(j)
        with microbatch(j):
            losses[j].backward()
    losses.clear()


@pytest.mark.parametrize("policy", ["none", "full"])
def test_saved_tensors_die_at_their_microbatch_backward(policy):
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.0)
    xs = [example_batch(model, 2) for _ in range(MICRO)]
    backend = lynx_compile.LynxBackend(lynx_compile.make_config(
        {"policy": policy, "compiler": "eager", "recompute_in_wait": True}))
    compiled = torch.compile(model, backend=backend)
    params = list(model.parameters())
    _microbatches(compiled, xs)  # compiles (the backward lazily, after the first forward)
    for p in params:
        p.grad = None
    eager = _left_allocated(lambda: _microbatches(model, xs), params)
    for p in params:
        p.grad = None
    # policy full: the backward has a recompute prefix, run early for every micro-batch
    early = backend.runtimes.run_early if policy == "full" else None
    left = _left_allocated(lambda: _microbatches(compiled, xs, early), params)
    assert [rt.split is not None for rt in backend.runtimes.prefetch] == [policy == "full"]
    if policy == "full":
        assert backend.runtimes.prefetch[0].early_runs == MICRO
    # before the fix, policy none left every micro-batch's saved tensors allocated (~1.5 MiB here)
    assert left == eager, (left, eager)
