"""Data-dependent sizes as the step ran them (issue S item 5).

A graph with data-dependent shapes (an MoE block: the tokens routed to each expert, exchanged
by all-to-all, become unbacked SymInts ``u0``, ``u1``, ... through ``.tolist()``) is planned at
its first compile before any step ran, with every unbacked symbol sized at
``graph.values.UNBACKED_SIZE_HINT`` rows. AOTAutograd keeps the sizes the backward needs on the
backward node (``ctx.symints``: plain ints at run time), in the order of the forward graph's
trailing SymInt outputs; ``GraphRecord.saved_symbols`` names the unbacked symbol each one is.

So at step 1 the recorder reads, per piece call, the value of each such symbol
(:func:`seen_at`), keeps the largest over the step's calls of each graph, and at the start of
step 2 (before it is recorded) the ranks take the largest over ranks (:func:`agreed`: every rank
plans alike) and each graph whose sizes these are is planned again within them
(``graph.values.sizes_seen``, :func:`plan_again`): its candidates' bytes and
times, and which units fit in its all-to-all windows, are those of the routed counts seen.
Routing moves from step to step; the plan holds for counts up to those of step 1 (a later step
routing more tokens to this rank's experts allocates more than planned).
"""
from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.fx as fx

from lynx_compile import _compat
from lynx_compile.graph.values import UNBACKED_SIZE_HINT

log = logging.getLogger("lynx_compile")


def saved_symbols(fw: fx.GraphModule) -> tuple[str | None, ...]:
    """Per trailing int / SymInt output of AOTAutograd's forward graph ``fw`` (the sizes saved
    for the backward come last, before any opaque object), the unbacked symbol it is, else
    None; () where no output is an unbacked symbol."""
    outputs = fw.graph.output_node().args[0]
    names: list[str | None] = []
    for out in reversed(list(outputs)):
        val = out.meta.get("val") if isinstance(out, fx.Node) else out
        if isinstance(val, torch.Tensor) or val is None:
            if names:
                break
            continue
        if isinstance(val, (int, torch.SymInt)):
            names.append(_compat.unbacked_symbol_name(val))
        elif names:
            break
    names.reverse()
    return tuple(names) if any(names) else ()


def seen_at(symbols: tuple[str | None, ...], node: Any) -> dict[str, int]:
    """The value of each unbacked symbol of ``symbols`` (``GraphRecord.saved_symbols``) in the
    call whose backward node is ``node``: its saved sizes (``_compat.saved_symints``), aligned
    from the end; {} when they cannot be read."""
    values = _compat.saved_symints(node) if symbols else None
    if not values or len(values) > len(symbols):
        return {}
    return {name: int(v) for name, v in zip(symbols[len(symbols) - len(values):], values)
            if name is not None and isinstance(v, int)}


def text(values: dict[str, int] | None) -> str:
    """``u0=795, u1=792``: sizes as lynx's notes and log say them."""
    return ", ".join(f"{k}={v}" for k, v in sorted((values or {}).items()))


def merged(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """``into`` with each symbol of ``more`` at the larger of the two values."""
    return {**into, **{k: max(v, into.get(k, v)) for k, v in more.items()}}


def agreed(per_graph: dict[int, dict[str, int]], graphs: Iterable[int], group: Any) -> dict[int, dict[str, int]]:
    """Per graph of ``graphs`` (in the step's order, the same on every rank), the largest value of
    each symbol over the ranks of the planning ``group`` (one all-gather), so every rank plans
    the same sizes; graphs with none seen are left out."""
    from lynx_compile.distributed.agreement import gather_values, planning_group

    order = list(graphs)
    mine = [sorted(per_graph.get(g, {}).items()) for g in order]
    with planning_group(group), _compat.eager_dispatch():
        everyone = gather_values(mine)
    out: dict[int, dict[str, int]] = {}
    for k, g in enumerate(order):
        sizes: dict[str, int] = {}
        for rank in everyone:
            sizes = merged(sizes, dict(rank[k]))
        if sizes:
            out[g] = sizes
    return out


def plan_again(pieces: list[Any], seen: dict[int, dict[str, int]], group: Any) -> None:
    """At the start of step 2: each of ``pieces`` whose graph has data-dependent sizes (an MoE
    block's routed token counts) planned again (``Piece.replan``) with the values step 1 ran
    (``seen``, per ``Piece.key``), the largest over its calls and the ranks (:func:`agreed`), in
    place of ``UNBACKED_SIZE_HINT``; step 2 runs and is recorded with those plans."""
    sized = [p for p in pieces if p.record.saved_symbols]
    if not sized:
        return
    together = agreed(seen, dict.fromkeys(p.key for p in sized), group)
    for piece in sized:
        values = together.get(piece.key)
        if not values or values == piece.record.unbacked_sizes:
            continue
        piece.replan(values)
        note = (f"data-dependent sizes: planned again with those step 1 ran ({text(values)}; the largest over "
                f"calls and ranks) in place of the hint of {UNBACKED_SIZE_HINT} per unbacked symbol")
        piece.record.notes.append(note)
        log.info("lynx: graph %d: %s", piece.record.graph_id, note)


def ran_above_plan(piece: Any, node: Any) -> bool:
    """After the plans: whether a call of ``piece`` (its backward node ``node``; None: not
    read) ran data-dependent sizes above those its plan was made with (routing moved more tokens
    to this rank's experts); said in a warning when it did: its memory is then above what the
    plan holds."""
    seen = seen_at(piece.record.saved_symbols, node) if node is not None else {}
    planned = piece.record.unbacked_sizes or {}
    over = {k: v for k, v in seen.items() if v > planned.get(k, v)}
    if not over:
        return False
    log.warning("lynx: graph %d ran data-dependent sizes above those its plan was made with (%s; planned "
                "with %s, the largest step 1 ran): while they last its memory is above the plan's. Said "
                "once per graph; the plan is not made again", piece.record.graph_id,
                text(over), text({k: planned[k] for k in over}))
    return True
