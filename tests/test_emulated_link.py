"""The emulated link: gloo values, completion no earlier than the α–β model, real overlap.

The distributed checks run once, in two spawned ranks on the ``lynx_emulated`` backend
(configured by ``LYNX_EMULATED_LINK``, as a torchrun launcher would), each rank returning a dict
of measurements; the tests below assert on them. Plain gloo is the oracle for values: a gloo
subgroup over the same ranks runs the same ops.

No check asserts a duration (2 shared cores run 2 ranks plus their gloo threads): the checks
are orders of events - an op never completes before the model says, compute issued after an
async collective starts before the link is done.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lynx_compile.costs.comm import LinkProfile, calibrate_link, collective_time
from lynx_compile.distributed import emulated_link as el

WORLD = 2
LINK_ENV = "1e-3,5e6"  # α = 1 ms, 5 MB/s: a 256 KiB all_reduce takes 2 ms + 52 ms
LINK = LinkProfile("emulated-alpha0.001-bw5e+06", 1e-3, 5e6)
SLOW = LinkProfile("slow", 2e-3, 1e6)  # configured in code for a second group
JOIN_TIMEOUT_S = 90
COMPUTE_S = 0.15  # compute issued while a collective is in flight
BIG = 250_000  # float32 elements: 1 MB, all_reduce modeled at 2 ms + 200 ms
CALIBRATION_SIZES = (4096, 262144)


# ---------------------------------------------------------------- in-process checks


def test_parse_link_forms():
    assert el.parse_link(LINK_ENV) == LINK
    assert el.parse_link(" nvlink4 ").name == "emulated-nvlink4"
    assert el.parse_link("emulated-pcie4").alpha_s == 5.7e-6
    for bad in ("fast", "1e-3", "1e-3,0", "-1,5e6", "a,b"):
        with pytest.raises(ValueError, match="LYNX_EMULATED_LINK"):
            el.parse_link(bad)


def test_configure_beats_env_and_prefixes_name(monkeypatch):
    monkeypatch.setenv(el.ENV_VAR, LINK_ENV)
    try:
        el.configure_emulated_link(None)
        assert el.current_link() == LINK
        assert el.configure_emulated_link(SLOW).name == "emulated-slow"
        assert el.current_link() == LinkProfile("emulated-slow", 2e-3, 1e6)
        assert el.configure_emulated_link("infiniband-ndr").name == "emulated-infiniband-ndr"
        el.configure_emulated_link(None)
        monkeypatch.delenv(el.ENV_VAR)
        with pytest.raises(RuntimeError, match="configure_emulated_link"):
            el.current_link()
    finally:
        el.configure_emulated_link(None)


def test_backend_registered_and_no_group_is_not_emulated():
    assert el.BACKEND_NAME in dist.Backend.backend_list
    assert el.emulated_link_of() is None  # torch.distributed not initialized here


# ---------------------------------------------------------------- the two ranks


def _spin(seconds: float) -> None:
    """Busy compute for a fixed wall time (so the check does not depend on core speed)."""
    a = torch.randn(64, 64)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)


def _values(rank: int, gloo) -> dict[str, bool]:
    """Each op on the emulated WORLD and on plain gloo: same result?"""
    import torch.distributed._functional_collectives as fc

    t = torch.arange(6.0) + 10 * rank

    def ops(g):
        out = {}
        out["all_reduce"] = (dist.all_reduce(x := t.clone(), group=g), x)[1]
        out["all_gather_into_tensor"] = (
            dist.all_gather_into_tensor(o := torch.empty(12), t, group=g), o)[1]
        out["reduce_scatter_tensor"] = (dist.reduce_scatter_tensor(o := torch.empty(3), t, group=g), o)[1]
        out["broadcast"] = (dist.broadcast(x := t.clone(), 1, group=g), x)[1]
        out["all_to_all_single"] = (dist.all_to_all_single(o := torch.empty(6), t, group=g), o)[1]
        objs = [None] * WORLD
        dist.all_gather_object(objs, {"rank": rank}, group=g)
        out["all_gather_object"] = torch.tensor([o["rank"] for o in objs])
        if rank == 0:
            dist.send(t, 1, group=g)
            out["send_recv"] = t
        else:
            out["send_recv"] = (dist.recv(x := torch.empty(6), 0, group=g), x)[1]
        out["fc.all_reduce"] = fc.wait_tensor(fc.all_reduce(t, "sum", g))
        out["fc.all_gather_tensor"] = fc.wait_tensor(fc.all_gather_tensor(t, 0, g))
        out["fc.reduce_scatter_tensor"] = fc.wait_tensor(fc.reduce_scatter_tensor(t, "sum", 0, g))
        return out

    emulated, plain = ops(dist.group.WORLD), ops(gloo)
    return {k: torch.equal(emulated[k], plain[k]) for k in plain}


def _timing(rank: int) -> dict:
    """Blocking collectives take at least their modeled time; the log says so too."""
    el.clear_collective_log()
    x = torch.ones(65536)  # 256 KiB
    t0 = time.perf_counter()
    dist.all_reduce(x)
    ar = time.perf_counter() - t0
    t0 = time.perf_counter()
    dist.all_gather_into_tensor(torch.empty(2 * 32768), torch.ones(32768))  # 256 KiB out
    ag = time.perf_counter() - t0
    # Two async all_reduces back to back: the link is serial, the second finishes t later.
    w1, w2 = dist.all_reduce(x, async_op=True), dist.all_reduce(x, async_op=True)
    w1.wait()
    w2.wait()
    return {"all_reduce_s": ar, "all_gather_s": ag, "log": [r.__dict__ for r in el.collective_log()]}


def _eager_overlap(rank: int) -> dict:
    """fc.all_reduce, compute, wait: compute starts while the link is still busy.

    Returns event times (perf_counter seconds) and the collective's log records; the tests
    check their order, never a duration: an issue that blocked until the link was done would
    start the compute after ``modeled_done_t``.
    """
    import torch.distributed._functional_collectives as fc

    big = torch.ones(BIG)
    dist.barrier()
    h = fc.all_reduce(big, "sum", dist.group.WORLD)
    c0 = time.perf_counter()
    _spin(COMPUTE_S)
    fc.wait_tensor(h)
    waited = time.perf_counter()
    rec = el.collective_log()[-1]
    dist.barrier()
    fc.wait_tensor(fc.all_reduce(big, "sum", dist.group.WORLD))
    serial_c0 = time.perf_counter()
    serial_rec = el.collective_log()[-1]
    _spin(COMPUTE_S)
    return {"compute_start_t": c0, "wait_returned_t": waited, "rec": rec.__dict__,
            "serial_compute_start_t": serial_c0, "serial_rec": serial_rec.__dict__}


STAMPS: list[float] = []


@torch.library.custom_op("lynx_test::stamp", mutates_args=())
def _stamp(x: torch.Tensor) -> torch.Tensor:
    """Identity that records when it ran: marks the start of compute inside a compiled graph."""
    STAMPS.append(time.perf_counter())
    return x.clone()


@_stamp.register_fake
def _(x):
    return torch.empty_like(x)


def _compiled_overlap(rank: int) -> dict:
    """The same inside torch.compile(backend="aot_eager"), with the raw functional ops."""
    c10d = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    w = torch.randn(512, 512) / 512**0.5

    @torch.compile(backend="aot_eager", fullgraph=True)
    def overlapped(big, a):
        h = c10d.all_reduce(big, "sum", name)
        a = _stamp(a)
        for _ in range(8):
            a = torch.tanh(a @ w)
        return c10d.wait_tensor(h), a

    big = torch.ones(BIG)
    out, _ = overlapped(big, w)  # compile; also checks the value
    value_ok = torch.equal(out, torch.full((BIG,), float(WORLD)))
    dist.barrier()
    STAMPS.clear()
    overlapped(big, w)
    return {"value_ok": value_ok, "compute_start_t": STAMPS[-1], "rec": el.collective_log()[-1].__dict__}


def _dtensor(rank: int) -> dict:
    """Tensor-parallel MLP on a DeviceMesh over the emulated group, eager and compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    x = torch.randn(3, 8)
    with torch.no_grad():
        ref = mlp(x)
    tp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    el.clear_collective_log()
    with torch.no_grad():
        eager = torch.allclose(tp(x), ref, atol=1e-5)
        kinds = [r.kind for r in el.collective_log()]
        compiled = torch.allclose(torch.compile(tp, backend="aot_eager")(x), ref, atol=1e-5)
    link = el.emulated_link_of(mesh.get_group())
    return {"eager_ok": eager, "compiled_ok": compiled, "kinds": kinds,
            "mesh_link": None if link is None else link.name}


def _configured_group(rank: int, gloo) -> dict:
    """configure_emulated_link() beats the env var for groups created after it."""
    el.configure_emulated_link(SLOW)
    g = dist.new_group(backend=el.BACKEND_NAME)
    el.clear_collective_log()
    dist.all_reduce(x := torch.ones(1000), group=g)
    rec = el.collective_log()[-1]
    return {"world": el.emulated_link_of().name, "new": el.emulated_link_of(g).name,
            "gloo": el.emulated_link_of(gloo), "sum_ok": bool((x == WORLD).all()),
            "rec_group_is_new": rec.group_name == g.group_name,
            "rec_modeled_s": rec.modeled_done_t - rec.issue_t}


def _rank_main(rank: int, port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        os.environ[el.ENV_VAR] = LINK_ENV  # what a launcher exports
        dist.init_process_group(el.BACKEND_NAME, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD, timeout=timedelta(seconds=60))
        gloo = dist.new_group(backend="gloo")
        out = {
            "link": el.emulated_link_of().name,
            "values": _values(rank, gloo),
            "timing": _timing(rank),
            "eager_overlap": _eager_overlap(rank),
            "compiled_overlap": _compiled_overlap(rank),
            "dtensor": _dtensor(rank),
            "configured": _configured_group(rank, gloo),
            # what lynx measures on this group is the emulated link, not loopback
            "calibrated": calibrate_link(sizes=CALIBRATION_SIZES, repeats=2).__dict__,
        }
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Run ``_rank_main`` on 2 spawned ranks; kill them and fail if they outlive the timeout."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results), daemon=True) for r in range(WORLD)]
    got: dict[int, object] = {}
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        for p in procs:
            p.start()
        while len(got) < WORLD and time.monotonic() < deadline:
            try:
                rank, out = results.get(timeout=0.5)
                got[rank] = out
                if isinstance(out, str):
                    break  # the first traceback is the cause; the other rank may be stuck
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank died without reporting
        if len(got) == WORLD:
            # Exiting takes seconds on a loaded box (torch's own teardown), and a crash there
            # (a thread woken during finalization) is a bug to catch, so wait for it.
            for p in procs:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = [f"rank {r}:\n{v}" for r, v in sorted(got.items()) if isinstance(v, str)]
    if errors:
        pytest.fail("\n".join(errors))
    codes = [p.exitcode for p in procs]
    if len(got) < WORLD:
        pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(got))} did not report within "
                    f"{JOIN_TIMEOUT_S} s (exit codes {codes})")
    assert codes == [0] * WORLD, f"ranks reported but exited with {codes}"
    return [got[r] for r in range(WORLD)]


# ---------------------------------------------------------------- distributed checks


@pytest.mark.timeout(120)
def test_values_equal_plain_gloo(ranks):
    for out in ranks:
        assert out["link"] == LINK.name
        assert out["values"] and all(out["values"].values()), out["values"]


@pytest.mark.timeout(120)
def test_completion_not_before_model(ranks):
    t_ar = collective_time("all_reduce", 65536 * 4, WORLD, LINK)  # ~54 ms
    t_ag = collective_time("all_gather", 65536 * 4, WORLD, LINK)  # ~27 ms
    for out in ranks:
        tm = out["timing"]
        assert tm["all_reduce_s"] >= t_ar  # a lower bound the emulator guarantees, not a timing
        assert tm["all_gather_s"] >= t_ag


@pytest.mark.timeout(120)
def test_collective_log_records(ranks):
    t_ar = collective_time("all_reduce", 65536 * 4, WORLD, LINK)
    for out in ranks:
        log = out["timing"]["log"]
        kinds = ["all_reduce", "all_gather", "all_reduce", "all_reduce"]
        assert [(r["kind"], r["nbytes"]) for r in log] == [(k, 262144) for k in kinds]
        for r in log:
            assert r["issue_t"] <= r["modeled_done_t"] <= r["done_t"]
            assert r["inner_done_t"] <= r["done_t"]
        assert log[0]["modeled_done_t"] - log[0]["issue_t"] == pytest.approx(t_ar)
        # back-to-back async ops: the serial link starts the second when the first is done
        assert log[3]["modeled_done_t"] - log[2]["modeled_done_t"] == pytest.approx(t_ar)


@pytest.mark.timeout(120)
def test_eager_functional_collective_overlaps_compute(ranks):
    for out in ranks:
        o, rec, srec = out["eager_overlap"], out["eager_overlap"]["rec"], out["eager_overlap"]["serial_rec"]
        assert rec["kind"] == "all_reduce" and rec["nbytes"] == BIG * 4
        # the issue returned at once: compute ran while the link was still busy ...
        assert rec["issue_t"] <= o["compute_start_t"] < rec["modeled_done_t"], o
        # ... and the wait still returned no earlier than the link's modeled completion
        assert o["wait_returned_t"] >= rec["modeled_done_t"]
        # issue + wait first: the compute starts only after the link is done
        assert o["serial_compute_start_t"] >= srec["modeled_done_t"], o


@pytest.mark.timeout(120)
def test_compiled_functional_collective_overlaps_compute(ranks):
    for out in ranks:
        o, rec = out["compiled_overlap"], out["compiled_overlap"]["rec"]
        assert o["value_ok"]
        assert rec["kind"] == "all_reduce" and rec["nbytes"] == BIG * 4
        # inside the compiled graph, the compute after the all_reduce starts while it is in flight
        assert rec["issue_t"] <= o["compute_start_t"] < rec["modeled_done_t"], o
        assert rec["done_t"] >= rec["modeled_done_t"]


@pytest.mark.timeout(120)
def test_dtensor_tensor_parallel_mlp(ranks):
    for out in ranks:
        d = out["dtensor"]
        assert d["eager_ok"] and d["compiled_ok"], d
        assert d["kinds"] == ["all_reduce"]  # RowwiseParallel's partial-sum reduction
        assert d["mesh_link"] == LINK.name


@pytest.mark.timeout(120)
def test_configured_link_for_new_group(ranks):
    for out in ranks:
        c = out["configured"]
        assert c["world"] == LINK.name and c["new"] == "emulated-slow" and c["gloo"] is None
        assert c["sum_ok"] and c["rec_group_is_new"]
        assert c["rec_modeled_s"] == pytest.approx(collective_time("all_reduce", 4000, WORLD, SLOW))


@pytest.mark.timeout(120)
def test_calibration_measures_the_emulated_link(ranks):
    a, b = (LinkProfile(**out["calibrated"]) for out in ranks)
    assert a == b and a.name == "calibrated-lynx_emulated-2"  # max-reduced times, one fit
    # The emulated link never completes before its model, and the fit passes through (or, when
    # noise clamps it, above) the measured points: what lynx calibrates is never faster than the
    # link it measured. (How close it comes is a timing, measured in bench_measured_costs.py.)
    for nbytes in CALIBRATION_SIZES:
        assert collective_time("all_reduce", nbytes, WORLD, a) >= collective_time("all_reduce", nbytes, WORLD, LINK) * (1 - 1e-9)
