"""Activation offload ops: ``torch.ops.lynx.offload / offload_wait / reload / reload_wait``.

``offload_pass`` (``passes/offload.py``) rewrites the partitioned graphs with them, so a dump
shows where each copy starts and where it must be complete::

    forward:   x = producer(...)
               x_offload = lynx.offload(x)          # device→host copy starts (copy stream)
               ... forward ops (overlap the copy) ...
               lynx.offload_wait(x_offload, x)      # copy done; x may be freed after this
               return (..., x_offload)              # the host copy is the saved value
    backward:  x_reload = lynx.reload(x_offload, device)  # host→device copy starts, prefetched
               ... backward ops (overlap the copy) ...
               lynx.reload_wait(x_reload)           # compute stream waits for the copy
               first use of x_reload

CUDA: the copies run on one dedicated copy stream into pinned host memory (``non_blocking``);
each records an event the ``*_wait`` op makes the current stream wait on, and the source
tensor is ``record_stream``-ed on the copy stream so the caching allocator never reuses it
early. CPU: "host" is a second CPU buffer (a real copy, so ordering and gradients are
exercised) that numpy allocates, outside torch's CPU allocator: the step's measured peak (the
allocator's events, ``memory.measure``) counts device bytes only, as a GPU's does and as lynx's
simulation predicts; the waits are no-ops. The references (``offload_reference`` / ``reload_reference``)
are what the ops compute: a copy of the values, on another device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.node import has_side_effect

from lynx_compile.memory.storage import register_host_output_op

_EVENTS: dict[int, "torch.cuda.Event"] = {}
"""id(tensor produced by a copy) → the copy's event (CUDA only), popped by its wait."""
_STREAM: dict[torch.device, "torch.cuda.Stream"] = {}


def offload_reference(x: torch.Tensor) -> torch.Tensor:
    """What ``offload`` computes: the values of ``x`` in host memory."""
    return x.detach().to("cpu", copy=True)


def reload_reference(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What ``reload`` computes: the values of ``host`` on ``device``."""
    return host.to(device, copy=True)


def _copy_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _STREAM:
        _STREAM[device] = torch.cuda.Stream(device=device)
    return _STREAM[device]


def _cpu_host_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``x`` in memory numpy allocates (host memory's stand-in:
    torch's CPU allocator, whose events a step's measure reads, never sees it)."""
    import numpy as np

    raw = torch.from_numpy(np.empty(x.numel() * x.element_size(), dtype=np.uint8))
    host = raw.view(x.dtype).view(x.shape)
    host.copy_(x.detach())
    return host


@torch.library.custom_op("lynx::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """Start copying ``x`` to host memory; returns the host tensor (complete after ``offload_wait``)."""
    if x.device.type != "cuda":
        return _cpu_host_copy(x)
    stream = _copy_stream(x.device)
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written on the compute stream
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    x.record_stream(stream)
    _EVENTS[id(host)] = event
    return host


@torch.library.custom_op("lynx::offload_wait", mutates_args=())
def offload_wait(host: torch.Tensor, x: torch.Tensor, after: Optional[torch.Tensor] = None) -> None:
    """The device→host copy of ``x`` into ``host`` is complete here (``x`` is read, so it stays
    alive until this point). ``after``: a tensor computed just before, read (not used) so that a
    compiler runs the wait after it, where lynx placed it, not as soon as the copy is issued."""
    event = _EVENTS.pop(id(host), None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


@torch.library.custom_op("lynx::reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device, after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Start copying ``host`` to ``device``; the result is usable after ``reload_wait``.
    ``after``: a tensor computed just before, read (not used) so that a compiler issues the copy
    where lynx placed it, not at the start of the backward (the copy would be alive longer)."""
    if torch.device(device).type != "cuda":
        return host.clone(memory_format=torch.contiguous_format)
    device = torch.device(device)
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    out.record_stream(torch.cuda.current_stream(device))
    _EVENTS[id(out)] = event
    return out


# Declared as writing ``x`` (the copy into it completes here; the values are not touched): a
# compiler then orders every later reader of ``x`` after the wait (Inductor's scheduler keeps a
# mutation's readers behind it), which a wait with no output would not get.
@torch.library.custom_op("lynx::reload_wait", mutates_args=("x",))
def reload_wait(x: torch.Tensor) -> None:
    """The current stream waits here for the host→device copy that produced ``x``."""
    event = _EVENTS.pop(id(x), None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


# Both copies are contiguous, whatever the source's strides (a transposed activation too): the
# fake results say so, as Inductor checks a custom op's output strides against them.
@offload.register_fake
def _(x):
    return x.new_empty(x.shape, device="cpu" if x.device.type == "cuda" else x.device)


@reload.register_fake
def _(host, device, after=None):
    return host.new_empty(host.shape, device=device)


offload_wait.register_fake(lambda host, x, after=None: None)
reload_wait.register_fake(lambda x: None)

OFFLOAD = torch.ops.lynx.offload.default
OFFLOAD_WAIT = torch.ops.lynx.offload_wait.default
RELOAD = torch.ops.lynx.reload.default
RELOAD_WAIT = torch.ops.lynx.reload_wait.default
register_host_output_op(OFFLOAD)  # its output lives in host memory: no device bytes (memory model)

for _target in (OFFLOAD_WAIT, RELOAD_WAIT):
    has_side_effect(_target)
