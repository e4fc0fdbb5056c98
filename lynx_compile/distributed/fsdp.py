"""FSDP2's collectives as a recompute window (issue N item 3).

Under FSDP2 (``fully_shard`` per transformer block, torchtitan's way), a block's backward runs
while two collectives are in flight on the communication stream: the all-gather of the next
block to run backward (FSDP2's backward prefetch, issued in this block's pre-backward hook) and
the reduce-scatter of the gradients of the block that ran backward before it (issued in its
post-backward hook). Both are outside the compiled graph, so lynx finds no collective node
there; it finds the parameters instead: the unsharded parameters FSDP2 hands the graph
(``_compat.fsdp2_groups_holding``) give the shard world size and the bytes of both collectives
(identical blocks: the neighbours gather and reduce as many bytes as this block holds).

When the two collectives take longer than the block's own backward compute, the device waits
at the next block's all-gather; that difference is free time. lynx models it as one window at
the start of the graph's backward (``WINDOW``): recompute placed there runs while the
prefetch is in flight (``passes/insert_recompute.py`` moves it right after the backward's
inputs) and costs nothing up to the window's length, anything beyond it is exposed. The
recompute lives from the start of the backward (the optimizer's memory model counts that).
A block whose backward outlasts its communication has no window: recompute there is exposed,
as on demand.

Left out: the forward's all-gather prefetch (no recompute runs in the forward), HSDP's
all-reduce, mixed-precision dtypes of the reduce-scatter (the parameters' dtype is used), the
first and last blocks (no neighbour on one side: the same window is assumed).
"""
from __future__ import annotations

from dataclasses import dataclass

from lynx_compile import _compat
from lynx_compile.costs.comm import LinkProfile, collective_time

WINDOW = "fsdp.prefetch"
"""The window's name in a plan (``Window(collective="fsdp.prefetch")``) and in the Chrome
trace's recompute ranges (``lynx::recompute[window:fsdp.prefetch]``)."""


@dataclass(frozen=True)
class FsdpComm:
    """FSDP2's communication overlapping one block's backward."""

    shard_world: int
    all_gather_bytes: int
    """The next block's parameters, gathered (0 when FSDP2 keeps them unsharded after the forward)."""
    reduce_scatter_bytes: int
    """The previous block's gradients, reduced (the reduce-scatter's input)."""

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.shard_world, self.all_gather_bytes, self.reduce_scatter_bytes)

    def seconds(self, link: LinkProfile) -> float:
        """Both collectives back to back on ``link`` (one communication stream)."""
        return (collective_time("all_gather", self.all_gather_bytes, self.shard_world, link)
                + collective_time("reduce_scatter", self.reduce_scatter_bytes, self.shard_world, link))


def comm_of(example_inputs: list) -> FsdpComm | None:
    """FSDP2's communication around the graph whose inputs are ``example_inputs`` (the real
    tensors dynamo passes), or None when no input is an FSDP2 parameter sharded over more than
    one rank."""
    groups = _compat.fsdp2_groups_holding(example_inputs)
    world = max((g[0] for g in groups), default=1)
    if world <= 1:
        return None
    return FsdpComm(shard_world=world, all_gather_bytes=sum(b for _, resharded, b in groups if resharded),
                    reduce_scatter_bytes=sum(b for _, _, b in groups))


def free_seconds(comm: tuple[int, int, int] | None, link: LinkProfile, backward_s: float) -> float:
    """The window's length: how much longer the collectives take than the backward's own
    compute (``backward_s``, no recompute); 0 when the compute is longer or there is no FSDP."""
    if comm is None:
        return 0.0
    return max(0.0, FsdpComm(*comm).seconds(link) - backward_s)
