"""What the ranks agree on through the job's store, one restart iteration at a time.

All keys of iteration N live under ``it<N>/`` of the job's in-process prefix
(``<job store id>/elasticd/inprocess/r<round>a<process restart count>/``,
see ``elasticd.jobstore.address``), so an iteration never reads another's
leftovers and a process restart of the whole group starts clean. Keys:

    entered        written by every rank entering the iteration (a
                   replacement rank finds the newest iteration by them)
    start/r<k>     rank k reached the iteration's start barrier
    fault/<slot>   a fault report; a reporter takes the first free slot by
                   compare-and-set, so the lowest genuine slot is the first fault
    done/r<k>      rank k's function returned

Every value is a sealed record (``records.RecordSealer``): its MAC covers
the full key name and the payload, under a key the store never sees. The
store is open to anyone who can connect (torch's TCPStore has no
authentication), so a record that does not verify is ignored, never acted
on: a planted fault does not restart anything, a planted marker does not
open a barrier, a genuine record copied under another key (the next
iteration's, another rank's) does not verify either. No counters: a value
anyone can overwrite with text makes TCPStore's ``add`` drop the caller's
connection, and a count anyone can bump is no count.

The verdict of an iteration needs no key of its own: it is ``ok`` when every
rank's done marker is genuine and no genuine fault is there, ``restart``
when a genuine fault is. A rank reports a fault (from its monitor) only
before writing its done marker, so whoever sees every done marker sees
every fault reported in that iteration: all ranks reach the same verdict.
Someone deleting or overwriting keys can only make a wait time out, which
ends in the normal fallback (a process restart), never in a wrong verdict.

Waiting is polling with ``check()``, which never blocks, so a waiting rank
keeps beating (the daemon must not take it for hung) and torch's store does
not log a timeout warning per wait. A barrier poll checks the world's
markers in one request (O(world size) on the store per poll).

The store is duck-typed (``set``, ``get``, ``check``, ``compare_set``,
``multi_get`` as ``torch.distributed.Store`` has them), so tests can use a dict.
"""
from __future__ import annotations

import time
from typing import Callable

from .records import RecordSealer

FAULT_SLOTS_SPARE = 64   # fault slots beyond two per rank, for slots someone else filled


class BarrierTimeout(RuntimeError):
    """Not every rank arrived in time: some rank is gone and was not replaced."""


class IterationStore:
    def __init__(self, store, rank: int, world_size: int, poll: float,
                 beat: Callable[[], None], sealer: RecordSealer,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.sealer = sealer
        self._poll = poll
        self._beat = beat
        self._clock = clock
        self._sleep = sleep
        self._fault_slots = 2 * world_size + FAULT_SLOTS_SPARE
        self._first_unread = 0     # fault slots below it hold records that did not verify

    # ---------------------------------------------------------------- markers

    def enter(self) -> None:
        """Mark the iteration as entered (``latest_iteration`` finds it)."""
        self._put("entered", b"entered")

    def entered(self) -> bool:
        return self._genuine("entered", b"entered")

    def barrier(self, name: str, timeout: float) -> float:
        """Wait until all ``world_size`` ranks called ``barrier(name)``; returns seconds waited."""
        t0 = self._clock()
        self._put(f"{name}/r{self.rank}", name.encode())
        self._wait_for(lambda: self.opened(name), timeout,
                       lambda: f"{self._present(name)} of {self.world_size} ranks reached "
                               f"barrier {name!r} within {timeout:g}s")
        return self._clock() - t0

    def opened(self, name: str) -> bool:
        """Every rank's ``name`` marker is there and genuine (one non-blocking look)."""
        keys = [f"{name}/r{k}" for k in range(self.world_size)]
        if not self.store.check(keys):
            return False
        values = self.store.multi_get(keys)
        return all(self._open(k, v, f"{name} marker") == name.encode()
                   for k, v in zip(keys, values))

    # ---------------------------------------------------------------- faults

    def report_fault(self, reason: str) -> str:
        """Record a fault of this iteration; returns the first genuine one (maybe this)."""
        payload = reason.encode("utf-8", "replace")[:2000]
        for slot in range(self._fault_slots):
            key = f"fault/{slot}"
            current = self.store.compare_set(key, "", self.sealer.seal(key, payload))
            first = self._open(key, current, "fault")
            if first is not None:
                return first.decode("utf-8", "replace")
        return reason  # every slot filled by someone else: the others will time out

    def fault(self) -> str | None:
        """The iteration's first genuine fault, or None (non-blocking looks)."""
        for slot in range(self._first_unread, self._fault_slots):
            key = f"fault/{slot}"
            if not self.store.check([key]):
                return None
            text = self._open(key, self.store.get(key), "fault")
            if text is not None:
                return text.decode("utf-8", "replace")
            # Not ours: never becomes genuine (reporters only fill empty slots).
            self._first_unread = slot + 1
        return None

    # ---------------------------------------------------------------- the verdict

    def finish(self, timeout: float) -> str | None:
        """This rank's function returned: None if every rank's did, else the fault."""
        self._put(f"done/r{self.rank}", b"done")
        verdict: list[str | None] = []

        def decided() -> bool:
            if self.opened("done"):   # every fault came before its reporter's done marker
                verdict.append(self.fault())
                return True
            fault = self.fault()
            if fault is not None:
                verdict.append(fault)
            return fault is not None

        self._wait_for(decided, timeout,
                       lambda: f"{self._present('done')} of {self.world_size} ranks "
                               f"finished within {timeout:g}s and none reported a fault")
        return verdict[0]

    # ---------------------------------------------------------------- helpers

    def _put(self, key: str, payload: bytes) -> None:
        self.store.set(key, self.sealer.seal(key, payload))

    def _genuine(self, key: str, payload: bytes) -> bool:
        if not self.store.check([key]):
            return False
        return self._open(key, self.store.get(key), key) == payload

    def _open(self, key: str, value, kind: str) -> bytes | None:
        return self.sealer.open(key, value, kind)

    def _present(self, name: str) -> int:
        """How many ranks' ``name`` markers are there (for a timeout's message)."""
        return sum(1 for k in range(self.world_size) if self.store.check([f"{name}/r{k}"]))

    def _wait_for(self, ready: Callable[[], bool], timeout: float,
                  why: Callable[[], str]) -> None:
        deadline = self._clock() + timeout
        while not ready():
            if self._clock() >= deadline:
                raise BarrierTimeout(why())
            self._beat()
            self._sleep(self._poll)


def latest_iteration(store_of: Callable[[int], object], sealer: RecordSealer, rank: int,
                     world_size: int, limit: int) -> int:
    """The newest iteration (up to ``limit``) some rank entered; 0 if none.

    ``store_of(n)`` is iteration n's store. Every iteration is looked at, not
    only until the first gap: a deleted marker must not send a replacement
    back to an old iteration.
    """
    newest = 0
    for n in range(limit + 1):
        it = IterationStore(store_of(n), rank, world_size, 0.0, lambda: None,
                            sealer.within(f"it{n}/"))
        if it.entered():
            newest = n
    return newest
