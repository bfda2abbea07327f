"""The store layer: one small interface (``base.Store``), three backends.

    store = open_store("auto", ["http://10.0.0.1:2379", "http://10.0.0.2:2379"],
                       prefix="/elasticd", timeout=2.0)

``kind`` is ``memory``, ``etcd2`` (alias ``v2``), ``etcd3`` (alias ``v3``)
or ``auto``: etcd3 where the server has the v3 gateway (see
:func:`detect_api`), else etcd2.  With ``prefix`` every key the caller
passes is relative to it: ``/v1/nodes/a`` is stored at
``/elasticd/v1/nodes/a`` and read back as ``/v1/nodes/a``.
"""

from __future__ import annotations

import threading
from typing import Iterator

from .base import (
    EVENT_DELETE,
    EVENT_EXPIRE,
    EVENT_PUT,
    KV,
    CompareFailed,
    KeyExists,
    Lease,
    LeaseNotFound,
    Store,
    StoreAuthError,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WatchEvent,
    check_key,
    dir_prefix,
)
from .memory import MemoryStore

__all__ = [
    "EVENT_DELETE", "EVENT_EXPIRE", "EVENT_PUT", "KV", "CompareFailed", "KeyExists",
    "Lease", "LeaseNotFound", "MemoryStore", "Store", "StoreAuthError", "StoreCorrupt",
    "StoreError", "StoreUnavailable", "WatchCompacted", "WatchEvent", "check_key",
    "detect_api", "dir_prefix", "open_store",
]

KINDS = {"memory": "memory", "etcd2": "etcd2", "v2": "etcd2", "etcd3": "etcd3",
         "v3": "etcd3", "auto": "auto"}


def _tls_auth(ca_cert, cert, key, username, password) -> dict:
    return dict(ca_cert=ca_cert, cert=cert, key=key, username=username, password=password)


def detect_api(endpoints: list[str], timeout: float = 2.0, *, ca_cert: str | None = None,
               cert: str | None = None, key: str | None = None,
               username: str | None = None, password: str | None = None) -> str:
    """"v3" if the first endpoint that answers serves etcd's v3 gateway
    (``POST /v3/maintenance/status``), "v2" if it answers without one.

    Raises StoreUnavailable when no endpoint answers (never guesses), and
    StoreAuthError for TLS or credential failures."""
    from .etcd3 import Etcd3Store

    probe = Etcd3Store(endpoints, timeout=timeout,
                       **_tls_auth(ca_cert, cert, key, username, password))
    try:
        probe.status()
        return "v3"
    except StoreCorrupt:
        return "v2"
    finally:
        probe.close()


def open_store(kind: str, endpoints: list[str] | tuple = (), *, prefix: str = "",
               timeout: float = 2.0, ca_cert: str | None = None, cert: str | None = None,
               key: str | None = None, username: str | None = None,
               password: str | None = None, lease_transport: str = "gateway",
               watch_transport: str = "gateway") -> Store:
    """The store ``kind`` names (see the module doc).  Makes no request
    except for ``auto``, which asks the server which API it has.
    ``lease_transport`` and ``watch_transport`` (etcd3 only): how lease refreshes and
    watches reach etcd, ``gateway`` or ``grpc`` (etcd3.py, lease_stream.py,
    watch_stream.py)."""
    if kind not in KINDS:
        raise ValueError(f"store kind must be one of {sorted(KINDS)}, not {kind!r}")
    kind = KINDS[kind]
    opts = _tls_auth(ca_cert, cert, key, username, password)
    if kind != "memory" and not endpoints:
        raise ValueError(f"the {kind} store needs at least one etcd endpoint")
    if kind == "auto":
        kind = "etcd3" if detect_api(list(endpoints), timeout, **opts) == "v3" else "etcd2"
    store: Store
    if kind == "memory":
        store = MemoryStore(timeout=timeout)
    elif kind == "etcd2":
        from .etcd2 import Etcd2Store
        store = Etcd2Store(list(endpoints), timeout=timeout, **opts)
    else:
        from .etcd3 import Etcd3Store
        store = Etcd3Store(list(endpoints), timeout=timeout, lease_transport=lease_transport,
                           watch_transport=watch_transport, **opts)
    if prefix and prefix != "/":
        store = PrefixedStore(store, prefix)
    return store


class PrefixedStore(Store):
    """Keys relative to ``prefix`` on the store underneath."""

    def __init__(self, inner: Store, prefix: str):
        self.inner = inner
        self.prefix = check_key(prefix)
        self.name = inner.name
        self.timeout = inner.timeout

    def _in(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _dir(self, prefix: str) -> str:
        return self.prefix + dir_prefix(prefix)

    def _out(self, key: str) -> str:
        return key[len(self.prefix):]

    def get(self, key: str) -> KV | None:
        kv = self.inner.get(self._in(key))
        return None if kv is None else kv._replace(key=key)

    def list(self, prefix: str) -> tuple[list[KV], int]:
        kvs, rev = self.inner.list(self._dir(prefix))
        return [kv._replace(key=self._out(kv.key)) for kv in kvs], rev

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self.inner.put(self._in(key), value, lease)

    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self.inner.create(self._in(key), value, lease)

    def compare_and_swap(self, key: str, value: str, prev_revision: int,
                         lease: Lease | None = None) -> int:
        return self.inner.compare_and_swap(self._in(key), value, prev_revision, lease)

    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        return self.inner.delete(self._in(key), prev_revision)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(self._dir(prefix))

    def grant_lease(self, ttl: int) -> Lease:
        return self.inner.grant_lease(ttl)

    def refresh_lease(self, lease: Lease) -> None:
        self.inner.refresh_lease(lease)

    def revoke_lease(self, lease: Lease) -> None:
        self.inner.revoke_lease(lease)

    def revision(self) -> int:
        return self.inner.revision()

    def watch(self, prefix: str, start_revision: int,
              stop_event: threading.Event | None = None,
              timeout: float | None = None, deletes_only: bool = False) -> Iterator[WatchEvent]:
        for ev in self.inner.watch(self._dir(prefix), start_revision, stop_event, timeout,
                                   deletes_only):
            yield ev._replace(key=self._out(ev.key))

    def health(self) -> str:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()
