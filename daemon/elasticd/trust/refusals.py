"""Counting and logging the records refused from etcd: once per key, never unbounded.

Each watch (jobs, nodes, drain marks, events) hands every record it refuses
to one ``Refusals``: it counts it by kind and reason (the daemon passes
``count``: ``elasticd_etcd_records_rejected_total{kind,reason}``) and logs it
the first time its key is refused for that reason (never the value: it may
be anyone's; the key quoted and cut to 200 characters). At most ``remember`` keys are
remembered; past that, a line a minute says how many more were refused.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable

from .sealed import Kind, Reason

log = logging.getLogger("elasticd.trust")

REMEMBER = 4096        # keys whose refusal was logged, before the log goes quiet
QUIET_LOG_EVERY = 60.0  # seconds between the lines that count the refusals not logged


class Refusals:
    def __init__(self, where: str = "", count: Callable[[str, str], None] | None = None,
                 remember: int = REMEMBER, clock=time.monotonic):
        self._where = where            # "node=n1" for the log lines
        self._count = count
        self._remember = remember
        self._clock = clock
        self._lock = threading.Lock()
        self._logged: set[tuple[str, Reason]] = set()
        self._unlogged = 0
        self._quiet_since = 0.0
        self.counts: Counter = Counter()   # (kind, reason) -> records refused

    def refused(self, kind: Kind, key: str, reason: Reason, detail: str,
                trace: bool = False) -> None:
        """One record refused: counted always, logged the first time for its key."""
        name = key[:200]
        say, quiet = False, 0
        with self._lock:
            self.counts[(kind.value, reason.value)] += 1
            if (name, reason) in self._logged:
                pass
            elif len(self._logged) < self._remember:
                self._logged.add((name, reason))
                say = True
            else:
                self._unlogged += 1
                now = self._clock()
                if now - self._quiet_since >= QUIET_LOG_EVERY:
                    quiet, self._unlogged, self._quiet_since = self._unlogged, 0, now
        if self._count is not None:
            try:
                self._count(kind.value, reason.value)
            except Exception:  # a metric must never turn a refusal into a watch's error
                log.exception("%s: counting a refused record failed", self._where)
        if say:
            log.warning("%s: refused the %s record at %r in etcd (%s): %s; it is never acted "
                        "on (logged once per key)", self._where, kind.value, name,
                        reason.value, " ".join(detail[:300].split()), exc_info=trace)
        elif quiet:
            log.warning("%s: refused %d more records in etcd (not logged one by one; counted "
                        "in elasticd_etcd_records_rejected_total)", self._where, quiet)
