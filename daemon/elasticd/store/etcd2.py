"""etcd's v2 API through python-etcd (what torch's etcd rendezvous uses).

How v2 differs from the Store contract, and what this module does:

* Leases do not exist in v2.  A lease here is client-side: keys put with
  it carry its TTL, ``refresh_lease`` refreshes each key's TTL
  (``refresh=true``, which notifies no watcher) and ``revoke_lease``
  deletes them, each only while the key still holds the value this object
  wrote.  The lease lives in this store object only; its id means
  nothing to other clients, and ``KV.lease_id`` is set only for keys this
  object leased.  The lease counts as ended once its TTL has passed since
  the last successful refresh (timed from before the request, so never
  later than the server's expiry) or when all of its keys are gone.
* Revisions are v2 indexes (``modifiedIndex``; a list's revision is the
  ``X-Etcd-Index`` header).  Every change has its own index, so
  ``delete_prefix`` is key by key and not atomic.
* Prefixes are directories: a key cannot also be a prefix of other keys,
  and empty directories are pruned after ``delete_prefix``.
* The server keeps only the last 1000 events of the whole store: a watch
  that falls further behind (even on a quiet prefix of a busy store)
  raises WatchCompacted, and the caller re-lists.
* An expired key is reported as ``expire`` (etcd3 can only say delete).

Failover: one python-etcd client per endpoint, without its own reconnect
logic (``allow_reconnect`` asks the server for its member list in the
constructor, a blocking call that fails when etcd is down, and swaps in
the advertised URLs).  urllib3's own retries are off, so a timeout is one
timeout.  A call moves to the next endpoint only when it could not
connect; after a sent-but-unanswered request it raises StoreUnavailable.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterator

import etcd
import urllib3
from urllib3.exceptions import ConnectTimeoutError, SSLError

from .base import (
    EVENT_DELETE, EVENT_EXPIRE, EVENT_PUT, KV, CompareFailed, KeyExists, Lease, LeaseNotFound,
    Store, StoreAuthError, StoreCorrupt, StoreError, StoreUnavailable, WatchCompacted, WatchEvent,
    check_key, dir_prefix, tls_error,
)

# python-etcd logs every failed request at ERROR before raising; the error
# reaches our caller as a StoreError carrying the same text, so an outage
# would print each failure twice.
logging.getLogger("etcd.client").setLevel(logging.CRITICAL)

POLL = 0.5  # a watch's long-poll length: how soon it sees stop_event
_DELETES = ("delete", "compareAndDelete")
# python-etcd errors a call expects (see Etcd2Store._do).
_MISSING = (etcd.EtcdKeyNotFound, etcd.EtcdNotDir)
_CHANGED = (etcd.EtcdKeyNotFound, etcd.EtcdCompareFailed)
_WRITE_ERRORS = _CHANGED + (etcd.EtcdAlreadyExist, etcd.EtcdNotFile, etcd.EtcdNotDir)
_PRUNE = (etcd.EtcdDirNotEmpty, etcd.EtcdKeyNotFound, etcd.EtcdRootReadOnly, etcd.EtcdNotDir)


@dataclass
class _V2Lease:
    ttl: int
    deadline: float
    keys: dict[str, str] = field(default_factory=dict)  # key -> value we wrote


def _owned(value: str) -> dict:
    """The condition that a key still holds what we wrote.  By value, not
    index: a refresh changes the index, and one that timed out may still
    have landed.  v2 refuses an empty prevValue: then no condition."""
    return {"prevValue": value} if value else {}


def _q(key: str) -> str:
    return urllib.parse.quote(key, safe="/")


class Etcd2Store(Store):
    name = "etcd2"

    def __init__(
        self,
        endpoints: list[str],
        timeout: float = 5.0,
        ca_cert: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        username: str | None = None,
        password: str | None = None,
        watch_liveness: float = 5.0,
    ):
        if not endpoints:
            raise ValueError("etcd2 store needs at least one endpoint")
        scheme = "https://" if ca_cert or cert else "http://"
        self.endpoints = [(e if "://" in e else scheme + e).rstrip("/") for e in endpoints]
        self.timeout = timeout
        # A watch that hears nothing for this long checks that etcd answers:
        # a long-poll that times out cannot tell a quiet prefix from a hung etcd.
        self.watch_liveness = watch_liveness
        self._clients = [self._client(u, ca_cert, cert, key, username, password)
                         for u in self.endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._leases: dict[int, _V2Lease] = {}
        self._key_lease: dict[str, int] = {}

    def _client(self, url: str, ca_cert, cert, key, username, password) -> etcd.Client:
        u = urllib.parse.urlsplit(url)
        client = etcd.Client(
            host=u.hostname or "127.0.0.1", port=u.port or 2379, protocol=u.scheme or "http",
            read_timeout=self.timeout, allow_reconnect=False, allow_redirect=False,
            ca_cert=ca_cert, cert=(cert, key) if cert and key else cert,
            username=username, password=password, per_host_pool_size=8)
        # The same pool settings, with urllib3's retries off: one attempt,
        # one timeout (its default retries turn a timeout into four).
        client.http = urllib3.PoolManager(num_pools=4, retries=False,
                                          **client.http.connection_pool_kw)
        return client

    # -- calls ---------------------------------------------------------------

    def _do(self, op: str, *args: Any, expect: tuple = (), **kw: Any) -> Any:
        """Run one python-etcd call, failing over while connects fail.

        python-etcd errors in ``expect`` reach the caller as they are; all
        others become StoreErrors."""
        deadline = time.monotonic() + self.timeout
        start, n = self._current, len(self._clients)
        failures = []
        for i in range(n):
            index = (start + i) % n
            url = self.endpoints[index]
            try:
                result = getattr(self._clients[index], op)(*args, **kw)
                self._current = index
                return result
            except etcd.EtcdWatchTimedOut:
                self._current = index
                raise
            except etcd.EtcdConnectionFailed as e:
                if isinstance(e.cause, SSLError):
                    self._current = (index + 1) % n
                    raise tls_error(url, e.cause) from e
                if isinstance(e.cause, ConnectTimeoutError) and time.monotonic() < deadline:
                    failures.append(f"{url}: {e.cause}")
                    continue
                self._current = (index + 1) % n
                raise StoreUnavailable(f"etcd at {url} did not answer: {e.cause or e}") from e
            except (etcd.EtcdLeaderElectionInProgress, etcd.EtcdWatcherCleared) as e:
                raise StoreUnavailable(f"etcd at {url}: {e}") from e
            except etcd.EtcdInsufficientPermissions as e:
                raise StoreAuthError(f"etcd at {url} refused the credentials: {e}") from e
            except etcd.EtcdException as e:
                payload = e.payload if isinstance(e.payload, dict) else {}
                # python-etcd reports a non-JSON answer as "Bad response" and
                # drops its status; etcd's "404 page not found" means no v2 API
                if "errorCode" not in payload and (isinstance(e, etcd.EtcdKeyNotFound)
                                                   or "404" in str(payload.get("cause"))):
                    raise StoreCorrupt(f"etcd at {url} does not serve the v2 API (etcd 3.4 "
                                       "needs --enable-v2=true; 3.6 removed it)") from e
                if isinstance(e, expect):
                    raise
                status = payload.get("status", 0)
                cls = StoreUnavailable if status >= 500 or not status else StoreError
                raise cls(f"etcd at {url}: {e}") from e
        raise StoreUnavailable("no etcd endpoint answered within "
                               f"{self.timeout}s: " + "; ".join(failures or ["deadline passed"]))

    def _dir(self, prefix: str) -> str:
        return _q(prefix.rstrip("/") or "/")

    def _attach(self, key: str, lease: Lease | None, value: str = "") -> None:
        """Remember (or forget) that ``key`` belongs to one of our leases."""
        with self._lock:
            old = self._key_lease.pop(key, None)
            if old is not None and old in self._leases:
                self._leases[old].keys.pop(key, None)
            if lease is not None and lease.id in self._leases:
                self._leases[lease.id].keys[key] = value
                self._key_lease[key] = lease.id

    def _ttl(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        with self._lock:
            held = self._leases.get(lease.id)
            if held is None or time.monotonic() >= held.deadline:
                self._leases.pop(lease.id, None)
                raise LeaseNotFound(f"lease {lease.id:x} has ended")
            return held.ttl

    def _write(self, key: str, value: str, lease: Lease | None, **cond: Any) -> int:
        ttl = self._ttl(lease)
        try:
            r = self._do("write", _q(key), str(value), ttl=ttl, expect=_WRITE_ERRORS, **cond)
        except (etcd.EtcdNotFile, etcd.EtcdNotDir) as e:
            raise StoreError(f"{key} or its parent is a directory in etcd2 (a key may not be "
                             "a prefix of other keys)") from e
        self._attach(key, lease, str(value))
        return r.modifiedIndex

    # -- the Store interface -------------------------------------------------

    def get(self, key: str) -> KV | None:
        try:
            r = self._do("read", _q(check_key(key)), expect=_MISSING)
        except _MISSING:
            return None
        if r.dir:
            return None
        return KV(key, r.value or "", r.modifiedIndex, self._key_lease.get(key, 0))

    def list(self, prefix: str) -> tuple[list[KV], int]:
        prefix = dir_prefix(prefix)
        try:
            r = self._do("read", self._dir(prefix), recursive=True, expect=_MISSING)
        except _MISSING as e:
            return [], int(e.payload.get("index", 0))
        kvs = [KV(n.key, n.value or "", n.modifiedIndex, self._key_lease.get(n.key, 0))
               for n in r.leaves if not n.dir and n.key.startswith(prefix)]
        return sorted(kvs), r.etcd_index

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self._write(check_key(key), value, lease)

    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        try:
            return self._write(check_key(key), value, lease, prevExist=False)
        except etcd.EtcdAlreadyExist as e:
            raise KeyExists(f"{key} already exists") from e

    def compare_and_swap(self, key: str, value: str, prev_revision: int,
                         lease: Lease | None = None) -> int:
        check_key(key)
        cond = {"prevExist": False} if prev_revision == 0 else {"prevIndex": prev_revision}
        try:
            return self._write(key, value, lease, **cond)
        except (etcd.EtcdAlreadyExist, etcd.EtcdCompareFailed, etcd.EtcdKeyNotFound) as e:
            raise CompareFailed(f"{key} is not at revision {prev_revision}") from e

    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        check_key(key)
        cond = {} if prev_revision is None else {"prevIndex": prev_revision}
        try:
            self._do("delete", _q(key), expect=_CHANGED, **cond)
        except etcd.EtcdKeyNotFound as e:
            if prev_revision is not None:
                raise CompareFailed(f"{key} is absent, not at revision {prev_revision}") from e
            return False
        except etcd.EtcdCompareFailed as e:
            raise CompareFailed(f"{key} is not at revision {prev_revision}") from e
        self._attach(key, None)
        return True

    def delete_prefix(self, prefix: str) -> int:
        prefix = dir_prefix(prefix)
        try:
            r = self._do("read", self._dir(prefix), recursive=True, expect=_MISSING)
        except _MISSING:
            return 0
        nodes = [n for n in r.get_subtree() if n.key]
        count = sum(self.delete(n.key) for n in nodes if not n.dir and n.key.startswith(prefix))
        for d in sorted((n.key for n in nodes if n.dir), key=len, reverse=True):
            try:  # prune empty directories, deepest first; a busy one stays
                self._do("delete", _q(d), dir=True, expect=_PRUNE)
            except _PRUNE:
                pass
        return count

    def grant_lease(self, ttl: int) -> Lease:
        """Local only: no request, so no StoreUnavailable either."""
        ttl = max(1, int(ttl))
        with self._lock:
            lease_id = random.getrandbits(62) | 1
            self._leases[lease_id] = _V2Lease(ttl, time.monotonic() + ttl)
        return Lease(lease_id, ttl)

    def refresh_lease(self, lease: Lease) -> None:
        self._ttl(lease)  # raises LeaseNotFound once its time is up
        with self._lock:
            held = self._leases[lease.id]
            keys = dict(held.keys)
        started, lost = time.monotonic(), 0
        for key, value in keys.items():
            try:
                self._do("refresh", _q(key), held.ttl, expect=_CHANGED, **_owned(value))
            except (etcd.EtcdKeyNotFound, etcd.EtcdCompareFailed):
                lost += 1  # expired, deleted, or overwritten by someone else
                self._attach(key, None)
        if keys and lost == len(keys):
            with self._lock:
                self._leases.pop(lease.id, None)
            raise LeaseNotFound(f"lease {lease.id:x} has ended: all its keys are gone")
        held.deadline = started + held.ttl

    def revoke_lease(self, lease: Lease) -> None:
        with self._lock:
            held = self._leases.pop(lease.id, None)
        for key, value in (held.keys.items() if held else ()):
            try:
                self._do("delete", _q(key), expect=_CHANGED, **_owned(value))
            except (etcd.EtcdKeyNotFound, etcd.EtcdCompareFailed):
                pass
            with self._lock:
                self._key_lease.pop(key, None)

    def revision(self) -> int:
        return int(self._do("read", "/").etcd_index)

    def watch(self, prefix: str, start_revision: int,
              stop_event: threading.Event | None = None,
              timeout: float | None = None, deletes_only: bool = False) -> Iterator[WatchEvent]:
        prefix = dir_prefix(prefix)
        deadline = None if timeout is None else time.monotonic() + timeout
        index, heard, broken = start_revision + 1, time.monotonic(), False
        while not (stop_event is not None and stop_event.is_set()):
            wait = POLL
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    return
            try:
                r = self._do("read", self._dir(prefix), wait=True, waitIndex=index,
                             recursive=True, timeout=wait,
                             expect=(etcd.EtcdEventIndexCleared,))
            except StoreUnavailable:
                if broken:  # twice running: no member answers
                    raise
                broken = True  # once: the next poll fails over to another member
                continue
            except etcd.EtcdWatchTimedOut:
                broken = False
                if time.monotonic() - heard > self.watch_liveness:
                    self._do("api_execute", "/version", "GET")  # raises if etcd is gone
                    heard = time.monotonic()
                continue
            except etcd.EtcdEventIndexCleared as e:
                raise WatchCompacted(f"etcd2 no longer has events from index {index}; "
                                     "re-list", int(e.payload.get("index", 0))) from e
            index, heard, broken = r.modifiedIndex + 1, time.monotonic(), False
            if r.dir or not r.key or not r.key.startswith(prefix):
                continue
            if r.action == "expire":
                yield WatchEvent(EVENT_EXPIRE, r.key, None, r.modifiedIndex)
            elif r.action in _DELETES:
                yield WatchEvent(EVENT_DELETE, r.key, None, r.modifiedIndex)
            elif not deletes_only:   # v2 has no filter: the puts are dropped here
                yield WatchEvent(EVENT_PUT, r.key, r.value or "", r.modifiedIndex)

    def health(self) -> str:
        resp = self._do("api_execute", "/health", "GET")
        url = self.endpoints[self._current]
        if b'"true"' not in resp.data:
            raise StoreUnavailable(f"etcd at {url} is unhealthy: {resp.data[:200]!r}")
        self._do("read", "/")  # the v2 API answers (raises StoreCorrupt if off)
        return f"etcd2 at {url}: ok"

    def close(self) -> None:
        for c in self._clients:
            c.http.clear()
