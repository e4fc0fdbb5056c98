"""Run a function on N gloo CPU ranks from a test, and never hang pytest.

    results = run_ranks(check_something, 2, "gpt")   # check_something(rank, 2, "gpt") per rank

``fn`` must be a module-level function (it is pickled by name, and unpickled in each child once
the child has the parent's ``sys.path``, environment and working directory of the moment). Each
child sets one intra-op thread, joins a gloo process group on 127.0.0.1, runs ``fn`` and sends
back its pickled result or its traceback. The parent kills every child and raises AssertionError
on the first failing rank, on a child that dies without reporting, or when ``timeout_s`` runs out.

On Linux the children are forked from a fork server that imported torch, dynamo, Inductor and
lynx_compile once per pytest process (``PRELOAD``) instead of being spawned as fresh interpreters:
spawn paid those imports (several seconds of CPU) again in every rank of every call, and a 4-rank
call on two cores paid them twice over. Nothing else is shared between calls: each child is a
fresh fork of the server, which only imports modules (it runs no test, collective or compile).
What a module reads from the environment when it is imported is read in the server, which
starts with the environment of the first call. Elsewhere the children are spawned.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch._dynamo", "torch._inductor.compile_fx", "lynx_compile", "lynx_compile.models", "pyomo.environ")
"""What the fork server imports (besides torch, which this module imports) before it forks any
child: nearly all of what a child imports (dynamo and Inductor alone take seconds)."""

BACKEND_ENV = "LYNX_TESTS_DIST_BACKEND"
"""The process group backend of the children (default gloo; ``lynx_emulated`` for lynx's emulated
link, configured by ``LYNX_EMULATED_LINK`` in the same environment)."""

_SERVER_FLAG = "LYNX_TESTS_DIST_FORKSERVER"
"""Set only in the fork server's environment: this module, imported there, then imports PRELOAD."""


def _preload() -> None:
    """In the fork server: import PRELOAD. A module that fails to import is left to the children
    (each then reports its own error); the server must not die of it."""
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001
            pass


if os.environ.pop(_SERVER_FLAG, None):
    _preload()

# How long other ranks may keep reporting after the first failure, so that the report shows
# every rank's error (the first one is usually the cause, the rest its consequences).
_GRACE_S = 1.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mp_context():
    """The multiprocessing context ``run_ranks`` starts children with (for tests that start their
    own): on Linux the fork server's, running with this module (so PRELOAD) imported and the
    parent's ``sys.path`` (test modules importable), else spawn's."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    # The server is a fresh interpreter (``python -c``); before Python 3.13 it ignores the sys.path
    # multiprocessing hands it, so it gets the parent's through PYTHONPATH, set while it starts.
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", _SERVER_FLAG)}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    os.environ[_SERVER_FLAG] = "1"
    try:
        forkserver.ensure_running()  # a no-op while it runs
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def _child(payload: bytes, parent: tuple, rank: int, world_size: int, port: int, timeout_s: float,
           results: Any) -> None:
    try:
        # as a spawned child has them: the parent's path, environment and directory of the moment
        sys_path, environ, cwd = parent
        sys.path[:] = sys_path
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        os.chdir(cwd)
        fn, args = pickle.loads(payload)
        torch.set_num_threads(1)
        if sys.platform.startswith("linux"):
            # Keep gloo on loopback: the hostname may resolve to an address that is not.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = os.environ.get(BACKEND_ENV, "gloo")
        if backend != "gloo":  # lynx's emulated link (registered when its module is imported)
            import lynx_compile.distributed.emulated_link  # noqa: F401
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Pickle here, not in the queue's feeder thread, so an unpicklable result is reported
        # as this rank's error instead of being dropped silently.
        message = (rank, True, pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        message = (rank, False, traceback.format_exc())
    # Report before tearing down, so a teardown that blocks cannot swallow the result.
    results.put(message)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, one process each.

    Raises AssertionError with the failing rank's traceback if a rank raises, with the exit code
    if a child dies without a result, or with the missing ranks after ``timeout_s`` seconds
    (which also bounds the process group's collective timeout). Children are always killed.
    """
    ctx = mp_context()
    results = ctx.Queue()
    port = free_port()
    payload = pickle.dumps((fn, args))  # unpickled in the child once sys.path is the parent's
    parent = (list(sys.path), dict(os.environ), os.getcwd())
    procs = [
        # Not daemonic, so fn may start processes of its own (e.g. inductor's compile workers);
        # the finally below kills the children on every way out.
        ctx.Process(target=_child, args=(payload, parent, rank, world_size, port, timeout_s, results))
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, world_size, fn.__name__, time.monotonic() + timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()


def _collect(procs: list, results: Any, world_size: int, name: str, deadline: float) -> list[Any]:
    """Every rank's unpickled result in rank order, or AssertionError (see :func:`run_ranks`)."""
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    error_deadline = None
    while len(done) + len(errors) < world_size:
        now = time.monotonic()
        if error_deadline is not None and now > error_deadline:
            break
        if now > deadline:
            if errors:
                break
            missing = sorted(set(range(world_size)) - set(done))
            raise AssertionError(f"{name}: ranks {missing} did not finish in time (hang?)")
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            _check_exits(procs, done, errors, dead_since, name)
            continue
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            error_deadline = error_deadline or time.monotonic() + _GRACE_S
    if errors:
        first = next(iter(errors))
        others = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in errors.items() if r != first)
        # A rank that crashed outright (no traceback) is often why the others failed.
        dead = [f"rank {r} exited with code {p.exitcode} without a result"
                for r, p in enumerate(procs)
                if r not in done and r not in errors and p.exitcode not in (None, 0)]
        dead_note = "".join(f"\n--- {d} ---" for d in dead)
        raise AssertionError(f"{name}: rank {first} failed:\n{errors[first]}{others}{dead_note}")
    return [done[rank] for rank in range(world_size)]


def _check_exits(procs: list, done: dict, errors: dict, dead_since: dict, name: str) -> None:
    """AssertionError if a child that has not reported exited with an error code a while ago.

    The wait lets a result that a child queued just before crashing on exit still arrive.
    """
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank in done or rank in errors or p.exitcode in (None, 0):
            continue
        if now - dead_since.setdefault(rank, now) > _GRACE_S:
            raise AssertionError(f"{name}: rank {rank} died with exit code {p.exitcode}, no result")


def sgd_losses(run: Callable, model: torch.nn.Module, batches: list, lr: float, rank: int = 0,
               world: int = 1) -> list[float]:
    """Train ``model`` (called through ``run``) with SGD, one step per global batch, on this
    rank's ``1 / world`` of each; each step's loss averaged over the ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x in batches:
        loss = run(x.chunk(world)[rank]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses
