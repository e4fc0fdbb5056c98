"""The graph markers of side-stream recompute: ``torch.ops.lynx.side_stream_{begin,end,wait}``.

``side_stream_pass`` (``passes/side_stream.py``) brackets each recompute segment of a backward
graph with them, so the dump of the graph shows what runs where::

    lynx.side_stream_begin(k, [inputs...])      # side stream waits for the main stream
    ... recomputed ops of segment k ...         # run on the side stream
    lynx.side_stream_end(k, [outputs...])       # side stream records event k
    ... main-stream gradient ops ...            # overlap with segment k
    lynx.side_stream_wait(k)                    # main stream waits for event k
    first main-stream use of segment k's outputs

The ops themselves do nothing: they take no part in the values computed (no outputs, no
mutation). ``SideStreamRunner`` (``runtime/side_stream_runner.py``) reads them to cut the graph into
pieces and launches the pieces on CUDA streams. Anywhere else (CPU, or a graph run as it is) they
are no-ops, and the graph runs inline in its order. They are registered as side-effectful so
dead-code elimination keeps them.
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect


@torch.library.custom_op("lynx::side_stream_begin", mutates_args=())
def side_stream_begin(segment: int, inputs: list[torch.Tensor]) -> None:
    """Segment ``segment`` starts here; it reads ``inputs`` (produced on the main stream)."""


@torch.library.custom_op("lynx::side_stream_end", mutates_args=())
def side_stream_end(segment: int, outputs: list[torch.Tensor]) -> None:
    """Segment ``segment`` ends here; the main stream later reads ``outputs``."""


@torch.library.custom_op("lynx::side_stream_wait", mutates_args=())
def side_stream_wait(segment: int) -> None:
    """The main stream waits for segment ``segment`` here, before its first use of an output."""


for _op in (side_stream_begin, side_stream_end, side_stream_wait):
    _op.register_fake(lambda *args: None)

BEGIN = torch.ops.lynx.side_stream_begin.default
END = torch.ops.lynx.side_stream_end.default
WAIT = torch.ops.lynx.side_stream_wait.default
MARKERS = frozenset({BEGIN, END, WAIT})

for _target in MARKERS:
    has_side_effect(_target)
