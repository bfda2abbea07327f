"""Admission for control calls: each uid holds a bounded number at once, of every kind.

The gRPC server has one thread pool (control/fairpool.py serves callers in
turn); a call holds a thread for as long as it runs. Two gates, each a count
per uid, refuse a call over its cap at once with RESOURCE_EXHAUSTED naming
the cap, never queue it:

* ``StreamGate``, long-lived calls (logs -f, events, wait): at most
  limits.streams_per_user of one uid and limits.streams_total of all. The
  pool has control.rpc_threads threads more than that, so short calls
  always find one.
* ``CallGate``, short calls (list, status, submit, cancel, nodes, ...): at
  most limits.calls_per_user of one uid, fewer than control.rpc_threads, so
  no one uid's calls hold every thread short calls have.
"""
from __future__ import annotations

import contextlib
import threading

from .. import errors


class _UidGate:
    """A count of calls in progress per uid and in all, checked against caps."""

    def __init__(self, per_user: int, total: int | None = None):
        self._total = total
        self._per_user = per_user
        self._lock = threading.Lock()
        self._by_uid: dict[int, int] = {}
        self._open = 0

    @property
    def open(self) -> int:
        return self._open

    def _refusal(self, uid: int, mine: int, what: str) -> str:
        raise NotImplementedError

    def _total_refusal(self, what: str) -> str:
        raise NotImplementedError

    @contextlib.contextmanager
    def slot(self, uid: int, what: str):
        """Hold one of ``uid``'s slots while the block runs."""
        with self._lock:
            mine = self._by_uid.get(uid, 0)
            if mine >= self._per_user:
                raise errors.ResourceExhausted(self._refusal(uid, mine, what))
            if self._total is not None and self._open >= self._total:
                raise errors.ResourceExhausted(self._total_refusal(what))
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


class StreamGate(_UidGate):
    def __init__(self, total: int, per_user: int):
        super().__init__(per_user, total)

    def _refusal(self, uid: int, mine: int, what: str) -> str:
        return (f"uid {uid} has {mine} long-lived calls open (limits.streams_per_user "
                f"{self._per_user}); end some (logs -f, events -f, wait) before this {what}")

    def _total_refusal(self, what: str) -> str:
        return (f"the daemon serves {self._open} long-lived calls already "
                f"(limits.streams_total {self._total}); try this {what} again later")


class CallGate(_UidGate):
    def __init__(self, per_user: int):
        super().__init__(per_user)

    def _refusal(self, uid: int, mine: int, what: str) -> str:
        return (f"uid {uid} has {mine} calls in progress (limits.calls_per_user "
                f"{self._per_user}); try this {what} again once one has ended")
