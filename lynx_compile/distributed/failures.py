"""Name the dead rank when a collective fails.

When a rank dies, the survivors' next collective fails (gloo: connection closed) or times out
(NCCL: the process-group timeout), and the error says nothing about *which* rank is gone. Each
rank runs a :class:`Heartbeat`: a daemon thread that stamps ``lynx/heartbeat/<rank>`` in the
process group's key-value store every ``interval_s``, and marks ``lynx/exit/<rank>`` when it
leaves cleanly. :meth:`Heartbeat.explain` turns a failure into a message listing the ranks
whose heartbeat stopped without a clean exit. The store lives on rank 0's host (torchrun's
rendezvous store, or init_process_group's TCPStore); if rank 0 itself is gone the store is
unreachable, and the message says so.
"""
from __future__ import annotations

import threading
import time

PREFIX = "lynx/heartbeat/"


class Heartbeat:
    """Per-rank liveness stamps in a ``torch.distributed.Store``."""

    def __init__(self, store, rank: int, world_size: int, interval_s: float = 0.5):
        self.store, self.rank, self.world_size, self.interval_s = store, rank, world_size, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lynx-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._stamp()
        self._thread.start()
        return self

    def _stamp(self) -> None:
        self.store.set(f"{PREFIX}{self.rank}", repr(time.time()))

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._stamp()
            except Exception:  # the store is gone (rank 0 died): nothing left to stamp
                return

    def stop(self, status: str = "ok") -> None:
        """Stop stamping and record how this rank left (``ok`` or ``failed: <why>``)."""
        self._stop.set()
        try:
            self.store.set(f"lynx/exit/{self.rank}", status)
        except Exception:  # the store is gone with rank 0
            pass

    def failed_ranks(self) -> dict[int, str]:
        """Other ranks that recorded a failure, with their reason."""
        out = {}
        try:
            for r in range(self.world_size):
                key = f"lynx/exit/{r}"
                if r != self.rank and self.store.check([key]):
                    status = self.store.get(key).decode()
                    if status.startswith("failed"):
                        out[r] = status
        except Exception:
            pass
        return out

    def dead_ranks(self, stale_after_s: float | None = None) -> list[int] | None:
        """Ranks whose heartbeat is older than ``stale_after_s`` (default 4 intervals) and that
        did not exit cleanly; None when the store itself cannot be reached."""
        stale = stale_after_s if stale_after_s is not None else 4 * self.interval_s
        time.sleep(stale)  # let a live rank stamp again before judging it
        dead = []
        try:
            now = time.time()
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                if self.store.check([f"lynx/exit/{r}"]):
                    continue
                last = float(self.store.get(f"{PREFIX}{r}").decode()) if self.store.check([f"{PREFIX}{r}"]) else 0.0
                if now - last > stale:
                    dead.append(r)
        except Exception:
            return None
        return dead

    def explain(self, error: BaseException) -> str:
        """A one-paragraph message for a failed step: which ranks stopped, and the error."""
        dead = self.dead_ranks()
        failed = self.failed_ranks()
        if failed:
            who = "; ".join(f"rank {r} {why}" for r, why in sorted(failed.items()))
        elif dead is None:
            who = "the rendezvous store on rank 0 is unreachable: rank 0 has most likely died"
        elif dead:
            who = f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} stopped (no heartbeat)"
        else:
            who = "every other rank is still alive (the failure is local or a timeout)"
        return (f"lynx: rank {self.rank}: a collective failed: {who}. "
                f"Original error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
