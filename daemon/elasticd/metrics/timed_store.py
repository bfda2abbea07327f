"""``TimedStore``: the daemon's store with every request timed and every error counted.

The daemon puts it around its store (``Metrics.timed_store``); each request's
duration goes to ``Metrics.observe_store`` with the error label of
``store_error_kind``: one value per StoreError kind; each event a watch delivers
is counted by the kind of its key (``watch_event_kind``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from ..store import (KV, CompareFailed, KeyExists, Lease, LeaseNotFound, Store,
                     StoreAuthError, StoreCorrupt, StoreError, StoreUnavailable,
                     WatchCompacted, WatchEvent)

STORE_OPERATIONS = ("get", "list", "put", "create", "compare_and_swap", "delete",
                    "delete_prefix", "grant_lease", "refresh_lease", "revoke_lease",
                    "revision", "watch", "health")
# The error label of a failed store request: one value per StoreError kind.
_STORE_ERRORS = ((StoreUnavailable, "unavailable"), (StoreAuthError, "auth"),
                 (KeyExists, "key_exists"), (CompareFailed, "compare_failed"),
                 (LeaseNotFound, "lease_not_found"), (WatchCompacted, "compacted"),
                 (StoreCorrupt, "corrupt"))


# The folders of the keys the daemons write: a watch event's label (else "other").
WATCHED_KINDS = ("jobs", "rounds", "joins", "workers", "phases", "phasedigests", "nodes",
                 "drain", "faults", "events", "other")


def watch_event_kind(key: str) -> str:
    """The folder of a watched key (/v1/<folder>/...); "phases" for a phase record
    wherever it lies (/v1/phases/<job>/<node>, or /v1/jobs/<job>/phases/<node> where an
    older elasticd writes it)."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] or parts[1] != "v1" or parts[2] not in WATCHED_KINDS:
        return "other"
    if parts[2] == "jobs" and len(parts) == 6 and parts[4] == "phases":
        return "phases"
    return parts[2]


def store_error_kind(exc: BaseException) -> str:
    for cls, kind in _STORE_ERRORS:
        if isinstance(exc, cls):
            return kind
    return "other"


class TimedStore(Store):
    """The same store, each request timed into ``Metrics.observe_store``.

    A watch is counted once per call, and only if it fails (it runs for as
    long as the caller wants); its duration is not observed.
    """

    def __init__(self, inner: Store, metrics):  # metrics.recorder.Metrics
        self.inner = inner
        self.name = inner.name
        self.timeout = inner.timeout
        self._metrics = metrics

    def __getattr__(self, attr):  # anything beyond the Store interface
        return getattr(self.inner, attr)

    def _timed(self, operation: str, fn: Callable, *args):
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except StoreError as exc:
            self._metrics.observe_store(operation, time.perf_counter() - t0, exc)
            raise
        self._metrics.observe_store(operation, time.perf_counter() - t0, None)
        return result

    def get(self, key: str) -> KV | None:
        return self._timed("get", self.inner.get, key)

    def list(self, prefix: str) -> tuple[list[KV], int]:
        return self._timed("list", self.inner.list, prefix)

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self._timed("put", self.inner.put, key, value, lease)

    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self._timed("create", self.inner.create, key, value, lease)

    def compare_and_swap(self, key: str, value: str, prev_revision: int,
                         lease: Lease | None = None) -> int:
        return self._timed("compare_and_swap", self.inner.compare_and_swap, key, value,
                           prev_revision, lease)

    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        return self._timed("delete", self.inner.delete, key, prev_revision)

    def delete_prefix(self, prefix: str) -> int:
        return self._timed("delete_prefix", self.inner.delete_prefix, prefix)

    def grant_lease(self, ttl: int) -> Lease:
        return self._timed("grant_lease", self.inner.grant_lease, ttl)

    def refresh_lease(self, lease: Lease) -> None:
        self._timed("refresh_lease", self.inner.refresh_lease, lease)

    def revoke_lease(self, lease: Lease) -> None:
        self._timed("revoke_lease", self.inner.revoke_lease, lease)

    def revision(self) -> int:
        return self._timed("revision", self.inner.revision)

    def watch(self, prefix: str, start_revision: int,
              stop_event: threading.Event | None = None,
              timeout: float | None = None, deletes_only: bool = False) -> Iterator[WatchEvent]:
        try:
            for ev in self.inner.watch(prefix, start_revision, stop_event, timeout,
                                       deletes_only):
                self._metrics.watch_event(watch_event_kind(ev.key))
                yield ev
        except StoreError as exc:
            self._metrics.store_errors.labels("watch", store_error_kind(exc)).inc()
            raise

    def health(self) -> str:
        return self._timed("health", self.inner.health)

    def close(self) -> None:
        self.inner.close()

