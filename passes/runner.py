"""The one pass runner: lint, time, record, recompile, and dump graphs when asked.

A pass is a plain function ``(gm, ctx) -> gm``. ``run_passes`` runs a tuple of them in order,
skips the ones named in ``config.disable_passes``, and writes each graph before/after to
``$LYNX_DUMP_DIR/graph_<graph_id>/<stage>_<nn>_<pass>_{before,after}.txt`` when dumping is on
(``post_grad<k>_...`` for the k-th graph Inductor compiles of the record, ``POST_GRAD_PIPELINE``).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Sequence

import torch.fx as fx

from .context import PassContext, PassTiming

log = logging.getLogger("lynx_compile")

Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


def pass_name(p: Pass) -> str:
    return getattr(p, "__name__", repr(p))


def dump_graph(gm: fx.GraphModule, ctx: PassContext, label: str) -> None:
    """Write the readable graph to the dump directory (no-op when dumping is off)."""
    if not ctx.config.dump_dir:
        return
    folder = os.path.join(ctx.config.dump_dir, f"graph_{ctx.record.graph_id}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{label}.txt"), "w") as f:
        f.write(gm.print_readable(print_output=False))


def run_passes(gm: fx.GraphModule, ctx: PassContext, pipeline: Sequence[Pass],
               stage: str, *, recompile: bool = True, dump_prefix: str | None = None) -> fx.GraphModule:
    """Run ``pipeline`` on ``gm``; returns the final graph module.

    Each pass's graph is linted after it; the Python code is generated once, after the last
    pass (passes read and rewrite the graph, never the code; regenerating it after every pass
    was ~25% of the plan time of a torchtitan debug model, most of it for candidate plans that
    are only simulated). ``recompile=False`` leaves the code to the graph's owner: for
    Inductor's post-grad graphs (``POST_GRAD_PIPELINE``), which Inductor lowers node by node and
    regenerates the code of itself once its post-grad passes are done (torch 2.13's
    ``post_grad_passes`` ends with ``gm.recompile()``); a second time here would cost ~40 ms on
    gpt-tiny's backward, twice the three passes' time. ``dump_prefix``: the dump files' prefix
    (``stage`` by default), for a stage that runs on several graphs of one record."""
    dump_prefix = stage if dump_prefix is None else dump_prefix
    for i, p in enumerate(pipeline):
        name = pass_name(p)
        if name in ctx.config.disable_passes:
            ctx.record.timings.append(PassTiming(name=name, stage=stage, seconds=0.0, skipped=True))
            log.info("lynx: pass %s disabled by config", name)
            continue
        dump_graph(gm, ctx, f"{dump_prefix}_{i:02d}_{name}_before")
        start = time.perf_counter()
        gm = p(gm, ctx)
        gm.graph.lint()
        ctx.record.timings.append(
            PassTiming(name=name, stage=stage, seconds=time.perf_counter() - start))
        dump_graph(gm, ctx, f"{dump_prefix}_{i:02d}_{name}_after")
    if recompile:
        gm.recompile()
    return gm
