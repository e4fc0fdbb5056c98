"""An emulated interconnect for CPU benchmarks: gloo whose collectives complete at α–β speed.

On one host, gloo over loopback makes communication far cheaper relative to compute than on a
GPU cluster, so there is little communication time for Lynx to hide recompute in. The
``"lynx_emulated"`` backend wraps a real gloo process group and delays each collective's
*completion* to what :func:`lynx_compile.costs.comm.collective_time` gives on a configured
:class:`LinkProfile`::

    issue_t ─ gloo runs the op (real data, real values) ─ inner_done_t
            ─ the link is busy for collective_time(kind, nbytes, n, link) ─ modeled_done_t
    done_t = max(inner_done_t, modeled_done_t)      # the Work completes, wait() returns

Usage (every rank)::

    import lynx_compile.distributed.emulated_link as el   # registers the backend
    el.configure_emulated_link(LinkProfile("x", 1e-3, 5e6))   # or LYNX_EMULATED_LINK=1e-3,5e6
    dist.init_process_group("lynx_emulated", ...)

How, and why this way:

- ``dist.ProcessGroup`` can be subclassed in Python (its pybind trampoline routes the C++
  virtuals ``allreduce``, ``allgather``, ``all_gather_single_coalesced``,
  ``reduce_scatter_single_coalesced``, ``all_to_all_single``, ``broadcast``, ``barrier``,
  ``send``, ``recv`` back to Python); ``c10d.Backend`` cannot. So the creator registered with
  ``Backend.register_backend`` returns a ProcessGroup subclass, which c10d then uses as the
  whole group. The functional collectives (``_c10d_functional.all_reduce``,
  ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``) resolve the
  group by name and call those virtuals, so they, DTensor and torch.compile'd graphs go
  through the emulation. C++ virtuals the trampoline does *not* route (``_allgather_base`` /
  ``all_gather_single``, ``reduce_scatter_single``, ``reduce``, ``gather``, ``scatter``,
  e.g. ``_c10d_functional.all_gather_into_tensor_out``) fail with "no backend for cpu" rather
  than silently bypassing the link; their *Python* entry points (``dist.all_gather_into_tensor``
  etc.) are wrapped here.
- The returned Work wraps a ``torch.futures.Future`` (``_create_work_from_future``, as torch's
  own ``multi_threaded_pg`` does). One daemon thread per group completes the futures in issue
  order: it blocks in the gloo work's ``wait()`` and then ``time.sleep``s to the modeled
  deadline, both with the GIL released, so the main thread computes meanwhile and nothing
  spins. In-order completion is what one NCCL stream gives, and the link is serial:
  ``modeled_done_t = max(issue_t, previous modeled_done_t) + collective_time(...)``.

Limits: each rank models its own issue time, so when a peer issues late the real gloo wait
absorbs the skew instead of adding the full modeled time after the late peer (SPMD ranks issue
together, so this is small). The completing thread needs the GIL to set the future, so while
the main thread runs pure-Python code completion can lag by up to ``sys.getswitchinterval()``
(torch ops and waits release the GIL). Collectives are not emitted into torch.profiler traces
(``record_function`` brackets a span on one thread; an in-flight interval starts on the issuing
thread and ends on the link thread): use :func:`collective_log`.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    ProcessGroupGloo,
    ReduceScatterOptions,
    _create_work_from_future,
)
from torch.futures import Future

from lynx_compile.costs.comm import LINKS, LinkProfile, collective_time

BACKEND_NAME = "lynx_emulated"
ENV_VAR = "LYNX_EMULATED_LINK"
NAME_PREFIX = "emulated-"


@dataclass(frozen=True)
class CollectiveRecord:
    """One completed collective on an emulated group (times from ``time.perf_counter()``)."""

    kind: str
    """Canonical kind (``comm.COLLECTIVE_KINDS``), or ``"barrier"``."""
    nbytes: int
    """Payload in ``comm.collective_time``'s convention for ``kind``."""
    issue_t: float
    """When the op was handed to the group."""
    modeled_done_t: float
    """When the emulated link finishes it: ``max(issue_t, link free) + modeled time``."""
    done_t: float
    """When its Work completed: ``max(inner_done_t, modeled_done_t)`` plus thread wake-up."""
    inner_done_t: float
    """When gloo itself finished (after ``modeled_done_t`` means gloo, not the link, bound it)."""
    group_name: str
    """The process group's name."""


_LOG: list[CollectiveRecord] = []
_configured: LinkProfile | None = None


def collective_log() -> tuple[CollectiveRecord, ...]:
    """Every collective completed in this process on an emulated group, in completion order."""
    return tuple(_LOG)


def clear_collective_log() -> None:
    """Forget the records so far (collectives still in flight are recorded when they complete)."""
    _LOG.clear()


def parse_link(spec: str) -> LinkProfile:
    """``"alpha_s,bandwidth_bytes_per_s"`` or a ``comm.LINKS`` name -> an ``emulated-`` link.

    Raises ValueError on anything else, naming the accepted forms.
    """
    text = spec.strip()
    name = text.removeprefix(NAME_PREFIX)
    if name in LINKS:
        return _emulated_name(LINKS[name])
    try:
        alpha, bw = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected 'alpha_s,bandwidth_bytes_per_s' "
                         f"(e.g. '1e-3,5e6') or one of {sorted(LINKS)}") from None
    if alpha < 0 or bw <= 0:
        raise ValueError(f"{ENV_VAR}={spec!r}: need alpha_s >= 0 and bandwidth > 0")
    return LinkProfile(f"{NAME_PREFIX}alpha{alpha:g}-bw{bw:g}", alpha, bw)


def configure_emulated_link(link: LinkProfile | str | None) -> LinkProfile | None:
    """Set the link for emulated groups created from now on (it beats ``LYNX_EMULATED_LINK``).

    A string is parsed by :func:`parse_link`; ``None`` clears the setting. The name gets an
    ``emulated-`` prefix when it lacks one, so reports say the link is emulated. Groups created
    earlier keep their link. Returns the link as stored.
    """
    global _configured
    if isinstance(link, str):
        link = parse_link(link)
    _configured = None if link is None else _emulated_name(link)
    return _configured


def current_link() -> LinkProfile:
    """The link a new emulated group gets: configured, else ``LYNX_EMULATED_LINK``; else raise."""
    if _configured is not None:
        return _configured
    spec = os.environ.get(ENV_VAR)
    if spec:
        return parse_link(spec)
    raise RuntimeError(f"backend {BACKEND_NAME!r} needs a link: call configure_emulated_link() "
                       f"or set {ENV_VAR} ('alpha_s,bandwidth_bytes_per_s' or one of {sorted(LINKS)})")


def emulated_link_of(group: Any = None) -> LinkProfile | None:
    """The emulated link of ``group`` (default WORLD), or None when it is not an emulated group
    or torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    return group.link if isinstance(group, EmulatedProcessGroup) else None


def _emulated_name(link: LinkProfile) -> LinkProfile:
    if link.name.startswith(NAME_PREFIX):
        return link
    return dataclasses.replace(link, name=NAME_PREFIX + link.name)


class _LinkThread:
    """A serial link: a FIFO of issued ops and one daemon thread completing them in order."""

    def __init__(self, link: LinkProfile, world_size: int):
        self.link, self.world_size = link, world_size
        self._busy_until = 0.0  # modeled time the link finishes the last issued op
        self._lock = threading.Lock()  # issue order == FIFO order == _busy_until order
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="lynx-emulated-link", daemon=True).start()

    def submit(self, kind: str, nbytes: int, issue_t: float, works: list, result: list,
               group_name: str):
        """Queue gloo ``works`` (already issued at ``issue_t``); return a Work that completes
        when they have and the link has carried ``nbytes`` of ``kind``."""
        model_kind = "all_reduce" if kind == "barrier" else kind  # NCCL barrier = tiny allreduce
        fut = Future()
        with self._lock:
            start = max(issue_t, self._busy_until)
            self._busy_until = start + collective_time(model_kind, nbytes, self.world_size, self.link)
            self._queue.put((kind, nbytes, issue_t, self._busy_until, works, result, fut, group_name))
        return _create_work_from_future(fut)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, nbytes, issue_t, modeled_done, works, result, fut, group_name = item
            try:
                for w in works:
                    w.wait()  # releases the GIL
            except Exception as e:  # a gloo error or timeout: the waiter sees it
                fut.set_exception(e)
                continue
            inner_done = time.perf_counter()
            if modeled_done > inner_done:
                time.sleep(modeled_done - inner_done)
            done = time.perf_counter()
            _LOG.append(CollectiveRecord(kind, nbytes, issue_t, modeled_done, done, inner_done,
                                         group_name))
            fut.set_result(result)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EmulatedProcessGroup(dist.ProcessGroup):
    """A gloo process group whose Works complete no earlier than ``link`` allows (module doc).

    Every method issues the real gloo op at once and returns a Work; nbytes follow
    ``collective_time``'s conventions (all_gather: output, reduce_scatter: input, ...).
    """

    def __init__(self, store, rank: int, world_size: int, timeout, link: LinkProfile):
        super().__init__(rank, world_size)
        self.link = link
        self.inner = ProcessGroupGloo(store, rank, world_size, timeout)
        self._name = self._desc = ""
        self._link = _LinkThread(link, world_size)
        # The thread must not keep the group alive; stop it when the group goes away.
        weakref.finalize(self, self._link.close)

    def _issue(self, kind: str, nbytes: int, issue_t: float, works, result):
        works = works if isinstance(works, list) else [works]
        return self._link.submit(kind, nbytes, issue_t, works, result, self._name)

    # -- names: c10d sets these on the group; a Python group must store them itself.
    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"EmulatedProcessGroup({self.rank()}/{self.size()}, {self.link})"

    # -- collectives
    def allreduce(self, tensors, opts=None):
        t0 = time.perf_counter()
        work = self.inner.allreduce(tensors, opts or AllreduceOptions())
        return self._issue("all_reduce", _nbytes(tensors), t0, work, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        t0 = time.perf_counter()
        work = self.inner.allreduce_coalesced(tensors, opts or AllreduceCoalescedOptions())
        return self._issue("all_reduce", _nbytes(tensors), t0, work, tensors)

    def allgather(self, output_lists, inputs, opts=None):
        t0 = time.perf_counter()
        work = self.inner.allgather(output_lists, inputs, opts or AllgatherOptions())
        outs = [t for ts in output_lists for t in ts]
        return self._issue("all_gather", _nbytes(outs), t0, work, outs)

    def all_gather_single(self, output, input, opts=None):
        t0 = time.perf_counter()
        work = self.inner._allgather_base(output, input, opts or AllgatherOptions())
        return self._issue("all_gather", _nbytes([output]), t0, work, [output])

    _allgather_base = all_gather_single  # the pre-2.13 name Python callers may use

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        # gloo has no coalesced form: issue one per tensor, model them as one transfer.
        t0, opts = time.perf_counter(), opts or AllgatherOptions()
        works = [self.inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._issue("all_gather", _nbytes(outputs), t0, works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output, input, opts=None):
        t0 = time.perf_counter()
        work = self.inner._reduce_scatter_base(output, input, opts or ReduceScatterOptions())
        return self._issue("reduce_scatter", _nbytes([input]), t0, work, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        t0, opts = time.perf_counter(), opts or ReduceScatterOptions()
        works = [self.inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._issue("reduce_scatter", _nbytes(inputs), t0, works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        t0 = time.perf_counter()
        work = self.inner.reduce_scatter(outputs, input_lists, opts or ReduceScatterOptions())
        ins = [t for ts in input_lists for t in ts]
        return self._issue("reduce_scatter", _nbytes(ins), t0, work, outputs)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        t0 = time.perf_counter()
        work = self.inner.alltoall_base(output, input, output_splits, input_splits,
                                        opts or AllToAllOptions())
        return self._issue("all_to_all", _nbytes([input]), t0, work, [output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        t0 = time.perf_counter()
        work = self.inner.alltoall(outputs, inputs, opts or AllToAllOptions())
        return self._issue("all_to_all", _nbytes(inputs), t0, work, outputs)

    def broadcast(self, tensors, opts=None):
        t0 = time.perf_counter()
        work = self.inner.broadcast(tensors, opts or BroadcastOptions())
        return self._issue("broadcast", _nbytes(tensors), t0, work, tensors)

    def barrier(self, opts=None):
        t0 = time.perf_counter()
        work = self.inner.barrier(opts or BarrierOptions())
        return self._issue("barrier", 0, t0, work, [])

    def send(self, tensors, dst: int, tag: int = 0):
        t0 = time.perf_counter()
        work = self.inner.send(tensors, dst, tag)
        return self._issue("send", _nbytes(tensors), t0, work, tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        t0 = time.perf_counter()
        work = self.inner.recv(tensors, src, tag)
        return self._issue("recv", _nbytes(tensors), t0, work, tensors)


def _create(store, rank: int, world_size: int, timeout) -> EmulatedProcessGroup:
    """The creator c10d calls for ``init_process_group("lynx_emulated")`` / ``new_group``."""
    return EmulatedProcessGroup(store, rank, world_size, timeout, current_link())


def register_backend() -> None:
    """Make ``"lynx_emulated"`` a c10d backend name (done on import; idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])


register_backend()
