"""Where a training step starts: the outermost ``nn.Module`` call running (read off Python's
stack), and hooks on that one module around its calls (lynx's step recorder)."""
from __future__ import annotations

import sys
from typing import Callable

import torch


def outermost_module_call() -> torch.nn.Module | None:
    """The module of the outermost ``nn.Module.__call__`` on the calling thread's stack (the
    model a training loop called: a plain module holding compiled blocks, or the
    ``OptimizedModule`` of ``torch.compile(model)``); None outside any module call."""
    codes = {torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__}
    found, frame = None, sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                found = module
        frame = frame.f_back
    return found


def call_is_compiled(module: torch.nn.Module) -> bool:
    """``module.compile()`` compiled its call, hooks included: a hook added to it would be traced
    (and change dynamo's guards, compiling it again)."""
    return getattr(module, "_compiled_call_impl", None) is not None


class ModuleCallHooks:
    """``enter(args)`` before every forward pre-hook of ``module`` (FSDP2's all-gather of its
    parameters comes after it), ``leave()`` after its forward hooks (on an exception too), until
    :meth:`remove`."""

    def __init__(self, module: torch.nn.Module, enter: Callable[[tuple], None], leave: Callable[[], None]):
        self._handles = [module.register_forward_pre_hook(lambda m, args: enter(args), prepend=True),
                         module.register_forward_hook(lambda m, args, out: leave(), always_call=True)]

    def remove(self) -> None:
        """(Again: nothing.)"""
        for handle in self._handles:
            handle.remove()
        self._handles = []
