"""What is on the device as a compiled graph's step starts: the bytes ``device_budget`` holds
besides the step's peak (``GraphRecord.resident``, ``passes.graph_budget``)."""
from __future__ import annotations

import torch

from lynx_compile import _compat
from lynx_compile.memory import optimizer_state

RESIDENT_CUDA = ("parameters, buffers, optimizer state, inputs (torch.cuda.memory_allocated({device}) when "
                 "lynx compiled)")
RESIDENT_INPUTS = ("parameters, buffers, inputs (the unique storage bytes of the compiled graph's inputs{why})"
                   "{optimizer}")


def resident_bytes(example_inputs: list, *, plan_only: bool = False) -> tuple[int, str]:
    """(bytes, what they are) allocated on the device when the step of the graph whose real
    ``example_inputs`` dynamo passes starts: what ``device_budget`` holds besides the step's
    peak. On CUDA the caching allocator's ``memory_allocated`` (parameters, buffers, optimizer
    state once created, the batch, and anything else the program holds); elsewhere, and for a
    plan-only trace (``lynx plan``: no real step), the unique storages of the graph's tensor
    inputs (dynamo passes parameters and buffers as inputs): tied or viewed storages count once.
    Meta tensors have no addresses; each input tensor counts once."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    cuda = [t.device for t in tensors if t.device.type == "cuda"]
    if cuda and not plan_only:
        return int(torch.cuda.memory_allocated(cuda[0])), RESIDENT_CUDA.format(device=cuda[0])
    storages: dict[tuple, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = 0 if _compat.is_plain_fake(t) else storage.data_ptr()  # (a stand-in's: no address)
        key = (str(t.device), ptr) if ptr else ("tensor", id(t))
        storages[key] = storage.nbytes()
    devices = ", ".join(sorted({t.device.type for t in tensors}))
    why = ": planning only, no real step" if plan_only else f": no allocator counter on {devices or 'cpu'}"
    state, what = (0, "") if plan_only else optimizer_state.state_bytes(
        t for t in tensors if isinstance(t, torch.nn.Parameter))
    optimizer = f" and the optimizer state of its parameters ({what})" if state else optimizer_state.COUNTED_LATER
    return sum(storages.values()) + state, RESIDENT_INPUTS.format(why=why, optimizer=optimizer)
