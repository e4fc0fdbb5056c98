"""Process-wide hooks on every ``nn.Module`` call, for as long as they wait: where a training step
starts (the outermost module call running when its first compiled piece is called), as lynx's
step recorder finds it."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

_OPTIMIZED_MODULE_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
"""The start of the warning dynamo's ``OptimizedModule.__call__`` gives when any global module
hook is registered (such a hook fires for the ``OptimizedModule`` and again for the module inside
it; the recorder counts calls, so both are counted and both return)."""


class ModuleCallHooks:
    """``enter(module, args)`` before the forward pre-hooks of every module called (a global hook runs
    before the module's own: FSDP2's all-gather of the root's parameters comes after it) and
    ``leave(module)`` after its forward hooks (on an exception too), until :meth:`remove`. While
    they are registered, dynamo's warning about global hooks is not shown (its filter goes with
    them)."""

    def __init__(self, enter: Callable[[torch.nn.Module, tuple], None], leave: Callable[[torch.nn.Module], None]):
        from torch.nn.modules import module as nn_module

        warnings.filterwarnings("ignore", message=_OPTIMIZED_MODULE_WARNING, category=UserWarning)
        self._filter = warnings.filters[0]
        self._handles = [nn_module.register_module_forward_pre_hook(lambda m, args: enter(m, args)),
                         nn_module.register_module_forward_hook(lambda m, args, out: leave(m), always_call=True)]

    def remove(self) -> None:
        """(Again: nothing.)"""
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        try:
            warnings.filters.remove(self._filter)
        except ValueError:  # a catch_warnings block of the caller's restored the list since
            pass
