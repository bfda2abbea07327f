"""A prefix's watch over etcd's native gRPC Watch stream (etcd.watch_transport = grpc).

Over the JSON gateway, etcd turns every event into JSON and base64 and sends
it down an HTTP/1.1 chunked stream, one stream (and TCP connection) per
watch; its events cost etcd about twice the CPU they cost on its own gRPC
Watch stream (bench/README.md, watch_bench). Here a store keeps one gRPC
channel per endpoint (``WatchChannels``: one HTTP/2 connection), and each
watch is one ``Watch`` stream on it.

``GrpcWatchStream`` keeps the gateway stream's contract (store/etcd3.py,
``_WatchStream``), so ``Etcd3Store.watch`` drives both the same way: a thread
of its own reads the stream into ``queue`` as ("events", [WatchEvent...])
per message, then one of ("error", StoreError), ("end", None) or
("relogin", reason) (the auth token expired). Logins, lists and the
liveness check stay with the gateway; the stream carries the gateway's auth
token as etcd's ``token`` metadata, as the lease stream does.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import grpc

from .base import (
    EVENT_DELETE, EVENT_PUT, StoreError, StoreUnavailable, WatchCompacted, WatchEvent, tls_error,
)
from . import etcd_grpc
from .etcd3_errors import etcd_error
from .etcdpb import watch_pb2, watch_pb2_grpc

# What one watch message may carry: a burst of events after a long pause comes in one
# (etcd splits nothing unless asked), and gRPC's default is 4 MiB.
MAX_MESSAGE = 256 << 20
# HTTP/2 pings on an idle connection find a dead peer (a host gone without a FIN);
# etcd refuses pings more often than its --grpc-keepalive-min-time (5 s).
KEEPALIVE_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# A channel whose connection failed waits before it tries again, up to two minutes by
# gRPC's default: a watch must be back within a second or two of etcd.
RECONNECT_BACKOFF_MS = (100, 2_000)


def _text(raw: bytes) -> str:
    # Foreign writers may store non-UTF-8 bytes: never fail on a value (as the gateway's).
    return raw.decode("utf-8", "replace")


class WatchChannels:
    """One gRPC channel per endpoint URL, shared by a store's watch streams."""

    def __init__(self, credentials: Callable[[], grpc.ChannelCredentials]):
        """``credentials()`` gives an https:// endpoint's TLS credentials, read at each new
        channel (so renewed certificates are taken up)."""
        self._credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, url: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(url)
            if channel is None:
                channel = etcd_grpc.channel(
                    url, self._credentials() if url.startswith("https://") else None,
                    (("grpc.max_receive_message_length", MAX_MESSAGE),
                     ("grpc.keepalive_time_ms", KEEPALIVE_MS),
                     ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                     ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                     ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                     ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])))
                self._channels[url] = channel
            return channel

    def drop(self, url: str, channel: grpc.Channel) -> None:
        """Close ``channel``, ``url``'s (its connection broke): the next stream opens a new
        one. A channel another stream dropped and replaced already is left alone."""
        with self._lock:
            if self._channels.get(url) is not channel:
                return
            del self._channels[url]
        channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


class ChannelClosed(Exception):
    """The channel was closed (another stream on it dropped it) before the stream began."""


class GrpcWatchStream:
    """One Watch stream on ``channel`` for the keys under ``prefix``, from revision
    ``after + 1``; read by its own thread into ``queue`` (see the module's doc).
    ChannelClosed if ``channel`` was closed meanwhile."""

    def __init__(self, channel: grpc.Channel, url: str, prefix: str, range_end: bytes,
                 after: int, token: str | None):
        self.url = url
        self.channel = channel
        self.queue: queue.Queue = queue.Queue()
        self.heard = threading.Event()     # etcd answered (created, or any message)
        self._closed = False
        self._requests: queue.Queue = queue.Queue()
        self._requests.put(watch_pb2.WatchRequest(create_request=watch_pb2.WatchCreateRequest(
            key=prefix.encode(), range_end=range_end, start_revision=after + 1)))
        # hasleader: a member cut off from its leader ends the stream instead of
        # keeping it open with nothing to say (etcd's clientv3 sets it the same way).
        metadata = [("hasleader", "true")] + ([("token", token)] if token else [])
        try:
            self._call = watch_pb2_grpc.WatchStub(channel).Watch(
                iter(self._requests.get, None), metadata=metadata)
        except ValueError as exc:   # grpc: "Cannot invoke RPC: Channel closed!"
            raise ChannelClosed(str(exc)) from None
        self._thread = threading.Thread(target=self._read, name="etcd3-watch-grpc",
                                        daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for resp in self._call:
                self.heard.set()
                if not self._message(resp):
                    return
            self.queue.put(("end", None))
        except grpc.RpcError as exc:
            if not self._closed:
                self.queue.put(self._failure(exc))
        except ValueError as exc:   # its channel closed under it (another stream's drop)
            if not self._closed:
                self.queue.put(("error", StoreUnavailable(
                    f"etcd watch stream from {self.url} ended: {exc}")))
        except Exception as exc:  # noqa: BLE001 - any read failure ends the stream
            if not self._closed:
                self.queue.put(("error", StoreError(
                    f"etcd watch stream from {self.url} broke: {exc!r}")))

    def _failure(self, exc: grpc.RpcError) -> tuple[str, object]:
        details = exc.details() or ""
        if any(w in details for w in ("SSL", "ssl", "handshake", "TSI_")):
            return "error", tls_error(self.url, RuntimeError(details))
        error = etcd_error(self.url, "the watch stream", None,
                           {"code": exc.code().value[0], "message": details})
        if "auth token" in details:   # expired or invalid: log in, watch again
            return "relogin", details
        return "error", error

    def _message(self, resp: watch_pb2.WatchResponse) -> bool:
        """Queue what one message says; False when the stream is over."""
        if resp.canceled:
            if resp.compact_revision:
                self.queue.put(("error", WatchCompacted(
                    f"etcd history before revision {resp.compact_revision} is compacted; "
                    "re-list", resp.compact_revision)))
                return False
            reason = resp.cancel_reason or "canceled"
            if "auth token" in reason:   # the token expired: log in, watch again
                self.queue.put(("relogin", reason))
                return False
            self.queue.put(("error", etcd_error(self.url, "/watch", None,
                                                {"message": reason})))
            return False
        if resp.created and not resp.events:
            return True
        events = []
        for ev in resp.events:
            kv = ev.kv
            if ev.type == watch_pb2.Event.DELETE:
                events.append(WatchEvent(EVENT_DELETE, _text(kv.key), None, kv.mod_revision))
            else:
                events.append(WatchEvent(EVENT_PUT, _text(kv.key), _text(kv.value),
                                         kv.mod_revision))
        self.queue.put(("events", events))
        return True

    def close(self) -> None:
        self._closed = True
        self._requests.put(None)      # ends the request iterator gRPC's thread reads
        self._call.cancel()
        self._thread.join(timeout=2)
