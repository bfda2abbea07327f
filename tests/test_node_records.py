"""Node records read when asked, not watched (cluster/membership.py, issue 33): on a real
etcd, a NodeWatcher hears no rewrite of a record, keeps a peer's record until its key
is deleted, drops it when a daemon restarted after a crash takes its key back (with
another replication port), and lists a node lost with the record it last read (a delete
carries its key alone), a node it never read with its id alone, and a key whose record it
refused as no node at all.
"""
from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from etcd_server import EtcdServer, etcd_binary
from etcd_cluster import fresh_prefix, wait_for
from elasticd.cluster.membership import LeaseKeeper, NodeWatcher
from elasticd.store import open_store
from elasticd.trust.sealed import SealedRecords

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


class Counting:
    """The store, counting the events its watches deliver and its single-key reads."""

    def __init__(self, inner):
        self.inner = inner
        self.delivered = []
        self.gets = 0
        self.flowing = threading.Event()   # cleared: the watch's events wait (a late watch)
        self.flowing.set()
        self.lists_held = None             # a Semaphore: a list read waits for a release
        self.lists_read = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def list(self, prefix):
        got = self.inner.list(prefix)
        self.lists_read += 1
        if self.lists_held is not None:
            assert self.lists_held.acquire(timeout=30)
        return got

    def watch(self, *args, **kwargs):
        for ev in self.inner.watch(*args, **kwargs):
            self.flowing.wait()
            self.delivered.append(ev)
            yield ev


def _keeper(store, records, node: str, says: dict) -> LeaseKeeper:
    """A LeaseKeeper of ``node`` whose record says what ``says`` holds when it is written
    (its free slots, its replication port: none while that is 0)."""
    def info():
        return {"node_id": node, "host": socket.gethostname(), "address": "127.0.0.1",
                "slots": 4, "slots_free": says["slots_free"], "pid": os.getpid(),
                "lease_ttl": 3, "jobs": [],
                **({"replication_port": says["port"]} if says["port"] else {})}
    return LeaseKeeper(store, node, 3, 0.5, info, records=records)


def _world(etcd, recheck: float):
    """(records, a store for the peer, n-a's counted store, n-a's NodeWatcher) under a
    prefix of their own."""
    prefix = fresh_prefix()
    records = SealedRecords(b"k" * 32, prefix)
    mine = Counting(open_store("etcd3", etcd.endpoints, prefix=prefix))
    return (records, open_store("etcd3", etcd.endpoints, prefix=prefix), mine,
            NodeWatcher(mine, "n-a", 3600, 0.2, records=records, recheck=recheck))


def test_a_peers_record_is_read_once_kept_until_its_key_goes_and_lost_with_its_last(etcd):
    records, store, mine, watcher = _world(etcd, recheck=0.5)
    says = {"slots_free": 4, "port": 7001}
    peer = _keeper(store, records, "n-b", says)
    try:
        watcher.start()
        assert watcher.synced.wait(10)
        peer.register()
        assert watcher.record("n-b")["replication_port"] == 7001
        assert mine.gets == 1
        # Its record rewritten (its free slots changed): never delivered, and the
        # record kept is used without reading again.
        for slots in (3, 2, 1):
            says["slots_free"] = slots
            assert peer.tick() == "refreshed the lease"
        assert store.get("/v1/nodes/n-b") is not None
        time.sleep(0.5)
        assert mine.delivered == [], mine.delivered
        assert watcher.record("n-b")["slots_free"] == 4 and mine.gets == 1
        # `nodes` lists them now (a list is waited for 0.3 s; past it, the last one).
        wait_for(lambda: watcher.snapshot().live.get("n-b", {}).get("slots_free") == 1, 10,
                 what="n-b listed with 1 slot free")
        # The daemon crashes and another starts with the same id (its key still under
        # the dead one's lease) and another port: it takes the key back by deleting it,
        # and the peer reads the new record.
        again = _keeper(store, records, "n-b", {**says, "port": 7002})
        again.register()
        wait_for(lambda: (watcher.record("n-b") or {}).get("replication_port") == 7002, 10,
                 what="the peer reading the restarted daemon's record")
        # A clean stop: the key is revoked; the node is listed lost with its last record.
        again.stop()
        wait_for(lambda: "n-b" in watcher.snapshot().lost, 10, what="n-b listed lost")
        view = watcher.snapshot()
        assert "n-b" not in view.live and watcher.record("n-b") is None
        assert view.lost["n-b"][1]["replication_port"] == 7002
        assert all(ev.value is None for ev in mine.delivered), mine.delivered
    finally:
        watcher.stop()
        store.close()
        mine.close()


def test_a_record_without_a_replication_port_is_read_again_after_the_recheck(etcd):
    records, store, mine, watcher = _world(etcd, recheck=0.3)
    says = {"slots_free": 4, "port": 0}
    peer = _keeper(store, records, "n-b", says)
    try:
        peer.register()
        assert "replication_port" not in watcher.record("n-b")
        assert watcher.record("n-b") is not None and mine.gets == 1   # kept within it
        says["port"] = 7003        # it listens now
        peer.poke()
        peer.tick()
        time.sleep(0.35)
        assert watcher.record("n-b")["replication_port"] == 7003 and mine.gets == 2
    finally:
        peer.stop()
        store.close()
        mine.close()


def test_a_node_without_a_record_is_read_again_only_after_the_recheck(etcd):
    """A lost buddy is asked for each replication interval until the round moves on: one
    read of etcd a recheck period, not one a call. A drain (fresh) looks again at once,
    and a node that registers is read after the period."""
    records, store, mine, watcher = _world(etcd, recheck=0.5)
    says = {"slots_free": 4, "port": 7004}
    peer = _keeper(store, records, "n-c", says)
    try:
        watcher.start()
        assert watcher.synced.wait(10)
        for _ in range(20):
            assert watcher.record("n-c") is None
        assert mine.gets == 1
        assert watcher.record("n-c", fresh=True) is None and mine.gets == 2
        peer.register()
        assert watcher.record("n-c") is None and mine.gets == 2   # within the period
        time.sleep(0.55)
        assert watcher.record("n-c")["replication_port"] == 7004 and mine.gets == 3
        # Its key deleted (a clean stop): the record last read lists it lost, and
        # asking for it reads etcd no more than once a period.
        peer.stop()
        wait_for(lambda: "n-c" in watcher.snapshot().lost, 10, what="n-c listed lost")
        gets = mine.gets
        for _ in range(20):
            assert watcher.record("n-c") is None
        assert mine.gets == gets
        time.sleep(0.55)
        assert watcher.record("n-c") is None and mine.gets == gets + 1
    finally:
        watcher.stop()
        store.close()
        mine.close()


def test_a_node_never_read_is_lost_by_its_id_and_a_refused_key_is_no_node(etcd):
    """A delete carries its key alone: a node whose record this daemon never read is
    listed lost by its id (and its listeners told), one it read with that record; a key
    whose record it refused at its last list lists nothing when it goes."""
    records, store, mine, watcher = _world(etcd, recheck=0.5)
    told = []
    watcher.listeners.append(lambda node, record: told.append((node, record)))
    unread = _keeper(store, records, "n-d", {"slots_free": 4, "port": 7005})
    listed = _keeper(store, records, "n-e", {"slots_free": 2, "port": 7006})
    try:
        watcher.start()
        assert watcher.synced.wait(10)
        listed.register()
        store.put("/v1/nodes/n-f", "not a sealed record")
        wait_for(lambda: set(watcher.snapshot().live) == {"n-e"}, 10,
                 what="n-e listed, n-f refused")
        unread.register()
        for keeper in (unread, listed):
            keeper.stop()
        store.delete("/v1/nodes/n-f")
        wait_for(lambda: {"n-d", "n-e"} <= set(watcher.snapshot().lost), 10,
                 what="n-d and n-e listed lost")
        time.sleep(0.3)          # the garbage's delete, after both, has come by now
        lost = watcher.snapshot().lost
        assert set(lost) == {"n-d", "n-e"}, lost
        assert lost["n-d"][1] == {"node_id": "n-d"}
        assert lost["n-e"][1]["slots_free"] == 2 and lost["n-e"][1]["replication_port"] == 7006
        assert sorted(node for node, record in told) == ["n-d", "n-e"]
        assert all(ev.value is None for ev in mine.delivered), mine.delivered
    finally:
        watcher.stop()
        store.close()
        mine.close()


def test_a_list_and_the_watch_in_either_order_agree_on_what_went(etcd):
    """A list read after a delete whose event the watch has not told yet, or read before
    a delete it has told, never undoes what the watch says: a refused key gone from the
    list is still no node when its delete comes, and a deleted node is not live again."""
    records, store, mine, watcher = _world(etcd, recheck=0.5)
    peer = _keeper(store, records, "n-e", {"slots_free": 2, "port": 7006})
    try:
        watcher.start()
        assert watcher.synced.wait(10)
        peer.register()
        store.put("/v1/nodes/n-f", "not a sealed record")
        wait_for(lambda: set(watcher.snapshot().live) == {"n-e"}, 10, what="n-e listed")
        # The watch late: the garbage's delete is listed before it is told.
        mine.flowing.clear()
        store.delete("/v1/nodes/n-f")
        read = mine.lists_read      # one list in flight at a time: when the second after
        wait_for(lambda: watcher.snapshot() and mine.lists_read >= read + 2, 10,
                 what="a list read after the delete")       # it starts, the first ended
        mine.flowing.set()
        wait_for(lambda: any(ev.key.endswith("/n-f") for ev in mine.delivered), 10,
                 what="n-f's delete told")
        # A list read while n-e was live, answered after its delete was told.
        mine.lists_held = threading.Semaphore(0)
        read = mine.lists_read
        reading = threading.Thread(target=watcher.snapshot)
        reading.start()
        wait_for(lambda: mine.lists_read > read, 10, what="the list read")
        peer.stop()
        wait_for(lambda: any(ev.key.endswith("/n-e") for ev in mine.delivered), 10,
                 what="n-e's delete told")
        mine.lists_held.release()           # the list read before the delete ends now
        reading.join(10)
        view = watcher.snapshot()           # its list waits: the view is the old list's
        assert set(view.live) == set() and set(view.lost) == {"n-e"}, view
        mine.lists_held.release()
    finally:
        watcher.stop()
        store.close()
        mine.close()
