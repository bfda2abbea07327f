"""The store interface every backend implements, and its one error tree.

A store is a small key-value service shaped after etcd: string keys that
are absolute paths, string values (callers JSON-encode), a revision
counter that grows with every change, leases that delete their keys when
they are not refreshed, compare-and-swap on a key's revision, and a watch
that replays every change after a revision.

Three backends implement it: ``memory`` (one process, ``--standalone``
and decision tests), ``etcd2`` (etcd's v2 API) and ``etcd3`` (etcd's v3
API).  Where a backend cannot keep a guarantee exactly, its module says
how it differs; the contract tests in ``tests/store`` run the same cases
against all three.

Calls make one attempt, bounded by the store's timeout (failing over to
the next endpoint only where the request surely never reached the first
one).  Transient failures raise :class:`StoreUnavailable`.
"""

from __future__ import annotations

import abc
import threading
from typing import Iterator, NamedTuple

EVENT_PUT = "put"
EVENT_DELETE = "delete"
EVENT_EXPIRE = "expire"


class StoreError(Exception):
    """Base of every error a store raises."""


class StoreUnavailable(StoreError):
    """The store did not answer: timeout, refused connection, no leader.

    Transient and retryable.  A write that raised this may or may not have
    been applied; re-read before assuming either.
    """


class StoreAuthError(StoreError):
    """Credentials, permissions or TLS trust were rejected.

    Not transient: retrying cannot help until the settings change.
    """


class KeyExists(StoreError):
    """``create`` found the key already present."""


class CompareFailed(StoreError):
    """A compare-and-swap or conditional delete found another revision."""


class LeaseNotFound(StoreError):
    """The lease expired, was revoked, or never existed."""


class WatchCompacted(StoreError):
    """The store no longer holds the history a watch asked for.

    The caller must re-list the prefix and watch from the list's revision.
    """

    def __init__(self, message: str, revision: int = 0):
        super().__init__(message)
        self.revision = revision


class StoreCorrupt(StoreError):
    """The server answered with something that is not the protocol."""


def tls_error(url: str, exc: BaseException) -> StoreError:
    """A TLS failure: a rejected certificate is a settings problem
    (StoreAuthError); anything else, e.g. a handshake cut short by a
    restarting server, is transient (StoreUnavailable)."""
    text = str(exc)
    if any(w in text.upper() for w in ("CERTIFICATE", "ALERT", "UNKNOWN_CA", "HOSTNAME",
                                       "WRONG_VERSION_NUMBER")):
        return StoreAuthError(f"TLS with etcd at {url} failed (check the URL scheme, the CA, "
                              f"the client certificate and key): {text}")
    return StoreUnavailable(f"TLS with etcd at {url} broke: {text}")


class KV(NamedTuple):
    """One key as read: ``revision`` is its last modification's revision.

    ``lease_id`` is 0 when the key has no lease (or, for etcd2, when the
    lease is not one this client granted).
    """

    key: str
    value: str
    revision: int
    lease_id: int = 0


class Lease(NamedTuple):
    """A granted lease: keys put with it vanish ``ttl`` seconds after its
    last grant or refresh."""

    id: int
    ttl: int


class WatchEvent(NamedTuple):
    """One change: ``type`` is put, delete or expire; ``value`` is None
    unless ``type`` is put.  etcd3 reports a lease expiry as delete."""

    type: str
    key: str
    value: str | None
    revision: int


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid absolute key, else raise ValueError.

    A key starts with '/', does not end with '/', has no empty, '.' or
    '..' segment and no control characters.  A key must not also be used
    as a prefix of other keys (etcd2 stores prefixes as directories).
    """
    if not isinstance(key, str) or not key.startswith("/") or key.endswith("/"):
        raise ValueError(f"store key must start and not end with '/': {key!r}")
    parts = key[1:].split("/")
    if any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 for c in key):
        raise ValueError(f"store key has an empty, '.', '..' or control segment: {key!r}")
    return key


def dir_prefix(prefix: str) -> str:
    """Normalise a list/watch prefix to a directory: '/a/b' -> '/a/b/'.

    Prefixes select whole path segments on every backend: '/a/b' matches
    '/a/b/c' but never '/a/bc'.
    """
    if prefix == "/":
        return prefix
    check_key(prefix.rstrip("/") if prefix.endswith("/") else prefix)
    return prefix if prefix.endswith("/") else prefix + "/"


class Store(abc.ABC):
    """What every backend guarantees.

    Thread-safe: one store object is shared by the daemon's threads.  Each
    method makes one bounded attempt (``timeout`` seconds at most, plus
    failover) and raises a :class:`StoreError`, never a library's own
    exception.
    """

    name: str = "abstract"
    timeout: float = 5.0

    @abc.abstractmethod
    def get(self, key: str) -> KV | None:
        """The key's current value and revision, or None if absent."""

    @abc.abstractmethod
    def list(self, prefix: str) -> tuple[list[KV], int]:
        """Every key under ``prefix`` (see :func:`dir_prefix`), sorted by
        key, and the store revision the snapshot was taken at.  Watching
        from that revision misses nothing that happened after the list."""

    @abc.abstractmethod
    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        """Set the key unconditionally; return the new revision.

        With ``lease`` the key is deleted when the lease ends; raises
        :class:`LeaseNotFound` if the lease already ended."""

    @abc.abstractmethod
    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        """Set the key only if absent; return its revision.

        Raises :class:`KeyExists` if it is present.  Atomic: of several
        concurrent creators exactly one succeeds."""

    @abc.abstractmethod
    def compare_and_swap(
        self, key: str, value: str, prev_revision: int, lease: Lease | None = None
    ) -> int:
        """Set the key only if its revision is still ``prev_revision``
        (0: only if absent); return the new revision.

        Raises :class:`CompareFailed` otherwise.  This is the fencing
        token: a writer that read revision R overwrites only R."""

    @abc.abstractmethod
    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        """Delete the key; True if it existed.

        With ``prev_revision`` delete only that revision, else raise
        :class:`CompareFailed` (also when the key is absent)."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; return how many.  Atomic on
        memory and etcd3; key by key on etcd2."""

    @abc.abstractmethod
    def grant_lease(self, ttl: int) -> Lease:
        """A new lease of at least ``ttl`` whole seconds (etcd3 rounds
        tiny TTLs up to its minimum; the returned ``ttl`` is the real one)."""

    @abc.abstractmethod
    def refresh_lease(self, lease: Lease) -> None:
        """Restart the lease's TTL.  Emits no watch events.

        Raises :class:`LeaseNotFound` if it already ended: its keys are
        gone, and the caller must grant a new lease and re-put them."""

    @abc.abstractmethod
    def revoke_lease(self, lease: Lease) -> None:
        """End the lease now, deleting its keys (delete events).
        Idempotent: revoking an ended lease is not an error."""

    @abc.abstractmethod
    def revision(self) -> int:
        """The store's current revision: a watch from it sees every change after
        this call, without a list of anything (a watch of deletes only needs no list)."""

    @abc.abstractmethod
    def watch(
        self,
        prefix: str,
        start_revision: int,
        stop_event: threading.Event | None = None,
        timeout: float | None = None,
        deletes_only: bool = False,
    ) -> Iterator[WatchEvent]:
        """Every change under ``prefix`` with revision > ``start_revision``,
        in revision order, none lost, none repeated.

        With ``deletes_only``, only its deletes and expiries, the keys alone:
        etcd3 leaves the puts out itself (a watch filter), so a key rewritten
        often costs such a watcher nothing. (Never the value a deleted key held:
        etcd reads it again for every watcher that asks, per delete.)

        The iterator returns (normally) within about half a second once
        ``stop_event`` is set, or once ``timeout`` seconds have passed
        since the call (None: no deadline).  It stops only between
        revisions, so resuming from the last event's revision is exact.

        Raises :class:`WatchCompacted` when the history from
        ``start_revision`` is gone (re-list, then watch from the list's
        revision), and :class:`StoreUnavailable` when the store stops
        answering (watch again from the last revision seen)."""

    @abc.abstractmethod
    def health(self) -> str:
        """One sentence on the store's state when it answers; raises
        :class:`StoreUnavailable` when it does not."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections.  Idempotent."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
