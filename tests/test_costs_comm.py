"""Tests for lynx_compile.costs.comm: α–β formulas (CPU unit) and calibrate_link (2-rank gloo)."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import queue

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from lynx_compile.costs import (
    LINKS,
    PROFILES,
    LinkProfile,
    NodeCost,
    analytic_node_cost,
    node_costs,
    collective_time,
    comm_node_cost,
)
from lynx_compile.costs.comm import _fit_alpha_beta
from lynx_compile.graph.collectives import canonical_collective

import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional ops)

funcol_ops = torch.ops._c10d_functional
LINK = LinkProfile("test", alpha_s=1e-5, bandwidth_bytes_per_s=1e10)

# ---- formulas ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,n,expected",
    [
        # 2(n-1)α + 2(n-1)/n · B/bw = 6e-5 + 1.5 · 1e-2
        ("all_reduce", 4, 6e-5 + 1.5e-2),
        # (n-1)α + (n-1)/n · B/bw = 3e-5 + 0.75 · 1e-2
        ("all_gather", 4, 3e-5 + 7.5e-3),
        ("reduce_scatter", 4, 3e-5 + 7.5e-3),
        ("all_to_all", 4, 3e-5 + 7.5e-3),
        ("broadcast", 4, 3e-5 + 1e-2),
        ("send", 4, 1e-5 + 1e-2),
        ("recv", 2, 1e-5 + 1e-2),
        ("all_reduce", 8, 14e-5 + 1.75e-2),
        ("all_reduce", 1, 0.0),
        ("all_gather", 1, 0.0),
    ],
)
def test_collective_time_hand_computed(op, n, expected):
    assert collective_time(op, 10**8, n, LINK) == pytest.approx(expected)


def test_op_names_short_and_functional():
    assert canonical_collective(funcol_ops.all_reduce.default) == "all_reduce"
    assert canonical_collective(funcol_ops.all_reduce_.default) == "all_reduce"
    assert canonical_collective(funcol_ops.all_gather_into_tensor.default) == "all_gather"
    assert canonical_collective(funcol_ops.reduce_scatter_tensor.default) == "reduce_scatter"
    assert canonical_collective(funcol_ops.all_to_all_single.default) == "all_to_all"
    assert canonical_collective("_c10d_functional::broadcast") == "broadcast"
    assert canonical_collective("_c10d_functional.all_gather_into_tensor.default") == "all_gather"
    assert canonical_collective("reduce_scatter_tensor") == "reduce_scatter"
    assert canonical_collective(funcol_ops.broadcast) == "broadcast"  # an OpOverloadPacket
    assert canonical_collective("_c10d_functional::isend") == "send"
    if hasattr(funcol_ops, "isend"):  # functional p2p ops exist from torch 2.13
        assert canonical_collective(funcol_ops.isend) == "send"
    assert canonical_collective(torch.ops._c10d_functional_autograd.all_to_all_single.default) == "all_to_all"
    t = collective_time(funcol_ops.all_gather_into_tensor.default, 4096, 2, LINK)
    assert t == collective_time("all_gather", 4096, 2, LINK)
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("all_shuffle", 1, 2, LINK)
    with pytest.raises(ValueError, match="world_size"):
        collective_time("all_reduce", 1, 0, LINK)


def test_links_are_complete_and_positive():
    required = {"nvlink3", "nvlink4", "pcie4", "pcie5", "infiniband-hdr", "infiniband-ndr", "hccs", "loopback-gloo"}
    assert required <= set(LINKS)
    for name, link in LINKS.items():
        assert link.name == name and link.alpha_s > 0 and link.bandwidth_bytes_per_s > 0
    assert LINKS["nvlink4"].bandwidth_bytes_per_s > LINKS["nvlink3"].bandwidth_bytes_per_s > LINKS["pcie5"].bandwidth_bytes_per_s


def test_fit_recovers_alpha_and_bandwidth():
    n, alpha, bw = 2, 2e-5, 5e9
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    times = [2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw for s in sizes]
    a, b = _fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    # Noise that makes time shrink with size: still positive numbers.
    a, b = _fit_alpha_beta(sizes, [4e-3, 3e-3, 2e-3, 1e-3], n)
    assert a > 0 and b > 0


# ---- collective nodes in a graph --------------------------------------------------------------


def collective_graph(world: int) -> torch.fx.GraphModule:
    """x -> all_reduce -> wait; x -> all_gather(world) -> wait; x -> reduce_scatter(world) -> wait."""
    g = torch.fx.Graph()
    with FakeTensorMode() as mode:
        xv = torch.empty(64, 32)
        x = g.placeholder("x")
        x.meta["val"] = xv

        def call(op, args, val):
            node = g.call_function(op, args)
            node.meta["val"] = val
            wait = g.call_function(funcol_ops.wait_tensor.default, (node,))
            wait.meta["val"] = val
            return wait

        outs = [
            call(funcol_ops.all_reduce.default, (x, "sum", "pg0"), torch.empty(64, 32)),
            call(funcol_ops.all_gather_into_tensor.default, (x, world, "pg0"), torch.empty(64 * world, 32)),
            call(funcol_ops.reduce_scatter_tensor.default, (x, "sum", world, "pg0"), torch.empty(64 // world, 32)),
        ]
    del mode
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_comm_node_costs():
    gm = collective_graph(world=4)
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    nbytes = 64 * 32 * 4
    ar = comm_node_cost(nodes[funcol_ops.all_reduce.default], LINK, world_size=8)
    assert ar.runtime_s == pytest.approx(collective_time("all_reduce", nbytes, 8, LINK))
    assert ar.out_bytes == nbytes and ar.bytes_moved == nbytes and ar.source == "analytic"
    # group_size argument (4) wins over the world_size argument.
    ag = comm_node_cost(nodes[funcol_ops.all_gather_into_tensor.default], LINK, world_size=8)
    assert ag.runtime_s == pytest.approx(collective_time("all_gather", 4 * nbytes, 4, LINK))
    rs = comm_node_cost(nodes[funcol_ops.reduce_scatter_tensor.default], LINK, world_size=8)
    assert rs.runtime_s == pytest.approx(collective_time("reduce_scatter", nbytes, 4, LINK))
    assert rs.out_bytes == nbytes // 4
    waits = [n for n in gm.graph.nodes if n.target == funcol_ops.wait_tensor.default]
    assert all(comm_node_cost(w, LINK) == NodeCost.zero() for w in waits)
    with pytest.raises(ValueError, match="world_size"):
        comm_node_cost(nodes[funcol_ops.all_reduce.default], LINK)


def test_analytic_and_annotate_delegate_to_comm():
    gm = collective_graph(world=2)
    prof = PROFILES["a100-sxm4-80gb"]
    ar = next(n for n in gm.graph.nodes if n.target == funcol_ops.all_reduce.default)
    default = analytic_node_cost(ar, prof, world_size=2)
    assert default.runtime_s == pytest.approx(collective_time("all_reduce", 64 * 32 * 4, 2, LINKS["nvlink3"]))
    costs = node_costs(gm, prof, link=LINKS["pcie4"], world_size=2)
    assert costs[ar.name].runtime_s == pytest.approx(collective_time("all_reduce", 64 * 32 * 4, 2, LINKS["pcie4"]))
    assert all(costs[n.name] == NodeCost.zero() for n in gm.graph.nodes if n.target == funcol_ops.wait_tensor.default)


# ---- calibrate_link on a real 2-process gloo group --------------------------------------------


def _calibrate_worker(rank: int, world: int, init_file: str, results) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from lynx_compile.costs import calibrate_link, collective_time, comm_node_cost

    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=30),
        )
        link = calibrate_link(repeats=5)
        # A traced functional all_reduce: world size comes from its group, not the argument.
        gm = make_fx(lambda x: funcol.all_reduce(x, "sum", dist.group.WORLD), tracing_mode="fake")(torch.randn(256))
        node = next(n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.all_reduce.default)
        cost = comm_node_cost(node, link, world_size=5)
        expected = collective_time("all_reduce", 256 * 4, world, link)
        results.put((rank, link.alpha_s, link.bandwidth_bytes_per_s, cost.runtime_s, expected, None))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the parent
        results.put((rank, None, None, None, None, repr(e)))


def _two_gloo_ranks(worker, init_file: str, *args) -> list:
    """What ``worker(rank, 2, init_file, *args, results)`` puts on the queue in each of two
    spawned processes (60 s for both, then they are stopped)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, init_file, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(results.get(timeout=60))
    except queue.Empty:
        pytest.fail(f"{worker.__name__} did not report within 60 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return got


def test_calibrate_link_on_gloo(tmp_path):
    got = _two_gloo_ranks(_calibrate_worker, str(tmp_path / "pg_init"))
    errors = [g[5] for g in got if g[5]]
    assert not errors, errors
    (r0, a0, bw0, c0, e0, _), (r1, a1, bw1, c1, e1, _) = sorted(got)
    assert a0 > 0 and bw0 > 0
    assert (a0, bw0) == (a1, bw1)  # every rank fits the same max-reduced times
    assert c0 == pytest.approx(e0) and c1 == pytest.approx(e1)
    assert 0 < a0 < 1.0 and 1e5 < bw0 < float("inf"), (a0, bw0)


# ---- the calibrated link kept per machine (issue S item 1) ------------------------------------


def _machine_link_worker(rank: int, world: int, init_file: str, cache: str, results) -> None:
    import os

    import torch.distributed as dist

    os.environ["LYNX_LINK_PROFILE"] = cache
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    from lynx_compile.distributed.link import resolve_link

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        link = resolve_link("auto", "nvlink4")
        results.put((rank, (link.name, link.alpha_s, link.bandwidth_bytes_per_s), None))
        dist.destroy_process_group()
    except Exception as e:  # report instead of hanging the parent
        results.put((rank, None, repr(e)))


def _two_ranks(tmp_path, cache: str, tag: str) -> list:
    got = _two_gloo_ranks(_machine_link_worker, str(tmp_path / f"pg_init_{tag}"), cache)
    assert not [g[2] for g in got if g[2]], got
    return [g[1] for g in sorted(got)]


def test_calibrated_link_is_kept_and_every_rank_reads_rank_0s(tmp_path):
    """``link="auto"`` with two ranks: calibrated once (both ranks the same profile) and kept in
    the machine's file; a later run reads it instead of timing again (its numbers exactly, a
    second calibration would differ); an entry written by hand is what every rank plans with."""
    import json

    cache = str(tmp_path / "links.json")
    first = _two_ranks(tmp_path, cache, "a")
    assert first[0] == first[1] and first[0][0] == "calibrated-gloo-2"
    (key, kept), = json.loads(open(cache).read()).items()
    assert "backend=gloo;world=2" in key
    assert (kept["name"], kept["alpha_s"], kept["bandwidth_bytes_per_s"]) == first[0]
    assert _two_ranks(tmp_path, cache, "b") == first
    with open(cache, "w") as f:
        json.dump({key: {"name": "calibrated-gloo-2", "alpha_s": 1.0, "bandwidth_bytes_per_s": 1e3}}, f)
    assert _two_ranks(tmp_path, cache, "c") == [("calibrated-gloo-2", 1.0, 1e3)] * 2
