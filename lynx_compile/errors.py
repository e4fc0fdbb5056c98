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
