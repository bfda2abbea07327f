"""A prefix's watch over etcd's native gRPC Watch stream (etcd.watch_transport = grpc).

Over the JSON gateway, etcd turns every event into JSON and base64 and sends
it down an HTTP/1.1 chunked stream, one stream (and TCP connection) per
watch; its events cost etcd about twice the CPU they cost on its own gRPC
Watch stream (bench/README.md, watch_bench). Here a store keeps one gRPC
channel per endpoint (``WatchChannels``: one HTTP/2 connection) and one
``Watch`` stream on it (``WatchMux``) that carries all of the store's watches,
each under an id of its own (etcd's ``watch_id``, chosen here so that answers
are told apart from the first; etcd's own client multiplexes the same way). A
daemon keeps a watch per job it runs and a few of its own: one stream, and one
reading thread, serve them all (one each made a node cost etcd a stream and this
process three threads per watch, which is what stopped bench/scale_sim.py
between 120 and 160 simulated nodes on 2 cores).

``GrpcWatchStream``, one watch on a mux, keeps the gateway stream's contract
(store/etcd3.py, ``_WatchStream``), so ``Etcd3Store.watch`` drives both the same
way: ``queue`` gets ("events", [WatchEvent...]) per message, then one of
("error", StoreError), ("end", None) or ("relogin", reason) (the auth token
expired). A watch's own end (its history compacted, a permission, an expired
token) ends it alone; the stream's end or failure ends every watch on it, and
each opens again from its own last revision on a new stream. Logins, lists
and the liveness check stay with the gateway; the stream carries the gateway's
auth token as etcd's ``token`` metadata, as the lease stream does (a stream per
token: a watch that logged in again opens a new one).
"""
from __future__ import annotations

import collections
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
# A watch channel's gRPC options, from the above (bench/scale_replay.py's nodes use them).
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.keepalive_time_ms", KEEPALIVE_MS),
                   ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]))


def _text(raw: bytes) -> str:
    # Foreign writers may store non-UTF-8 bytes: never fail on a value (as the gateway's).
    return raw.decode("utf-8", "replace")


class ChannelClosed(Exception):
    """The channel was closed (another stream on it dropped it) before the stream began."""


class WatchChannels:
    """One gRPC channel per endpoint URL, and on it one ``WatchMux`` per auth token,
    shared by a store's watches."""

    def __init__(self, credentials: Callable[[], grpc.ChannelCredentials]):
        """``credentials()`` gives an https:// endpoint's TLS credentials, read at each new
        channel (so renewed certificates are taken up)."""
        self._credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._muxes: dict[tuple[str, str | None], WatchMux] = {}
        self._lock = threading.Lock()   # the tables, and each mux's watches

    def _channel(self, url: str) -> grpc.Channel:
        """(Under the lock.) ``url``'s channel, made if there is none."""
        channel = self._channels.get(url)
        if channel is None:
            channel = etcd_grpc.channel(
                url, self._credentials() if url.startswith("https://") else None,
                CHANNEL_OPTIONS)
            self._channels[url] = channel
        return channel

    def watch(self, url: str, token: str | None, prefix: str, range_end: bytes,
              after: int, deletes_only: bool = False) -> "GrpcWatchStream":
        """A watch of ``prefix`` from revision ``after + 1`` on ``url``'s stream for
        ``token`` (opened if there is none, or the one there has ended); with
        ``deletes_only``, etcd sends its deletes only (the keys alone)."""
        with self._lock:
            for _ in range(2):
                mux = self._muxes.get((url, token))
                if mux is None or mux.ended:
                    channel = self._channel(url)
                    try:
                        mux = WatchMux(self, channel, url, token)
                    except ChannelClosed:   # another watch of this store closed it just now
                        self._forget(url, channel)
                        continue
                    self._muxes[(url, token)] = mux
                return mux.add(prefix, range_end, after, deletes_only)
        raise StoreUnavailable(f"etcd watch channel to {url} keeps closing")

    def drop(self, url: str, channel: grpc.Channel) -> None:
        """Close ``channel``, ``url``'s (its connection broke): the next stream opens a new
        one. A channel another stream dropped and replaced already is left alone."""
        with self._lock:
            if self._channels.get(url) is not channel:
                return
            self._forget(url, channel)
        channel.close()

    def _forget(self, url: str, channel: grpc.Channel) -> None:
        """(Under the lock.) ``url``'s channel and the streams on it are gone."""
        if self._channels.get(url) is channel:
            del self._channels[url]
        for key, mux in list(self._muxes.items()):
            if mux.channel is channel:
                del self._muxes[key]

    def ended(self, mux: "WatchMux") -> None:
        """(Under the lock.) ``mux``'s stream ended: the next watch opens another."""
        key = (mux.url, mux.token)
        if self._muxes.get(key) is mux:
            del self._muxes[key]

    def close(self) -> None:
        """Close the channels: the streams on them end, and tell their watches."""
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            self._muxes = {}
        for channel in channels:
            channel.close()


class WatchMux:
    """One Watch stream on ``channel``, carrying any number of watches, each under an
    id of its own; one thread reads it and hands each message to its watch. Made,
    and its watches added and removed, under the owning ``WatchChannels``' lock;
    it ends when its last watch goes, or when the stream ends or fails (every
    watch on it is told, and each opens again on a new one)."""

    def __init__(self, owner: WatchChannels, channel: grpc.Channel, url: str,
                 token: str | None):
        self.url = url
        self.token = token
        self.channel = channel
        self.ended = False
        self.heard = threading.Event()     # etcd answered on this stream (anything)
        self._owner = owner
        self._lock = owner._lock
        self._watches: dict[int, GrpcWatchStream] = {}
        # Create requests not answered yet, oldest first: etcd answers them in order,
        # and a refused one (an invalid token) comes back with watch_id -1.
        self._unanswered: collections.deque[int] = collections.deque()
        self._next_id = 1
        self._requests: queue.Queue = queue.Queue()
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

    def add(self, prefix: str, range_end: bytes, after: int,
            deletes_only: bool = False) -> "GrpcWatchStream":
        """(Under the lock.) A new watch on this stream."""
        watch_id, self._next_id = self._next_id, self._next_id + 1
        watch = GrpcWatchStream(self, watch_id)
        self._watches[watch_id] = watch
        self._unanswered.append(watch_id)
        create = watch_pb2.WatchCreateRequest
        self._requests.put(watch_pb2.WatchRequest(create_request=create(
            key=prefix.encode(), range_end=range_end, start_revision=after + 1,
            watch_id=watch_id, filters=[create.NOPUT] if deletes_only else [])))
        return watch

    def remove(self, watch: "GrpcWatchStream") -> None:
        """``watch`` is closed: etcd is asked to end it; the last one ends the stream."""
        with self._lock:
            live = self._watches.pop(watch.watch_id, None) is not None  # else etcd ended it
            if self.ended:
                return
            if self._watches:
                if live:
                    self._requests.put(watch_pb2.WatchRequest(
                        cancel_request=watch_pb2.WatchCancelRequest(watch_id=watch.watch_id)))
                return
            self.ended = True
            self._owner.ended(self)
        self.stop()

    def stop(self) -> None:
        """End the stream (its last watch is closed)."""
        self._requests.put(None)      # ends the request iterator gRPC's thread reads
        self._call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    def _read(self) -> None:
        last: tuple[str, object] = ("end", None)
        try:
            for resp in self._call:
                self.heard.set()
                with self._lock:
                    watch_id = self._answered(resp) if resp.created else resp.watch_id
                    watch = self._watches.get(watch_id)
                if watch is None:   # a watch closed here; etcd's last words for it
                    continue
                if not watch.message(resp):
                    with self._lock:   # over on etcd's side: nothing to cancel
                        self._watches.pop(watch_id, None)
        except grpc.RpcError as exc:
            last = self._failure(exc)
        except ValueError as exc:   # its channel closed under it (another stream's drop)
            last = ("error", StoreUnavailable(f"etcd watch stream from {self.url} ended: {exc}"))
        except Exception as exc:  # noqa: BLE001 - any read failure ends the stream
            last = ("error", StoreError(f"etcd watch stream from {self.url} broke: {exc!r}"))
        self._requests.put(None)          # gRPC's request thread ends too
        with self._lock:
            self.ended = True
            self._owner.ended(self)
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.queue.put(last)

    def _answered(self, resp: watch_pb2.WatchResponse) -> int:
        """(Under the lock.) Which watch a "created" answer is for: its own id, or the
        oldest create not answered yet where etcd refused it without one."""
        if resp.watch_id in self._unanswered:
            while self._unanswered.popleft() != resp.watch_id:
                pass
            return resp.watch_id
        return self._unanswered.popleft() if self._unanswered else resp.watch_id

    def _failure(self, exc: grpc.RpcError) -> tuple[str, object]:
        details = exc.details() or ""
        if any(w in details for w in ("SSL", "ssl", "handshake", "TSI_")):
            return "error", tls_error(self.url, RuntimeError(details))
        error = etcd_error(self.url, "the watch stream", None,
                           {"code": exc.code().value[0], "message": details})
        if "auth token" in details:   # expired or invalid: log in, watch again
            return "relogin", details
        return "error", error


class GrpcWatchStream:
    """One watch on a ``WatchMux`` (see the module's doc): ``queue`` gets what etcd
    says of it; ``heard`` is set once etcd answered on its stream."""

    def __init__(self, mux: WatchMux, watch_id: int):
        self.mux = mux
        self.watch_id = watch_id
        self.url = mux.url
        self.channel = mux.channel
        self.token = mux.token
        self.heard = mux.heard
        self.queue: queue.Queue = queue.Queue()

    def message(self, resp: watch_pb2.WatchResponse) -> bool:
        """Queue what one message says; False when the watch is over."""
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
        self.mux.remove(self)
