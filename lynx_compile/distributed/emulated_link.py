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
  through the emulation. C++ callers of the virtuals the trampoline does *not* route
  (``all_gather_single``, ``reduce_scatter_single``, ``reduce``, ``gather``, ``scatter``; e.g.
  ``_c10d_functional.all_gather_into_tensor_out``) fail with "No backend type associated with
  device type cpu" rather than silently bypassing the link; the *Python* callers
  (``dist.all_gather_into_tensor``, ``dist.scatter``, ...) reach the overrides here.
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
(torch ops and waits release the GIL). Collectives are not emitted into torch.profiler traces:
``record_function`` spans open and close on one profiled thread (on the issuing thread it would
end at the wait, not at completion), and there is no public API to add an event with given
timestamps; :func:`collective_log` has the intervals.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.futures import Future

from lynx_compile import _compat
from lynx_compile.costs.comm import LINKS, LinkProfile, collective_time

_c10d = _compat.c10d_bindings()
AllgatherOptions = _c10d.AllgatherOptions
AllreduceCoalescedOptions = _c10d.AllreduceCoalescedOptions
AllreduceOptions = _c10d.AllreduceOptions
AllToAllOptions = _c10d.AllToAllOptions
BarrierOptions = _c10d.BarrierOptions
BroadcastOptions = _c10d.BroadcastOptions
ProcessGroupGloo = _c10d.ProcessGroupGloo
ReduceScatterOptions = _c10d.ReduceScatterOptions

BACKEND_NAME = "lynx_emulated"
ENV_VAR = "LYNX_EMULATED_LINK"
NAME_PREFIX = "emulated-"


@dataclass(frozen=True)
class CollectiveRecord:
    """One completed collective on an emulated group (times from ``time.perf_counter()``)."""

    kind: str
    """Canonical kind (``graph.collectives.COLLECTIVE_KINDS``), or barrier / gather / scatter / reduce."""
    nbytes: int
    """Payload in ``comm.collective_time``'s convention for ``kind``."""
    issue_t: float
    """When the op was handed to the group."""
    modeled_done_t: float
    """When the emulated link finishes it: ``max(issue_t, link free) + modeled time``."""
    done_t: float
    """When its Work completed: ``max(inner_done_t, modeled_done_t)`` plus thread wake-up."""
    inner_done_t: float
    """When the link thread found gloo finished: gloo's own finish, or later when the thread
    was still completing an earlier op. After ``modeled_done_t`` means gloo, not the emulated
    link, bound this op (its own gloo work or an earlier one)."""
    group_name: str
    """The process group's name."""


_LOG: list[CollectiveRecord] = []
SWITCH_INTERVAL_S = 2e-4
"""Python's GIL switch interval while an emulated group exists (see ``_create``)."""
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


# Kinds the α–β model has no formula for, priced as the collective moving the same bytes.
_MODEL_KIND = {
    "barrier": "all_reduce",  # NCCL's barrier is a one-element allreduce
    "gather": "all_gather",  # the root receives (n-1)/n of the full buffer, as in all_gather
    "scatter": "all_gather",  # the root sends (n-1)/n of the full buffer
    "reduce": "broadcast",  # a pipelined chain toward the root: broadcast run backwards
}


@dataclass
class _Op:
    """An issued op waiting in a link's FIFO."""

    kind: str
    nbytes: int
    issue_t: float
    modeled_done_t: float
    works: list  # the gloo Works carrying it
    result: list  # what the Work's future resolves to (the output tensors)
    fut: Future
    group_name: str


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
        seconds = collective_time(_MODEL_KIND.get(kind, kind), nbytes, self.world_size, self.link)
        fut = Future()
        with self._lock:
            self._busy_until = max(issue_t, self._busy_until) + seconds
            self._queue.put(_Op(kind, nbytes, issue_t, self._busy_until, works, result, fut,
                                group_name))
        return _compat.work_from_future(fut)

    def close(self) -> None:
        """Let the thread exit (it ends after the ops queued so far)."""
        # A thread woken while the interpreter finalizes dies inside pybind's GIL handling,
        # which aborts the process; a daemon thread left blocked in get() is harmless.
        if not sys.is_finalizing():
            self._queue.put(None)

    def _run(self) -> None:
        while self._complete_next():
            pass

    def _complete_next(self) -> bool:
        # One op per call, so its Works and buffers are released when the call returns
        # rather than kept alive by loop variables while the link is idle.
        op = self._queue.get()
        if op is None:
            return False
        try:
            for w in op.works:
                w.wait()  # releases the GIL
        except Exception as e:  # a gloo error or timeout: the waiter sees it
            op.fut.set_exception(e)
            return True
        inner_done = time.perf_counter()
        if op.modeled_done_t > inner_done:
            time.sleep(op.modeled_done_t - inner_done)
        done = time.perf_counter()
        _LOG.append(CollectiveRecord(op.kind, op.nbytes, op.issue_t, op.modeled_done_t, done,
                                     inner_done, op.group_name))
        op.fut.set_result(op.result)
        return True


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
        weakref.finalize(self, self._link.close).atexit = False  # at exit, nothing to wake

    def _issue(self, kind: str, nbytes: int, result: list, start, *args):
        """Run gloo's ``start(*args)`` (a Work, or a list of them) now; return a Work that
        completes when gloo and the modeled link are both done, resolving to ``result``."""
        issue_t = time.perf_counter()
        works = start(*args)
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

    # -- collectives. c10d passes opts; Python callers of the older names may not.
    def allreduce(self, tensors, opts=None):
        return self._issue("all_reduce", _nbytes(tensors), tensors,
                           self.inner.allreduce, tensors, opts or AllreduceOptions())

    def allreduce_coalesced(self, tensors, opts=None):
        return self._issue("all_reduce", _nbytes(tensors), tensors, self.inner.allreduce_coalesced,
                           tensors, opts or AllreduceCoalescedOptions())

    def allgather(self, output_lists, inputs, opts=None):
        outs = [t for ts in output_lists for t in ts]
        return self._issue("all_gather", _nbytes(outs), outs,
                           self.inner.allgather, output_lists, inputs, opts or AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._issue("all_gather", _nbytes([output]), [output],
                           self.inner._allgather_base, output, input, opts or AllgatherOptions())

    _allgather_base = all_gather_single  # the pre-2.13 name

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        # gloo has no coalesced form: one op per tensor, modeled as one transfer (as NCCL does).
        opts = opts or AllgatherOptions()
        return self._issue("all_gather", _nbytes(outputs), outputs, lambda: [
            self.inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single(self, output, input, opts=None):
        return self._issue("reduce_scatter", _nbytes([input]), [output], self.inner._reduce_scatter_base,
                           output, input, opts or ReduceScatterOptions())

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts or ReduceScatterOptions()
        return self._issue("reduce_scatter", _nbytes(inputs), outputs, lambda: [
            self.inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        ins = [t for ts in input_lists for t in ts]
        return self._issue("reduce_scatter", _nbytes(ins), outputs, self.inner.reduce_scatter,
                           outputs, input_lists, opts or ReduceScatterOptions())

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        return self._issue("all_to_all", _nbytes([input]), [output], self.inner.alltoall_base,
                           output, input, output_splits, input_splits, opts or AllToAllOptions())

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._issue("all_to_all", _nbytes(inputs), outputs,
                           self.inner.alltoall, outputs, inputs, opts or AllToAllOptions())

    def broadcast(self, tensors, opts=None):
        return self._issue("broadcast", _nbytes(tensors), tensors,
                           self.inner.broadcast, tensors, opts or BroadcastOptions())

    def barrier(self, opts=None):
        return self._issue("barrier", 0, [], self.inner.barrier, opts or BarrierOptions())

    # gather / scatter / reduce: c10d's C++ does not route these to Python, but the
    # torch.distributed functions (and DTensor's distribute_tensor) call them from Python.
    # nbytes: the full buffer, as for all_gather.
    def gather(self, output_lists, inputs, opts):
        outs = [t for ts in output_lists for t in ts]
        return self._issue("gather", _nbytes(inputs) * self.size(), outs,
                           self.inner.gather, output_lists, inputs, opts)

    def scatter(self, outputs, input_lists, opts):
        return self._issue("scatter", _nbytes(outputs) * self.size(), outputs,
                           self.inner.scatter, outputs, input_lists, opts)

    def reduce(self, tensors, opts):
        return self._issue("reduce", _nbytes(tensors), tensors, self.inner.reduce, tensors, opts)

    def send(self, tensors, dst: int, tag: int = 0):
        return self._issue("send", _nbytes(tensors), tensors, self.inner.send, tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return self._issue("recv", _nbytes(tensors), tensors, self.inner.recv, tensors, src, tag)


def _create(store, rank: int, world_size: int, timeout) -> EmulatedProcessGroup:
    """The creator c10d calls for ``init_process_group("lynx_emulated")`` / ``new_group``."""
    # The link thread needs the GIL to complete a collective. While the main thread runs Python
    # (the generated backward calling ops), the interpreter hands the GIL over only every
    # switch interval (5 ms by default): each completion could land up to 5 ms late, exactly
    # when recompute overlaps the transfer. 0.2 ms keeps that lag small against the windows.
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
    return EmulatedProcessGroup(store, rank, world_size, timeout, current_link())


def register_backend() -> None:
    """Make ``"lynx_emulated"`` a c10d backend name (done on import; idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])


register_backend()
