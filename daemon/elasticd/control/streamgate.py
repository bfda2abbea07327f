"""Admission for long-lived control calls (logs -f, events, wait).

The gRPC server has one thread pool; a long-lived call holds a thread for as
long as it lasts. The pool is sized control.rpc_threads + limits.streams_total,
and this gate admits at most limits.streams_total long-lived calls (at most
limits.streams_per_user of one uid), so short calls (list, status, submit)
always find a thread. A call over a cap is refused at once with
RESOURCE_EXHAUSTED naming the cap, never queued.
"""
from __future__ import annotations

import contextlib
import threading

from .. import errors


class StreamGate:
    def __init__(self, total: int, per_user: int):
        self._total = total
        self._per_user = per_user
        self._lock = threading.Lock()
        self._by_uid: dict[int, int] = {}
        self._open = 0

    @property
    def open(self) -> int:
        return self._open

    @contextlib.contextmanager
    def slot(self, uid: int, what: str):
        """Hold one of the stream slots for ``uid`` while the block runs."""
        with self._lock:
            mine = self._by_uid.get(uid, 0)
            if mine >= self._per_user:
                raise errors.ResourceExhausted(
                    f"uid {uid} has {mine} long-lived calls open (limits.streams_per_user "
                    f"{self._per_user}); end some (logs -f, events -f, wait) before this {what}")
            if self._open >= self._total:
                raise errors.ResourceExhausted(
                    f"the daemon serves {self._open} long-lived calls already "
                    f"(limits.streams_total {self._total}); try this {what} again later")
            self._by_uid[uid] = mine + 1
            self._open += 1
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                left = self._by_uid[uid] - 1
                if left:
                    self._by_uid[uid] = left
                else:
                    del self._by_uid[uid]
