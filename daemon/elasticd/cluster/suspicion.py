"""Whether this node is suspect: its workers failed in several different jobs lately.

One job failing over and over says little about the node; ranks of several
different jobs failing here within a while says the node may be bad (a
flaky GPU, memory, the network card). The daemon outlives every job, so it
remembers: ``SuspectTracker`` listens to this node's job events and keeps
the times of its workers' failures (``worker_exit`` events) by job, read back
from the registry's stored events when the daemon starts (``remember``), so a
restart does not make a bad node look clean. ``judge()``
decides without I/O: suspect when at least ``daemon.suspect_jobs`` different
jobs had a worker fail here within ``daemon.suspect_window`` seconds.

A suspect node is preferred last: the dispatcher adopts a cluster job's open
round only once it has been open ``daemon.suspect_adopt_delay`` seconds, so
healthy nodes take it first; `elasticctl nodes` says why it is suspect. It
stops being suspect as the failures age out of the window.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ..jobs.jobevent import JobEvent

MAX_REMEMBERED = 1000   # failures kept; older ones fall out first


@dataclass(frozen=True)
class Suspicion:
    suspect: bool
    jobs: tuple = ()        # the jobs whose workers failed here within the window
    reason: str = ""        # one line; "" when not suspect


def judge(failures, now: float, window: float, jobs_needed: int) -> Suspicion:
    """``failures``: (time, job id) of this node's worker failures."""
    if jobs_needed <= 0:
        return Suspicion(False)
    recent = sorted({job for t, job in failures if now - window <= t <= now})
    if len(recent) < jobs_needed:
        return Suspicion(False, tuple(recent))
    return Suspicion(True, tuple(recent),
                     f"workers of {len(recent)} different jobs failed here in the last "
                     f"{window:g}s ({', '.join(recent[:5])}{', ...' if len(recent) > 5 else ''}; "
                     f"daemon.suspect_jobs {jobs_needed})")


class SuspectTracker:
    def __init__(self, node_id: str, window: float, jobs_needed: int, clock=time.time):
        self._node_id = node_id
        self._window = window
        self._jobs_needed = jobs_needed
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: deque = deque(maxlen=MAX_REMEMBERED)

    def on_event(self, ev: JobEvent) -> None:
        """A registry listener (called under the registry's lock: no I/O here)."""
        if ev.kind != "worker_exit" or ev.node_id != self._node_id:
            return
        with self._lock:
            self._failures.append((float(ev.time), ev.job_id))

    def remember(self, events) -> None:
        """Failures from before this daemon started: the registry's stored
        ``worker_exit`` events of this node (JobRegistry.recent_events)."""
        for ev in events:
            self.on_event(ev)

    def verdict(self) -> Suspicion:
        with self._lock:
            failures = list(self._failures)
        return judge(failures, self._clock(), self._window, self._jobs_needed)
