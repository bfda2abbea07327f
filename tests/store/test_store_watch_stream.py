"""Watches over etcd's gRPC Watch stream (membership.watch_transport = grpc; store/watch_stream.py).

The store contract, outage, failover, TLS and auth cases run on this transport
too (backend ``etcd3-grpc``, tests/store/store_backends.py); these are what only
it has: one channel and one stream for all of a store's watches, each watch
ending alone, the setting, and a member that takes connections and never
answers. Real etcd 3.4.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from store_watching import Watcher, replay

from elasticd import config
from elasticd.cluster.node import open_cluster_store
from elasticd.store.etcd3 import Etcd3Store
from elasticd.store.follow import Follower

TIMEOUT = 2.0


def test_every_watch_of_a_store_rides_one_channel_and_gets_every_event(etcd):
    store = Etcd3Store(etcd.endpoints, timeout=TIMEOUT, watch_transport="grpc")
    writer = Etcd3Store(etcd.endpoints, timeout=TIMEOUT)
    try:
        _, rev = writer.list("/one")
        prefixes = [f"/one/p{i}" for i in range(5)]
        for i, p in enumerate(prefixes):
            writer.put(f"{p}/k", str(i))
        got = [replay(store, p, rev, count=1) for p in prefixes]
        assert [[(e.key, e.value) for e in g] for g in got] == [
            [(f"{p}/k", str(i))] for i, p in enumerate(prefixes)]
        assert len(store._watch_channels._channels) == 1
    finally:
        writer.delete_prefix("/one")
        store.close()
        writer.close()


def _readers() -> int:
    return sum(t.name == "etcd3-watch-grpc" for t in threading.enumerate())


def test_watches_of_a_store_share_one_stream_and_one_reading_thread(etcd):
    """Six watches open at once ride one Watch stream (one reading thread, not one
    each); closing one leaves the others their events; the last one ends the stream."""
    store = Etcd3Store(etcd.endpoints, timeout=TIMEOUT, watch_transport="grpc")
    writer = Etcd3Store(etcd.endpoints, timeout=TIMEOUT)
    before = _readers()
    try:
        _, rev = writer.list("/mux")
        watchers = [Watcher(store, f"/mux/p{i}", rev) for i in range(6)]
        for i in range(6):
            writer.put(f"/mux/p{i}/k", str(i))
        for i, w in enumerate(watchers):
            assert [(e.key, e.value) for e in w.wait_for(1)] == [(f"/mux/p{i}/k", str(i))]
        assert len(store._watch_channels._muxes) == 1
        assert _readers() - before == 1
        for w in watchers[:3]:
            w.close()
        for i in range(6):
            writer.put(f"/mux/p{i}/k2", "after")
        for i, w in enumerate(watchers[3:], 3):
            assert [e.key for e in w.wait_for(2)] == [f"/mux/p{i}/k", f"/mux/p{i}/k2"]
        assert all(len(w.events) == 1 for w in watchers[:3])   # closed: nothing more
        for w in watchers[3:]:
            w.close()
        deadline = time.monotonic() + 5
        while _readers() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _readers() == before and not store._watch_channels._muxes
    finally:
        writer.delete_prefix("/mux")
        store.close()
        writer.close()


def test_a_watch_that_etcd_ends_ends_alone(etcd):
    """A watch from a compacted revision is ended by etcd (the caller re-lists) while
    another watch on the same stream keeps its events."""
    from elasticd.store import WatchCompacted
    import json
    import urllib.request

    store = Etcd3Store(etcd.endpoints, timeout=TIMEOUT, watch_transport="grpc")
    writer = Etcd3Store(etcd.endpoints, timeout=TIMEOUT)
    try:
        first = writer.put("/alone/old/a", "1")
        rev = writer.put("/alone/old/b", "2")
        urllib.request.urlopen(urllib.request.Request(
            etcd.url + "/v3/kv/compaction", method="POST",
            data=json.dumps({"revision": str(rev)}).encode()), timeout=5).read()
        live = Watcher(store, "/alone/live", rev)
        writer.put("/alone/live/1", "a")
        assert [e.value for e in live.wait_for(1)] == ["a"]
        with pytest.raises(WatchCompacted):
            list(store.watch("/alone/old", first - 1, timeout=5))
        writer.put("/alone/live/2", "b")
        assert [e.value for e in live.wait_for(2)] == ["a", "b"]
        assert live.error is None
        live.close()
    finally:
        writer.delete_prefix("/alone")
        store.close()
        writer.close()


class CountingChecks(Etcd3Store):
    checks = 0

    def _call(self, path, body, *args, **kwargs):
        if path == "/maintenance/status":
            self.checks += 1
        return super()._call(path, body, *args, **kwargs)


def _quiet_followers(store, name: str, n: int) -> list:
    """``n`` followers of prefixes nobody writes, started and synced."""
    followers = [Follower(store, f"/{name}/p{i}", f"{name}-{i}", 0.1, lambda kvs, rev: None,
                          lambda ev: None) for i in range(n)]
    for f in followers:
        f.start()
    for f in followers:
        assert f.synced.wait(10)
    return followers


@pytest.mark.parametrize("transport", ["grpc", "gateway"])
def test_quiet_watches_of_one_store_share_one_liveness_check(etcd, transport):
    """Eight quiet watches (a daemon running two jobs keeps about that many: nodes, drain
    marks, the job list, each job's rounds, phases and events) ask etcd whether it is
    alive once a watch_liveness period between them, not once each: a check serves
    every watch of the store."""
    store = CountingChecks(etcd.endpoints, timeout=TIMEOUT, watch_transport=transport,
                           watch_liveness=0.3)
    followers = _quiet_followers(store, "quiet", 8)
    try:
        time.sleep(2.0)      # about six periods: eight watches alone would make ~48 checks
        assert 1 <= store.checks <= 10, store.checks
    finally:
        for f in followers:
            f.stop()
        store.close()


@pytest.mark.parametrize("lease_transport", ["grpc", "gateway"])
def test_a_store_whose_lease_etcd_keeps_refreshing_asks_no_liveness_check(etcd,
                                                                          lease_transport):
    """A daemon refreshes its node lease every second: each refresh etcd answers is an
    answer to the liveness check its quiet watches would make, so they make none (an
    idle node costs etcd its keep-alives alone). Once the refreshes stop, the checks
    come back, one a period."""
    store = CountingChecks(etcd.endpoints, timeout=TIMEOUT, watch_transport="grpc",
                           lease_transport=lease_transport, watch_liveness=0.3)
    lease = store.grant_lease(10)
    followers = _quiet_followers(store, "leased", 4)
    try:
        for _ in range(20):      # 2 s, about six periods, a refresh every 0.1 s
            store.refresh_lease(lease)
            time.sleep(0.1)
        assert store.checks == 0, store.checks
        time.sleep(2.0)          # no refresh: the watches ask again
        assert 1 <= store.checks <= 10, store.checks
    finally:
        for f in followers:
            f.stop()
        store.revoke_lease(lease)
        store.close()


def test_a_channel_closed_under_a_watch_is_made_again_and_nothing_is_lost(etcd):
    """A stream that etcd never answered drops its channel; another watch of the same
    store may hold that channel at that moment, about to open a stream on it, or be
    reading a stream on it (CI saw ``Channel closed!`` escape as a ValueError). Both
    open a new channel and go on from their last revision."""
    store = Etcd3Store(etcd.endpoints, timeout=TIMEOUT, watch_transport="grpc")
    writer = Etcd3Store(etcd.endpoints, timeout=TIMEOUT)
    try:
        _, rev = writer.list("/closed")
        running = Watcher(store, "/closed/a", rev)
        writer.put("/closed/a/1", "1")
        assert [e.value for e in running.wait_for(1)] == ["1"]
        store._watch_channels._channels[etcd.url].close()   # closed, still the one held
        writer.put("/closed/a/2", "2")
        writer.put("/closed/b/1", "b")
        assert [e.value for e in running.wait_for(2)] == ["1", "2"]
        assert running.error is None
        assert [e.value for e in replay(store, "/closed/b", rev, count=1)] == ["b"]
        running.close()
    finally:
        writer.delete_prefix("/closed")
        store.close()
        writer.close()


class _StreamToTheFirst(Etcd3Store):
    """The worst case: the first list goes to the live member, the stream after it to
    the first endpoint (a member that hung since)."""
    unlucky = True

    def list(self, prefix):
        got = super().list(prefix)
        if self.unlucky:
            self.unlucky, self._current = False, 0
        return got


def test_a_member_that_takes_connections_and_never_answers_is_passed_over(etcd):
    """A hung host: the watch's liveness check (through the gateway, which moves on)
    ends the stream that waits for it, and the follower's next stream goes to the live
    member; the events since are all delivered."""
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)
        store = _StreamToTheFirst([f"http://127.0.0.1:{mute.getsockname()[1]}", etcd.url],
                                  timeout=TIMEOUT, watch_liveness=1.0, watch_transport="grpc")
        writer = Etcd3Store(etcd.endpoints, timeout=TIMEOUT)
        seen, arrived = [], threading.Event()

        def on_event(ev):
            seen.append((ev.key, ev.value))
            arrived.set()
        follower = Follower(store, "/mute", "test-watch", 0.2, lambda kvs, rev: None,
                            on_event)
        try:
            follower.start()
            assert follower.synced.wait(3 * TIMEOUT)   # its list went to the live member
            t0 = time.monotonic()
            writer.put("/mute/a", "1")
            assert arrived.wait(1.0 + 4 * TIMEOUT), "no event within the liveness + timeouts"
            assert seen == [("/mute/a", "1")] and not store.unlucky
            assert time.monotonic() - t0 < 1.0 + 4 * TIMEOUT
        finally:
            follower.stop()
            writer.delete_prefix("/mute")
            store.close()
            writer.close()


def test_watch_transport_is_a_validated_setting_the_daemon_passes_on(etcd, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    assert config.load(str(empty), env={}).membership.watch_transport == "grpc"
    with pytest.raises(config.ConfigError, match="membership.watch_transport"):
        config.load(str(empty), env={"ELASTICD_MEMBERSHIP_WATCH_TRANSPORT": "udp"})
    with pytest.raises(ValueError, match="watch_transport"):
        Etcd3Store(etcd.endpoints, watch_transport="udp")
    for transport in ("grpc", "gateway"):
        cfg = config.load(str(empty), env={}, overrides={
            "etcd.endpoints": etcd.endpoints, "etcd.api": "v3",
            "membership.watch_transport": transport})
        store = open_cluster_store(cfg)
        try:
            assert (store.inner._watch_channels is not None) == (transport == "grpc")
            rev = store.put("/wt/a", transport)
            assert [e.value for e in replay(store, "/wt", rev - 1, count=1)] == [transport]
        finally:
            store.delete_prefix("/wt")
            store.close()
