"""Lease refreshes over etcd's native gRPC keep-alive stream (membership.lease_transport = grpc).

The JSON gateway answers each refresh with a POST of its own, for which etcd
opens and closes an internal keep-alive stream; this keeps ONE gRPC channel
and ONE bidirectional ``Lease/LeaseKeepAlive`` stream per store instead and
sends one message a refresh, which costs etcd about half the CPU
(bench/README.md, lease_bench).  Only refreshes travel here: grants, revokes
and the login stay with the gateway (store/etcd3.py), whose auth token the
stream carries as etcd's ``token`` metadata.

Every refresh waits at most the store's timeout for etcd's reply.  A reply
with TTL 0 means the lease has ended: :class:`LeaseNotFound`.  Any other
failure raises a :class:`StoreError` (StoreUnavailable when etcd did not
answer, StoreAuthError for TLS trust or credentials) and closes the stream
and its channel; the next refresh opens them again, on the next endpoint.
With one endpoint, a reply late on a connected stream that etcd answered
within ``SILENT_FOR`` timeouts is the exception: there is no other member to
go to, etcd is most likely slow rather than gone (under load, or a burst of
work), and the stream is kept. A new channel then would cost etcd and this
process a connection and its threads exactly when etcd is slowest, and every
node of a busy cluster doing the same at once makes etcd slower still; the
late reply is skipped when it comes (etcd answers a stream in order). With
several endpoints a late reply may be a member cut off from the others,
whose leases it cannot renew: the next refresh goes to the next member at
once, as before (a lease outlives one refresh and one timeout, not two).  A
new stream that breaks at once (connection refused, a member without a
leader) or has no connection within its share of the timeout moves on to
the next endpoint within the same refresh, as the gateway's calls do (a
keep-alive may be repeated safely).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import grpc

from .base import (
    LeaseNotFound, StoreAuthError, StoreCorrupt, StoreError, StoreUnavailable, tls_error,
)
from . import etcd_grpc
from .etcd3_errors import etcd_error
from .etcdpb import lease_pb2, lease_pb2_grpc


# A connected stream that has not answered for this many timeouts is dropped at a
# timeout (and the next endpoint tried); within it, a late reply keeps the stream.
SILENT_FOR = 2.0


class _Stream:
    """One channel and its keep-alive call; a thread of its own reads the replies
    into ``replies`` (a reply, an RpcError, or None when the stream ended)."""

    def __init__(self, url: str, credentials: grpc.ChannelCredentials | None, token: str | None):
        self.url = url
        self.channel = etcd_grpc.channel(url, credentials)
        self.replies: queue.Queue = queue.Queue()
        self._requests: queue.Queue = queue.Queue()
        # hasleader: a member cut off from its leader ends the stream instead of
        # keeping leases it cannot renew (etcd's clientv3 sets it the same way).
        metadata = [("hasleader", "true")] + ([("token", token)] if token else [])
        # Whether the channel ever connected: until it does, a refresh may go on to
        # the next endpoint early (gRPC watches the state only until then).
        self.connected = threading.Event()
        self.heard = time.monotonic()   # its last reply, or its opening
        self.owed = 0                   # replies still to come for refreshes that timed out
        self.channel.subscribe(self._state)
        stub = lease_pb2_grpc.LeaseStub(self.channel)
        self._call = stub.LeaseKeepAlive(iter(self._requests.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="etcd3-keepalive", daemon=True)
        self._reader.start()

    def _state(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY and not self.connected.is_set():
            self.connected.set()
            self.channel.unsubscribe(self._state)

    def _read(self) -> None:
        try:
            for reply in self._call:
                self.replies.put(reply)
            self.replies.put(None)
        except grpc.RpcError as exc:
            self.replies.put(exc)

    def alive(self) -> bool:
        """False once the stream ended or broke (its reader has stopped)."""
        return self._reader.is_alive()

    def send(self, lease_id: int) -> None:
        self._requests.put(lease_pb2.LeaseKeepAliveRequest(ID=lease_id))

    def close(self) -> None:
        self._requests.put(None)      # ends the request iterator gRPC's thread reads
        if not self.connected.is_set():
            self.channel.unsubscribe(self._state)
        self._call.cancel()
        self.channel.close()
        self._reader.join(timeout=1.0)


class KeepAliveStream:
    """Refreshes leases over one keep-alive stream; thread-safe (one refresh at a time)."""

    def __init__(self, endpoints: list[str], timeout: float, *, ca_cert: str | None = None,
                 cert: str | None = None, key: str | None = None,
                 token: Callable[[bool], str | None] = lambda renew: None):
        """``endpoints`` are URLs (http:// or https://, as the store normalised them);
        ``token(renew)`` gives the auth token to send (None: auth is off), logging in
        again first when ``renew``."""
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self._tls = (ca_cert, cert, key)
        self._token = token
        self._current = 0
        self._stream: _Stream | None = None
        self._lock = threading.Lock()
        self.opened = 0     # streams opened: the first, then one after each break

    def refresh(self, lease_id: int) -> int:
        """Keep the lease alive; its TTL as etcd now counts it. LeaseNotFound if it ended."""
        with self._lock:
            deadline = time.monotonic() + self.timeout
            relogged, tries = False, 0
            while True:
                # A stream that broke since the last refresh (etcd restarted) is
                # opened again on the same endpoint: that is no failure yet.
                if self._stream is not None and not self._stream.alive():
                    self._drop(advance=False)
                fresh = self._stream is None
                last = tries + 1 >= len(self.endpoints)
                try:
                    return self._refresh_once(lease_id, deadline, relogged, last)
                except _Relogin:
                    relogged = True
                except _TryNext as exc:
                    tries += fresh
                    if tries >= len(self.endpoints) or time.monotonic() >= deadline:
                        raise exc.error from None

    def _refresh_once(self, lease_id: int, deadline: float, relogged: bool, last: bool) -> int:
        stream = self._open(relogged)
        stream.send(lease_id)
        wait = max(0.0, deadline - time.monotonic())
        if not (last or stream.connected.is_set()):  # leave time to try the others
            wait = min(wait, max(self.timeout / len(self.endpoints), 0.25))
        reply = self._reply(stream, lease_id, wait)
        if reply is _NOTHING and stream.connected.is_set():   # connected: wait it out
            reply = self._reply(stream, lease_id, max(0.0, deadline - time.monotonic()))
        if reply is _NOTHING:
            connected = stream.connected.is_set()
            silent = time.monotonic() - stream.heard
            if connected and len(self.endpoints) == 1 and silent < SILENT_FOR * self.timeout:
                stream.owed += 1      # slow, not gone: keep the stream, skip the late reply
            else:
                self._drop()
            error = StoreUnavailable(f"etcd at {stream.url} did not answer a lease keep-alive "
                                     f"within {self.timeout:g}s"
                                     + ("" if connected else " (no connection)"))
            raise error if connected else _TryNext(error)
        if isinstance(reply, lease_pb2.LeaseKeepAliveResponse):
            if reply.ID != lease_id:
                self._drop()
                raise StoreCorrupt(f"etcd at {stream.url} answered a keep-alive of lease "
                                   f"{lease_id:x} for lease {reply.ID:x}")
            if reply.TTL <= 0:
                raise LeaseNotFound(f"lease {lease_id:x} has ended")
            return int(reply.TTL)
        error = (_TryNext(StoreUnavailable(f"etcd at {stream.url} ended the lease keep-alive "
                                           "stream")) if reply is None
                 else self._error(stream.url, reply, relogged))
        self._drop(advance=not isinstance(error, _Relogin))
        raise error

    @staticmethod
    def _reply(stream: _Stream, lease_id: int, timeout: float):
        """The reply to this refresh's keep-alive within ``timeout``, else _NOTHING; the
        replies still owed to refreshes that timed out come first and are skipped (one
        saying the lease ended is that answer still). An error or the stream's end is
        returned as it comes."""
        end = time.monotonic() + timeout
        while True:
            reply = _next(stream.replies, max(0.0, end - time.monotonic()))
            if not isinstance(reply, lease_pb2.LeaseKeepAliveResponse):
                return reply
            stream.heard = time.monotonic()
            if stream.owed == 0 or (reply.ID == lease_id and reply.TTL <= 0):
                return reply
            stream.owed -= 1

    @staticmethod
    def _error(url: str, exc: grpc.RpcError, relogged: bool) -> Exception:
        details = exc.details() or ""
        if any(w in details for w in ("SSL", "ssl", "handshake", "TSI_")):
            return tls_error(url, RuntimeError(details))
        error = etcd_error(url, "the lease keep-alive stream", None,
                           {"code": exc.code().value[0], "message": details})
        if isinstance(error, StoreAuthError) and "token" in details and not relogged:
            return _Relogin()
        return _TryNext(error) if isinstance(error, StoreUnavailable) else error

    def _open(self, relogin: bool) -> _Stream:
        if self._stream is None:
            url = self.endpoints[self._current]
            creds = self._credentials() if url.startswith("https://") else None
            self._stream = _Stream(url, creds, self._token(relogin))
            self.opened += 1
        return self._stream

    def _credentials(self) -> grpc.ChannelCredentials:
        """Read at each new channel, so renewed certificates are taken up."""
        return etcd_grpc.credentials(*self._tls)

    def _drop(self, advance: bool = True) -> None:
        """Close the stream and its channel; the next refresh opens them again, on the
        next endpoint if ``advance``."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if advance:
            self._current = (self._current + 1) % len(self.endpoints)

    def close(self) -> None:
        """Close the stream and its channel. Idempotent; a later refresh opens them again."""
        with self._lock:
            if self._stream is not None:
                self._stream.close()
                self._stream = None


_NOTHING = object()


def _next(replies: queue.Queue, timeout: float):
    """The next item of ``replies`` within ``timeout`` seconds, else _NOTHING."""
    try:
        return replies.get(timeout=timeout)
    except queue.Empty:
        return _NOTHING


class _Relogin(Exception):
    """etcd refused the auth token: log in again and open a new stream, once."""


class _TryNext(Exception):
    """The stream failed before etcd answered: the next endpoint may, in the same refresh."""

    def __init__(self, error: StoreError):
        super().__init__(str(error))
        self.error = error
