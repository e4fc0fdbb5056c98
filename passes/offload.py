"""Offload: move the saved tensors of ``Offload()`` units to host memory between fw and bw.

Runs on the partitioned graphs (the partitioner saved those tensors: an offloaded unit is not
tagged for recompute). Reads ``ctx.decisions`` (its ``offloaded()`` units and their member
nodes), ``meta.COST``, the host link of ``config.hardware``. Writes ``meta.OFFLOAD`` on the
inserted nodes, and ``record.stats["offload"]`` (units, bytes sent to host per step, copy
seconds one way, exposed seconds by the model below).

``offload_forward_pass``, for each saved output ``x`` of an offloaded unit::

    before:  x = op(...); ...; return (out, x)
    after:   x = op(...); x_offload = lynx.offload(x); ...ops covering the copy time...; y = op(...)
             lynx.offload_wait(x_offload, x, y); ...; return (out, x_offload)

``offload_backward_pass``, for each backward input ``x`` of an offloaded unit (renamed
``x_offload``, the forward's host copy)::

    before:  ...; y = use(x)
    after:   z = op(...); x_reload = lynx.reload(x_offload, device, z); ...ops covering the copy time...
             lynx.reload_wait(x_reload); y = use(x_reload)

The last argument of a wait / reload (``y``, ``z``: the op lynx places it behind) is read and not
used: it keeps a compiler that schedules by data (Inductor) from running the wait as soon as the
copy is issued, or the reload at the start of the backward. ``reload_wait`` is declared as
writing its tensor, so every reader of ``x_reload`` runs after it.

Copy model (the same rule prices the optimizer's ``Unit.offload_*``, ``remat_problem``): one
copy takes t = bytes / ``host_link_bytes_per_s`` (:func:`copy_seconds`). The device→host copy overlaps the forward ops
after the producer; its wait goes after the first run of them whose cost sum reaches t (before
the output if none does). The reload is issued early enough that the backward ops before the
first use cost at least t (at the start of the backward if they never do). Exposed time =
max(0, t − compute it overlaps), forward and backward.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from . import meta
from .context import PassContext


def copy_seconds(ctx: PassContext, nbytes: int) -> float:
    """Seconds one copy of ``nbytes`` between device and host takes: over the profile's host
    link; on the CPU profile, where the "host" is another buffer of the same memory, a read and
    a write at the rate their size reaches (``HardwareProfile.memory_seconds``), as the node
    costs the copy hides under are priced (a copy priced at the memory's rate beside nodes
    priced at the cache's would outlast the forward it overlaps)."""
    from lynx_compile.costs import get_profile

    profile = get_profile(ctx.config.hardware)
    if profile.name == "cpu":
        return profile.memory_seconds(2 * nbytes)
    return nbytes / profile.host_link_bytes_per_s


def cover_after(costs: Sequence[float], copy_s: float) -> tuple[int, float]:
    """(k, exposed): the fewest leading ``costs`` whose sum reaches ``copy_s`` (all of them
    when none does), and the copy time they leave uncovered."""
    total = 0.0
    for k, c in enumerate(costs):
        if total >= copy_s:
            return k, 0.0
        total += c
    return len(costs), max(0.0, copy_s - total)


def _cost(node: fx.Node) -> float:
    c = node.meta.get(meta.COST)
    return c.runtime_s if c is not None else 0.0


def _tensor_before(node: fx.Node, stop: fx.Node | None, excluded: frozenset = frozenset()) -> fx.Node | None:
    """``node``, or the nearest op before it, whose value is one tensor and that is no copy op
    (the ``after`` argument of a wait or a reload: read so that a compiler keeps the copy op
    behind it); None when the walk reaches ``stop`` or the placeholders first. Not a node of
    ``excluded`` (:func:`_not_anchors`: among them the values Inductor computes inside the kernels
    reading them, ``memory.inductor_model.interior_nodes``) nor a view: a copy op reading one
    makes Inductor write it out (gpt-tiny at 0.3 with offload: the MLP's ``0.5 * x`` beside its GELU, 128 KB
    above the plan's peak)."""
    import torch

    from lynx_compile.memory.inductor_model import _is_view

    while node is not None and node.op == "call_function" and node is not stop:
        val = node.meta.get("val")
        # a floating-point value: a functionalized RNG op's saved state (uint8, 5056 B on CPU)
        # reaches Inductor's lowering as a real tensor, and a copy op reading it failed there
        # ("convert all Tensors to FakeTensors"; HF Llama's SDPA)
        if isinstance(val, torch.Tensor) and val.is_floating_point() and meta.OFFLOAD not in node.meta \
                and node not in excluded and not _is_view(node):
            return node
        node = node.prev
    return node if node is stop and node is not None and isinstance(node.meta.get("val"), torch.Tensor) else None


def _not_anchors(gm: fx.GraphModule, ctx: PassContext) -> frozenset:
    """Nodes a copy op must not read to be ordered (:func:`_tensor_before`): values computed from
    no graph input (a compiler may fold them into a constant, which would reach the copy op as a
    real tensor, as a saved RNG state did) and, under Inductor, the values it computes inside
    other kernels."""
    nodes = list(gm.graph.nodes)
    fed: set[fx.Node] = set()
    for n in nodes:
        if n.op == "placeholder" or any(a in fed for a in n.all_input_nodes):
            fed.add(n)
    out = {n for n in nodes if n not in fed}
    if ctx.config.compiler == "inductor":
        from lynx_compile.memory.inductor_model import interior_nodes

        out |= interior_nodes(nodes)
    return frozenset(out)


def _offloaded_names(ctx: PassContext) -> set[str]:
    d = ctx.decisions
    return {m for u in d.offloaded() for m in d.nodes_of(u)} if d is not None else set()


def offload_name(name: str) -> str:
    return f"{name}_offload"


def offload_forward_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from lynx_compile.memory.storage import _nbytes
    from lynx_compile.runtime.offload_ops import OFFLOAD, OFFLOAD_WAIT

    names = _offloaded_names(ctx)
    if not names:
        return gm
    nodes = list(gm.graph.nodes)
    out = nodes[-1]
    outs = list(out.args[0])
    summary = {"units": len(list(ctx.decisions.offloaded())), "tensors": 0, "bytes": 0, "copy_s": 0.0,
               "exposed_fw_s": 0.0}
    pos = {n: i for i, n in enumerate(nodes)}
    excluded = _not_anchors(gm, ctx)
    for j in range(ctx.num_fwd_outputs, len(outs)):
        x = outs[j]
        if not isinstance(x, fx.Node) or x.name not in names or x.op == "placeholder":
            continue
        nbytes = _nbytes(x.meta.get("val"))
        copy_s = copy_seconds(ctx, nbytes)
        with gm.graph.inserting_after(x):
            host = gm.graph.create_node("call_function", OFFLOAD, (x,), name=offload_name(x.name))
        if host.name != offload_name(x.name):
            raise RuntimeError(f"lynx offload: the forward already has a node named {offload_name(x.name)!r}")
        host.meta.update({"val": x.meta.get("val"), meta.OFFLOAD: "offload"})
        after = [n for n in nodes[pos[x] + 1:-1]]
        k, exposed = cover_after([_cost(n) for n in after], copy_s)
        anchor = after[k - 1] if k else host
        with gm.graph.inserting_after(anchor):
            wait = gm.graph.call_function(OFFLOAD_WAIT, (host, x, _tensor_before(anchor, stop=host, excluded=excluded)))
        wait.meta[meta.OFFLOAD] = "offload_wait"
        outs[j] = host
        summary["tensors"] += 1
        summary["bytes"] += nbytes
        summary["copy_s"] += copy_s
        summary["exposed_fw_s"] += exposed
    out.args = (tuple(outs), *out.args[1:])
    ctx.record.stats["offload"] = {**ctx.record.stats.get("offload", {}), **summary}
    return gm


def offload_backward_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    from lynx_compile.memory.storage import _nbytes
    from lynx_compile.runtime.offload_ops import RELOAD, RELOAD_WAIT

    names = _offloaded_names(ctx)
    if not names:
        return gm
    exposed_total = 0.0
    excluded = _not_anchors(gm, ctx)
    for ph in list(gm.graph.find_nodes(op="placeholder")):
        if ph.name not in names or not ph.users:
            continue
        with gm.graph.inserting_before(ph):
            host = gm.graph.placeholder(offload_name(ph.name))
        host.meta.update(ph.meta)
        host.meta[meta.OFFLOAD] = "host"
        ph.replace_all_uses_with(host)
        gm.graph.erase_node(ph)
        nodes = list(gm.graph.nodes)
        first = min(host.users, key=nodes.index)
        i = nodes.index(first)
        start = next(j for j, n in enumerate(nodes) if n.op != "placeholder")
        before = nodes[start:i][::-1]                       # ops before the first use, nearest first
        k, exposed = cover_after([_cost(n) for n in before], copy_seconds(ctx, _nbytes(ph.meta.get("val"))))
        exposed_total += exposed
        anchor = before[k - 1] if k else first
        val = ph.meta.get("val")
        users = list(host.users)
        prev = _tensor_before(anchor.prev, stop=None, excluded=excluded) if anchor.prev.op != "placeholder" else None
        with gm.graph.inserting_before(anchor):
            reloaded = gm.graph.create_node("call_function", RELOAD, (host, val.device, prev), name=f"{ph.name}_reload")
        with gm.graph.inserting_before(first):
            wait = gm.graph.call_function(RELOAD_WAIT, (reloaded,))
        reloaded.meta.update({"val": val, meta.OFFLOAD: "reload"})
        wait.meta[meta.OFFLOAD] = "reload_wait"
        for u in users:
            u.replace_input_with(host, reloaded)
    rec = ctx.record.stats.setdefault("offload", {})
    rec["exposed_bw_s"] = exposed_total
    return gm
