"""The parameter gradients a recorded step would allocate if ``.grad`` were None when it started.

A training step allocates its parameter gradients when ``.grad`` is None as it starts (torch's
``zero_grad(set_to_none=True)``, the first micro-batch of a gradient accumulation) and only
temporaries when ``.grad`` is already there (``zero_grad(set_to_none=False)``, the later
micro-batches): autograd's ``AccumulateGrad`` keeps the backward's gradient as ``.grad`` in the
first case and adds it into ``.grad`` and frees it in the second. Same plan, two peaks: from the
moment a parameter's gradient is accumulated, the first regime holds its bytes more.

lynx records one step to plan the compiled pieces together (``lynx_compile.step.recorder``). When
that step ran with ``.grad`` allocated, :class:`GradWatch` counts, at each mark, the bytes of the
parameter gradients accumulated so far, so that the plan holds in both regimes. It finds the
parameters from the backward's roots (a watch on Python's profile hook for the call of
``torch.autograd.graph._engine_run_backward``, whose first argument they are), walking the
autograd graph to its ``AccumulateGrad`` nodes, and counts each accumulation with a
post-accumulate-grad hook. Parameters whose ``.grad`` is None when the backward starts are
counted by the recording itself and not here. FSDP2's unsharded parameters have no ``.grad``
kept across steps (FSDP2 frees it after the reduce-scatter), so they are never counted twice.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

import torch

from lynx_compile import _compat

log = logging.getLogger("lynx_compile")


def leaf_tensors(roots: Any) -> list[torch.Tensor]:
    """The leaves requiring grad that a backward from ``roots`` (tensors or gradient edges)
    accumulates into, in the order first reached (depth first from the roots)."""
    stack = []
    for r in roots if isinstance(roots, (list, tuple)) else (roots,):
        node = getattr(r, "grad_fn", None) if isinstance(r, torch.Tensor) else getattr(r, "node", None)
        if node is not None:
            stack.append(node)
    seen: dict[int, Any] = {}  # holds the nodes: their Python wrappers may be made per access,
    leaves: dict[int, torch.Tensor] = {}  # and a freed one's id could be another's (torch 2.11)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.setdefault(id(variable), variable)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return list(leaves.values())


class GradWatch:
    """Counts the bytes of the parameter gradients accumulated into an existing ``.grad`` during
    one backward (see the module docstring). ``start()`` before the step's backward is called,
    ``accumulated`` at any moment, ``stop()`` at the end."""

    def __init__(self):
        self.accumulated = 0
        """Bytes of the ``.grad`` that were allocated when the backward started and have been
        accumulated into since."""
        self.held_bytes = 0
        """Bytes of every ``.grad`` allocated when the backward started (0: the step allocates
        its gradients itself, nothing to add)."""
        self.watching = False
        self._handles: list[Any] = []

    def start(self) -> bool:
        """Watch for the next backward call; False when the profile hook is taken (another tool:
        the step is then planned for the regime it ran in, which the caller says)."""
        self.watching = _compat.watch_frame(_compat.engine_run_backward_code(), "call",
                                            lambda frame: self._on_backward(_compat.backward_roots(frame)))
        return self.watching

    def _on_backward(self, roots: Any) -> None:
        self.watching = False
        for leaf in leaf_tensors(roots):
            if leaf.grad is None or not hasattr(leaf, "register_post_accumulate_grad_hook"):
                continue
            nbytes = leaf.grad.untyped_storage().nbytes()
            self.held_bytes += nbytes
            self._handles.append(leaf.register_post_accumulate_grad_hook(self._counter(nbytes)))

    def _counter(self, nbytes: int):
        def count(_param: torch.Tensor) -> None:
            self.accumulated += nbytes
        return count

    def stop(self) -> None:
        if self.watching:
            sys.setprofile(None)
            self.watching = False
        for h in self._handles:
            h.remove()
        self._handles = []
