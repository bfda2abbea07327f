"""The agent's wait between two looks at a running job's workers.

``agent.monitor_interval`` at most, cut short the moment a worker ends (a pidfd of
it, or its template's channel, becomes readable: workers/group.py ``exit_fds``) or
the agent is poked (cancel, shutdown: a byte on a pipe this owns). A rank SIGKILLed
is then seen within a millisecond instead of half an interval on average: on a job
across nodes the node that sees it first opens the next round.
"""
from __future__ import annotations

import os
import select
import threading


class MonitorWait:
    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._lock = threading.Lock()    # a poke never writes into an fd closed (reused)
        self._closed = False

    def poke(self) -> None:
        """Cut the wait in progress (or the next one) short. Any thread."""
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._w, b"\0")
            except OSError:    # full: a poke is pending anyway
                pass

    def wait(self, fds: list[int], timeout: float) -> None:
        """Until ``timeout``, one of ``fds`` is readable, or a poke. The agent's thread."""
        try:
            select.select([self._r, *fds], [], [], timeout)
        except (OSError, ValueError):   # an fd closed meanwhile: a plain wait this time
            select.select([self._r], [], [], timeout)
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._r)
            os.close(self._w)
