"""Communication cost: α–β (latency–bandwidth) ring model for collectives and P2P.

A link is ``(alpha_s, bandwidth_bytes_per_s)``: α is the per-step latency of one ring hop, the
bandwidth is the *per-direction* bandwidth one rank can push into the ring (NCCL's "bus
bandwidth"). With n ranks and a payload of B bytes (ring algorithms, Thakur et al. 2005;
NCCL's own tuner uses the same step counts, see ``nsteps`` in NCCL ``src/graph/tuning.cc``):

    all_reduce        2(n-1)·α + 2(n-1)/n · B/bw    B = tensor size (in = out)
    all_gather         (n-1)·α +  (n-1)/n · B/bw    B = full *output* size
    reduce_scatter     (n-1)·α +  (n-1)/n · B/bw    B = full *input* size
    all_to_all         (n-1)·α +  (n-1)/n · B/bw    B = per-rank input size
    broadcast          (n-1)·α +            B/bw    (pipelined chain)
    send / recv               α +            B/bw

A single rank (n = 1) communicates nothing: collectives cost 0 (send/recv still pay α + B/bw).

The ``LINKS`` numbers are *nominal* per-direction figures from datasheets, so the model
under-estimates communication time. That is deliberate: Lynx hides recompute inside
communication windows, and a window that is never over-estimated never gets over-filled.
For real numbers, measure with :func:`calibrate_link` on the actual process group.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from lynx_compile.costs.types import NodeCost
from lynx_compile.graph.collectives import canonical_collective, is_wait_node
from lynx_compile.graph.values import input_tensors, iter_tensors, tensor_nbytes


@dataclass(frozen=True)
class LinkProfile:
    """An interconnect in the α–β model."""

    name: str
    """Short name, the key in ``LINKS`` (``"calibrated-..."`` for measured links)."""
    alpha_s: float
    """Latency of one ring step in seconds."""
    bandwidth_bytes_per_s: float
    """Per-direction bandwidth one rank sustains into the ring, bytes/s."""


# α values: NCCL's per-hop ring latency for the Simple protocol (hwLat[.][RING][SIMPLE] in
# NCCL src/graph/tuning.cc: NVLink 3.4 µs, PCI 5.7 µs, NET 9.6 µs). Bandwidths: nominal,
# per direction (datasheets quote bidirectional totals; we halve them).
LINKS: dict[str, LinkProfile] = {
    # NVIDIA A100 datasheet: 3rd-gen NVLink, 600 GB/s total (12 links × 50 GB/s bidirectional)
    # -> 300 GB/s per direction. NCCL's tuner caps sm80 bus bandwidth at 235 GB/s (achievable).
    "nvlink3": LinkProfile("nvlink3", 3.4e-6, 300e9),
    # NVIDIA H100 / H200 datasheets: 4th-gen NVLink, 900 GB/s total (18 links) -> 450 GB/s/dir.
    "nvlink4": LinkProfile("nvlink4", 3.4e-6, 450e9),
    # PCIe 4.0 x16: 16 GT/s × 16 lanes × 128/130 ≈ 31.5 GB/s per direction (A100 PCIe datasheet
    # quotes 64 GB/s bidirectional).
    "pcie4": LinkProfile("pcie4", 5.7e-6, 31.5e9),
    # PCIe 5.0 x16: 32 GT/s -> ≈ 63 GB/s per direction (H100 PCIe datasheet: 128 GB/s bidir).
    "pcie5": LinkProfile("pcie5", 5.7e-6, 63e9),
    # InfiniBand HDR: 200 Gb/s per port = 25 GB/s per direction (one NIC per GPU assumed).
    "infiniband-hdr": LinkProfile("infiniband-hdr", 9.6e-6, 25e9),
    # InfiniBand NDR: 400 Gb/s per port = 50 GB/s per direction (ConnectX-7, one NIC per GPU).
    "infiniband-ndr": LinkProfile("infiniband-ndr", 9.6e-6, 50e9),
    # Huawei HCCS on Ascend 910B servers (Atlas 800T A2): public figures quote 392 GB/s per NPU
    # (7 full-mesh links × 56 GB/s). UNCERTAIN whether that is bidirectional; we assume so
    # (NVIDIA's convention) -> 196 GB/s per direction. α is NOT published; 5 µs is a guess of
    # the same order as NCCL over NVLink/PCIe. Calibrate before trusting either.
    "hccs": LinkProfile("hccs", 5e-6, 196e9),
    # gloo over loopback TCP on one host: placeholder only (order of magnitude seen on small
    # CPU boxes); replace with calibrate_link() output.
    "loopback-gloo": LinkProfile("loopback-gloo", 50e-6, 1e9),
}


def collective_time(op: str, nbytes: int, world_size: int, link: LinkProfile) -> float:
    """Seconds for one collective of ``nbytes`` over ``world_size`` ranks on ``link`` (module doc)."""
    kind = canonical_collective(op)
    n, a, bw = int(world_size), link.alpha_s, link.bandwidth_bytes_per_s
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if kind in ("send", "recv"):
        return a + nbytes / bw
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * nbytes / bw
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * a + (n - 1) / n * nbytes / bw
    assert kind == "broadcast"
    return (n - 1) * a + nbytes / bw


def comm_node_cost(node: torch.fx.Node, link: LinkProfile, world_size: int | None = None) -> NodeCost:
    """Cost of a functional-collective node: runtime = ``collective_time`` on ``link``.

    World size, first found wins: the op's ``group_size`` argument, the process group named by
    its ``group_name`` argument (when torch.distributed is initialized), ``world_size``, the
    default group's size. ``out_bytes`` = the new output buffer; ``bytes_moved`` = the payload.
    """
    if is_wait_node(node):
        return NodeCost.zero()
    kind = canonical_collective(node.target)
    in_bytes = sum(map(tensor_nbytes, input_tensors(node)))
    out_b = sum(map(tensor_nbytes, iter_tensors(node.meta.get("val"))))
    payload = out_b if kind == "all_gather" else in_bytes
    n = _world_size_of(node, world_size)
    schema_returns = getattr(node.target, "_schema", None)
    aliased = schema_returns is not None and any(r.alias_info is not None for r in schema_returns.returns)
    return NodeCost(
        runtime_s=collective_time(kind, payload, n, link),
        out_bytes=0 if aliased else out_b,
        flops=0.0,
        bytes_moved=payload,
        source="analytic",
    )


def _world_size_of(node: torch.fx.Node, world_size: int | None) -> int:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        if isinstance(bound.get("group_size"), int):
            return bound["group_size"]
        group = _resolve_group(bound.get("group_name"))
        if group is not None:
            return group.size()
    if world_size is not None:
        return int(world_size)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raise ValueError(f"cannot tell the world size of {node.format_node()}; pass world_size=")


def _resolve_group(group_name: Any):
    import torch.distributed as dist

    if group_name is None or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name)
    except Exception:  # unknown name in this process: fall back to the caller's world_size
        return None


def calibrate_link(
    group: Any = None,
    sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 20, 1 << 22),
    repeats: int = 5,
) -> LinkProfile:
    """Measure all_reduce on ``group`` (default: WORLD) and least-squares fit α and bandwidth.

    Collective call: every rank of the group must call it with the same arguments; every rank
    returns the same profile (per-size median times are max-reduced across ranks, then fit).
    ``sizes`` are payloads in bytes (float32 tensors). Fit: t(B) = 2(n-1)α + 2(n-1)/n · B/bw;
    α and bw are clamped to be positive when noise makes the fit degenerate.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("calibrate_link needs an initialized torch.distributed process group")
    n = dist.get_world_size(group)
    if n < 2:
        raise ValueError("calibrate_link needs a group of at least 2 ranks")
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    times = []
    for nbytes in sizes:
        buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf, group=group)  # warm-up: connection setup, allocator
        dist.barrier(group=group)
        per_call = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            per_call.append(time.perf_counter() - t0)
        times.append(statistics.median(per_call))  # robust to a preempted call or two
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    alpha, bw = _fit_alpha_beta([4 * max(1, s // 4) for s in sizes], t.cpu().tolist(), n)
    return LinkProfile(f"calibrated-{backend}-{n}", alpha, bw)


def _fit_alpha_beta(sizes: list[int], times: list[float], n: int) -> tuple[float, float]:
    """Least squares t = c + s·B, then α = c / 2(n-1), bw = 2(n-1)/(n·s); both clamped > 0."""
    k = len(sizes)
    mb, mt = sum(sizes) / k, sum(times) / k
    var = sum((b - mb) ** 2 for b in sizes)
    slope = sum((b - mb) * (t - mt) for b, t in zip(sizes, times)) / var if var > 0 else 0.0
    intercept = mt - slope * mb
    steps = 2 * (n - 1)
    alpha = max(intercept / steps, 1e-9)
    if slope <= 0:  # time did not grow with size (noise): bound bw by the largest transfer
        b_max, t_max = max(zip(sizes, times))
        slope = max(t_max - steps * alpha, 1e-12) / b_max
    bw = steps / n / slope
    return alpha, bw


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
