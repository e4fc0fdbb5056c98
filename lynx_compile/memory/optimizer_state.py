"""The optimizer state a step holds on the device, created after lynx compiled (issue S item 2).

``device_budget`` bounds everything on the device during the step: what is resident as it
starts (parameters, buffers, the batch, ``.grad`` if kept, the optimizer's state) plus the step's
own peak. lynx reads the resident bytes when it compiles a graph, during the first step's
forward; AdamW creates its state (two tensors per parameter) at the first ``optimizer.step()``,
after that. On CUDA ``torch.cuda.memory_allocated`` sees it from then on; on other devices (no
allocator counter) lynx counts the storages a graph's inputs hold, which do not include it.

This module finds that state: a global ``torch.optim`` step post hook (public since torch 2.0,
installed by :func:`watch`) remembers, weakly, every optimizer that stepped; :func:`state_bytes`
sums the distinct storages of the state tensors those optimizers hold for given parameters.
An optimizer that stepped before :func:`watch` was called is not seen until it steps again.
No torch.fx here.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch

COUNTED_LATER = "; optimizer state created later is counted when the step is recorded (step.recorder)"
"""The end of a resident reading's description where no optimizer state was there yet (cut off
where the state is counted later)."""

_SEEN: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_LOCK = threading.Lock()
_HANDLE = None


def watch() -> None:
    """Remember every optimizer that steps from now on (idempotent; one global post hook whose
    cost per ``optimizer.step()`` is one set insertion)."""
    global _HANDLE
    with _LOCK:
        if _HANDLE is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _HANDLE = register_optimizer_step_post_hook(_stepped)


def _stepped(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _SEEN.add(optimizer)


def state_bytes(params: Iterable[torch.Tensor]) -> tuple[int, str]:
    """(bytes, what they are): the distinct storages of the tensors held in the state of the
    optimizers seen stepping (:func:`watch`) for any of ``params`` (per-parameter state such as
    AdamW's ``exp_avg`` / ``exp_avg_sq`` and its ``step`` tensors), on the parameters' devices.
    ``(0, "")`` when none."""
    params = [p for p in params if isinstance(p, torch.Tensor)]
    ids = {id(p) for p in params}
    devices = {p.device for p in params}
    storages: dict[tuple, int] = {}
    kinds: dict[str, int] = {}
    for opt in list(_SEEN):
        held = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in ids:
                    continue
                for value in opt.state.get(p, {}).values():
                    if not isinstance(value, torch.Tensor) or value.device not in devices:
                        continue
                    storage = value.untyped_storage()
                    key = (str(value.device), storage.data_ptr() or id(value))
                    if key not in storages:
                        storages[key] = storage.nbytes()
                        held += storage.nbytes()
        if held:
            name = type(opt).__name__
            kinds[name] = kinds.get(name, 0) + held
    total = sum(storages.values())
    what = ", ".join(f"{name}'s state {n} B" for name, n in sorted(kinds.items()))
    return total, what


__all__ = ["COUNTED_LATER", "watch", "state_bytes"]
