"""What the ranks agree on through the job's store, one restart iteration at a time.

All keys of iteration N live under ``it<N>/`` of the job's in-process prefix
(``<job secret>/elasticd/inprocess/r<round>a<process restart count>/``, see
``elasticd.jobstore_env``), so an iteration never
reads another's leftovers and a process restart of the whole group starts
clean. Keys:

    start/n   ranks that reached the iteration's start barrier (counter)
    start/go  set by the last of them: everyone may build the process group
    fault     the first fault reported in this iteration (later ones lose)
    done/n    ranks whose function returned (counter)
    verdict   ``ok`` (every rank returned) or ``restart`` (a fault came
              first), set once by compare-and-set: every rank reads the same

Waiting is polling with ``check()``, which never blocks, so a waiting rank
keeps beating (the daemon must not take it for hung) and torch's store does
not log a timeout warning per wait.

The store is duck-typed (``add``, ``set``, ``get``, ``check``, ``compare_set``
as ``torch.distributed.Store`` has them), so tests can use a dict.
"""
from __future__ import annotations

import time
from typing import Callable


class BarrierTimeout(RuntimeError):
    """Not every rank arrived in time: some rank is gone and was not replaced."""


class IterationStore:
    def __init__(self, store, rank: int, world_size: int, poll: float,
                 beat: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._poll = poll
        self._beat = beat
        self._clock = clock
        self._sleep = sleep

    def barrier(self, name: str, timeout: float) -> float:
        """Wait until all ``world_size`` ranks called ``barrier(name)``; returns seconds waited."""
        t0 = self._clock()
        if self.store.add(f"{name}/n", 1) == self.world_size:
            self.store.set(f"{name}/go", "1")
        self._wait_for(f"{name}/go", timeout,
                       lambda: f"{self.store.add(f'{name}/n', 0)} of {self.world_size} ranks "
                               f"reached barrier {name!r} within {timeout:g}s")
        return self._clock() - t0

    def report_fault(self, reason: str) -> str:
        """Record a fault of this iteration; returns the one that was first."""
        first = as_text(self.store.compare_set("fault", "", reason))
        self.store.compare_set("verdict", "", "restart")
        return first

    def fault(self) -> str | None:
        """The iteration's first fault, or None (one non-blocking look)."""
        if not self.store.check(["fault"]):
            return None
        return as_text(self.store.get("fault"))

    def finish(self, timeout: float) -> str | None:
        """This rank's function returned: None if every rank's did, else the fault."""
        if self.store.add("done/n", 1) == self.world_size:
            self.store.compare_set("verdict", "", "ok")
        self._wait_for("verdict", timeout,
                       lambda: f"{self.store.add('done/n', 0)} of {self.world_size} ranks "
                               f"finished within {timeout:g}s and none reported a fault")
        if as_text(self.store.get("verdict")) == "ok":
            return None
        return self.fault() or "restart requested"

    def _wait_for(self, key: str, timeout: float, why: Callable[[], str]) -> None:
        deadline = self._clock() + timeout
        while not self.store.check([key]):
            if self._clock() >= deadline:
                raise BarrierTimeout(why())
            self._beat()
            self._sleep(self._poll)


def as_text(value) -> str:
    """A store value as text (the store gives bytes; a bad byte never raises)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
