"""The exceptions lynx raises to its callers (plain classes; no other lynx module imported
but ``_compat``, so any module may raise them without an import cycle). ``BudgetError`` (a budget
no plan reaches) lives with the decision record, ``lynx_compile.decisions``."""
from __future__ import annotations

from lynx_compile import _compat


class PlanningDone(Exception):
    """Raised by a ``plan_only`` backend once the graph is partitioned and planned."""


class LynxOptionError(ValueError, _compat.dynamo_passthrough_error()):
    """A bad lynx option. A ``ValueError``; raised from the backend, dynamo passes it on as is
    (not wrapped in ``BackendCompilerFailed``), so lynx's message is the one the user reads."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.first_useful_frame = None  # dynamo strips its own frames from the traceback


def without_tracebacks(error: BaseException) -> BaseException:
    """``error`` with its traceback and those of the exceptions it was raised from or during
    cleared, to be kept past the ``except`` block (a refusal deferred to the step's end, a
    failure handed to the next candidate). A kept traceback keeps every frame it went through
    alive, and each frame its caller's: up to dynamo's ``compile_wrapper``, whose result is the
    model's output of the call that compiled the graph. Kept in a local of a frame on its own
    traceback, it is a cycle only the garbage collector frees: HF Llama's logits and KV-cache
    tensors of step 1 (+136 KB on a 2-layer model) stayed alive through step 1's backward."""
    stack, seen = [error], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return error
