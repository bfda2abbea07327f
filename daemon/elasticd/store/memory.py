"""In-memory store: one process, real TTL expiry, revisions and watches.

Used by ``elasticd --standalone`` and by decision tests.  It behaves like
etcd3: one revision counter for the whole store, ``delete_prefix`` and a
lease's end are one revision each, and watch history is bounded (older
start revisions raise WatchCompacted).  Unlike etcd3 it reports a lease
expiry as ``expire``, as etcd2 does.

Time comes from ``clock`` (``time.monotonic`` by default), so tests can
drive expiry with a fake clock and :meth:`MemoryStore.expire`.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from .base import (
    EVENT_DELETE, EVENT_EXPIRE, EVENT_PUT, KV, CompareFailed, KeyExists, Lease, LeaseNotFound,
    Store, StoreUnavailable, WatchCompacted, WatchEvent, check_key, dir_prefix,
)

POLL = 0.25  # how often a waiting watch looks at stop_event and expiry


@dataclass
class _Entry:
    value: str
    revision: int
    lease_id: int


@dataclass
class _MemLease:
    ttl: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class MemoryStore(Store):
    name = "memory"

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        history: int = 10000,
        timeout: float = 5.0,
    ):
        self.timeout = timeout
        self._clock = clock
        self._history_max = history
        self._cond = threading.Condition()
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _MemLease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._events: list[WatchEvent] = []
        self._revision = 0
        self._compacted = 0  # events at or below this revision are gone
        self._closed = False

    # -- internals; callers hold self._cond ------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable("memory store is closed")

    def _bump(self) -> int:
        self._revision += 1
        return self._revision

    def _record(self, events: list[WatchEvent]) -> None:
        self._events.extend(events)
        if len(self._events) > 2 * self._history_max:
            drop = len(self._events) - self._history_max
            self._compacted = self._events[drop - 1].revision
            # keep whole revisions so a watch never sees half of one
            while drop < len(self._events) and self._events[drop].revision == self._compacted:
                drop += 1
            del self._events[:drop]
        self._cond.notify_all()

    def _set(self, key: str, value: str, lease: Lease | None) -> int:
        lease_id = 0
        if lease is not None:
            held = self._leases.get(lease.id)
            if held is None:
                raise LeaseNotFound(f"lease {lease.id:x} has ended")
            held.keys.add(key)
            lease_id = lease.id
        old = self._data.get(key)
        if old is not None and old.lease_id and old.lease_id != lease_id:
            self._leases.get(old.lease_id, _MemLease(0, 0)).keys.discard(key)
        rev = self._bump()
        self._data[key] = _Entry(value, rev, lease_id)
        self._record([WatchEvent(EVENT_PUT, key, value, rev)])
        return rev

    def _remove(self, keys: list[str], kind: str) -> None:
        keys = [k for k in keys if k in self._data]
        if not keys:
            return
        rev = self._bump()
        events = []
        for key in sorted(keys):
            entry = self._data.pop(key)
            if entry.lease_id in self._leases:
                self._leases[entry.lease_id].keys.discard(key)
            events.append(WatchEvent(kind, key, None, rev))
        self._record(events)

    def _expire_locked(self) -> None:
        now = self._clock()
        for lease_id, lease in list(self._leases.items()):
            if now >= lease.deadline:
                del self._leases[lease_id]
                self._remove(list(lease.keys), EVENT_EXPIRE)

    def expire(self) -> None:
        """End every lease whose deadline has passed (done before each call)."""
        with self._cond:
            self._expire_locked()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the lock, refuse a closed store, end expired leases first:
        every call sees expired keys gone."""
        with self._cond:
            self._check_open()
            self._expire_locked()
            yield

    # -- the Store interface ---------------------------------------------

    def get(self, key: str) -> KV | None:
        check_key(key)
        with self._locked():
            e = self._data.get(key)
            return None if e is None else KV(key, e.value, e.revision, e.lease_id)

    def list(self, prefix: str) -> tuple[list[KV], int]:
        prefix = dir_prefix(prefix)
        with self._locked():
            kvs = [
                KV(k, e.value, e.revision, e.lease_id)
                for k, e in self._data.items()
                if k.startswith(prefix)
            ]
            return sorted(kvs), self._revision

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        check_key(key)
        with self._locked():
            return self._set(key, str(value), lease)

    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        check_key(key)
        with self._locked():
            if key in self._data:
                raise KeyExists(f"{key} already exists")
            return self._set(key, str(value), lease)

    def compare_and_swap(
        self, key: str, value: str, prev_revision: int, lease: Lease | None = None
    ) -> int:
        check_key(key)
        with self._locked():
            e = self._data.get(key)
            current = 0 if e is None else e.revision
            if current != prev_revision:
                raise CompareFailed(f"{key} is at revision {current}, not {prev_revision}")
            return self._set(key, str(value), lease)

    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        check_key(key)
        with self._locked():
            e = self._data.get(key)
            if prev_revision is not None and (e is None or e.revision != prev_revision):
                current = 0 if e is None else e.revision
                raise CompareFailed(f"{key} is at revision {current}, not {prev_revision}")
            self._remove([key], EVENT_DELETE)
            return e is not None

    def delete_prefix(self, prefix: str) -> int:
        prefix = dir_prefix(prefix)
        with self._locked():
            keys = [k for k in self._data if k.startswith(prefix)]
            self._remove(keys, EVENT_DELETE)
            return len(keys)

    def grant_lease(self, ttl: int) -> Lease:
        ttl = max(1, int(ttl))
        with self._locked():
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _MemLease(ttl, self._clock() + ttl)
            return Lease(lease_id, ttl)

    def refresh_lease(self, lease: Lease) -> None:
        with self._locked():
            held = self._leases.get(lease.id)
            if held is None:
                raise LeaseNotFound(f"lease {lease.id:x} has ended")
            held.deadline = self._clock() + held.ttl

    def revoke_lease(self, lease: Lease) -> None:
        with self._locked():
            held = self._leases.pop(lease.id, None)
            if held is not None:
                self._remove(list(held.keys), EVENT_DELETE)

    def revision(self) -> int:
        with self._locked():
            return self._revision

    def watch(
        self,
        prefix: str,
        start_revision: int,
        stop_event: threading.Event | None = None,
        timeout: float | None = None,
        deletes_only: bool = False,
    ) -> Iterator[WatchEvent]:
        prefix = dir_prefix(prefix)
        deadline = None if timeout is None else time.monotonic() + timeout
        after = start_revision
        while True:
            with self._locked():
                if after < self._compacted:
                    raise WatchCompacted(
                        f"memory store history before revision {self._compacted} is gone",
                        self._compacted,
                    )
                i = bisect.bisect_right(self._events, after, key=lambda e: e.revision)
                batch = [e for e in self._events[i:] if e.key.startswith(prefix)
                         and not (deletes_only and e.type == EVENT_PUT)]
                if self._events:
                    after = max(after, self._events[-1].revision)
                if not batch:
                    if (stop_event is not None and stop_event.is_set()) or (
                        deadline is not None and time.monotonic() >= deadline
                    ):
                        return
                    wait = POLL if deadline is None else max(0.0, min(POLL, deadline - time.monotonic()))
                    self._cond.wait(wait)
                    continue
            yield from batch
            if (stop_event is not None and stop_event.is_set()) or (
                deadline is not None and time.monotonic() >= deadline
            ):
                return

    def health(self) -> str:
        with self._locked():
            return f"memory store: ok, {len(self._data)} keys at revision {self._revision}"

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
