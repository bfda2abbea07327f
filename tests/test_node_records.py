"""Node records read when asked, not watched, and losses recorded by a few witnesses
(cluster/membership.py, cluster/witness.py, issue 33): on a real etcd, a NodeWatcher
hears no rewrite of a record, keeps a peer's record until a witness sees its key
deleted (or a recheck period passes), drops it when a daemon restarted after a crash
takes its key back (with another replication port), and lists a node lost with the
record its witness last read (a delete carries its key alone), a node it never read
with its id alone, and a key whose record it refused as no node at all. A loss reaches
the witnesses' watches alone, and every daemon lists it.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from etcd_server import EtcdServer, etcd_binary
from etcd_cluster import fresh_prefix, wait_for
from elasticd.cluster.membership import LeaseKeeper, NodeWatcher
from elasticd.cluster.witness import LossWitness, WitnessState
from elasticd.store import open_store
from elasticd.trust.sealed import Kind, SealedRecords

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
        self.lists_held = None             # a Semaphore: a node list read waits for one
        self.lists_read = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        self.gets += 1
        return self.inner.get(key)

    def list(self, prefix):
        got = self.inner.list(prefix)
        if prefix == "/v1/nodes":           # the node records' lists alone
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


class Daemon:
    """What a daemon runs of membership: its lease keeper, its NodeWatcher and its loss
    witness, on a counted store of its own."""

    def __init__(self, etcd, prefix: str, records, node: str, slots: int = 3,
                 recheck: float = 1.0, port_recheck: float = 10.0, tend: float = 30.0):
        self.store = Counting(open_store("etcd3", etcd.endpoints, prefix=prefix))
        self.keeper = _keeper(self.store, records, node, {"slots_free": 4, "port": 0})
        self.watcher = NodeWatcher(self.store, node, 3600, records=records, recheck=recheck,
                                   port_recheck=port_recheck)
        self.witness = LossWitness(self.store, node, self.watcher, lambda: self.keeper.lease,
                                   records=records, slots=slots, retry=0.2,
                                   list_interval=tend, retention=3600)

    def start(self) -> "Daemon":
        self.keeper.register()
        self.witness.start()
        return self

    def close(self) -> None:
        self.witness.stop()
        self.keeper.stop()
        self.store.close()

    def node_deletes(self) -> list[str]:
        return [ev.key.rsplit("/", 1)[-1] for ev in self.store.delivered
                if ev.key.startswith("/v1/nodes/")]


def _world(etcd, recheck: float):
    """(records, a store for the peer, n-a's counted store, n-a's NodeWatcher, n-a) under
    a prefix of their own: n-a is its cluster's only daemon, so its loss witness."""
    prefix = fresh_prefix()
    records = SealedRecords(b"k" * 32, prefix)
    me = Daemon(etcd, prefix, records, "n-a", recheck=recheck)
    return (records, open_store("etcd3", etcd.endpoints, prefix=prefix), me.store,
            me.watcher, me)


def _witnessing(me: Daemon) -> None:
    me.start()
    wait_for(lambda: me.witness.state is WitnessState.WITNESS, 10, what="n-a a witness")


def test_a_peers_record_is_read_once_kept_until_its_key_goes_and_lost_with_its_last(etcd):
    records, store, mine, watcher, me = _world(etcd, recheck=0.5)
    says = {"slots_free": 4, "port": 7001}
    peer = _keeper(store, records, "n-b", says)
    try:
        _witnessing(me)
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
        me.close()
        store.close()


def test_a_record_without_a_replication_port_is_read_again_after_the_recheck(etcd):
    records, store, mine, watcher, me = _world(etcd, recheck=0.3)
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
        me.close()
        store.close()


def test_a_node_without_a_record_is_read_again_only_after_the_recheck(etcd):
    """A lost buddy is asked for each replication interval until the round moves on: one
    read of etcd a recheck period, not one a call. A drain (fresh) looks again at once,
    and a node that registers is read after the period."""
    records, store, mine, watcher, me = _world(etcd, recheck=0.5)
    says = {"slots_free": 4, "port": 7004}
    peer = _keeper(store, records, "n-c", says)
    try:
        _witnessing(me)
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
        me.close()
        store.close()


def test_a_node_never_read_is_lost_by_its_id_and_a_refused_key_is_no_node(etcd):
    """A delete carries its key alone: a node whose record this daemon never read is
    listed lost by its id (its witness writes its lost row), one it read with that record; a key
    whose record it refused at its last list lists nothing when it goes."""
    records, store, mine, watcher, me = _world(etcd, recheck=0.5)
    unread = _keeper(store, records, "n-d", {"slots_free": 4, "port": 7005})
    listed = _keeper(store, records, "n-e", {"slots_free": 2, "port": 7006})
    try:
        _witnessing(me)
        listed.register()
        store.put("/v1/nodes/n-f", "not a sealed record")
        wait_for(lambda: set(watcher.snapshot().live) == {"n-a", "n-e"}, 10,
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
        assert me.witness.written == 2                      # no row for n-f
        assert all(ev.value is None for ev in mine.delivered), mine.delivered
    finally:
        me.close()
        store.close()


def test_a_list_and_the_watch_in_either_order_agree_on_what_went(etcd):
    """A list read after a delete whose event the witness's watch has not told yet, or
    read before a delete it has told, never undoes what the watch says: a refused key
    gone from the list is still no node when its delete comes, and a deleted node is not
    live again."""
    records, store, mine, watcher, me = _world(etcd, recheck=0.5)
    peer = _keeper(store, records, "n-e", {"slots_free": 2, "port": 7006})
    try:
        _witnessing(me)
        peer.register()
        store.put("/v1/nodes/n-f", "not a sealed record")
        wait_for(lambda: set(watcher.snapshot().live) == {"n-a", "n-e"}, 10,
                 what="n-e listed")
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
        assert set(view.live) == {"n-a"}, view
        mine.lists_held.release()
        mine.lists_held = None
        wait_for(lambda: set(watcher.snapshot().lost) == {"n-e"}, 10, what="n-e lost")
    finally:
        me.close()
        store.close()


def test_a_loss_reaches_the_witnesses_alone_and_every_daemon_lists_it(etcd):
    """Five daemons, two witness slots: a node's loss is delivered to the two witnesses'
    watches alone, every daemon lists it lost with its record, and its row goes when it
    registers again. Both witnesses gone at once (their leases revoked): two others
    take the slots and still record both losses (their watches start from the
    revision the first slot went at)."""
    prefix = fresh_prefix()
    records = SealedRecords(b"k" * 32, prefix)
    daemons = [Daemon(etcd, prefix, records, f"n-{i}", slots=2) for i in range(5)]
    try:
        for d in daemons:
            d.start()
        wait_for(lambda: sum(d.witness.state is WitnessState.WITNESS for d in daemons) == 2,
                 10, what="two witnesses")
        witnesses = [d for d in daemons if d.witness.state is WitnessState.WITNESS]
        others = [d for d in daemons if d not in witnesses]
        assert sorted(w.witness.slot for w in witnesses) == [0, 1]
        victim, others = others[-1], others[:-1]
        name = victim.keeper._node_id
        for w in witnesses:      # as each witness's periodic list does
            wait_for(lambda: name in w.watcher.snapshot().live, 10, what=f"{name} listed")
        victim.close()
        for d in witnesses + others:
            wait_for(lambda: name in d.watcher.snapshot().lost, 10,
                     what=f"{name} listed lost")
            row = d.watcher.snapshot().lost[name][1]
            assert row["slots_free"] == 4 and row["host"], row     # the record it had
        assert [w.node_deletes() for w in witnesses] == [[name], [name]]
        assert [d.node_deletes() for d in others] == [[], []]
        # It comes back: its lost row goes.
        back = Daemon(etcd, prefix, records, name, slots=2).start()
        daemons.append(back)
        wait_for(lambda: name not in others[0].watcher.snapshot().lost, 10,
                 what=f"{name} no longer lost")
        assert name in others[0].watcher.snapshot().live
        # Both witnesses die at once: their watches stop, then their leases go.
        gone = [w.keeper._node_id for w in witnesses]
        for w in witnesses:
            w.witness.stop()
        for w in witnesses:
            w.keeper.stop()
        wait_for(lambda: sum(d.witness.state is WitnessState.WITNESS
                             for d in others + [back]) == 2, 10, what="two new witnesses")
        for d in others + [back]:
            wait_for(lambda: set(gone) <= set(d.watcher.snapshot().lost), 10,
                     what="both old witnesses listed lost")
    finally:
        for d in daemons:
            d.close()


def test_garbage_holds_no_witness_slot_and_lists_no_lost_node(etcd):
    """Values no daemon of this cluster wrote, at both witness slots and as lost rows: the
    first daemon deletes the slots' garbage and takes one; the forged rows list nothing,
    and a witness's tend deletes them."""
    prefix = fresh_prefix()
    records = SealedRecords(b"k" * 32, prefix)
    attacker = open_store("etcd3", etcd.endpoints, prefix=prefix)
    other = SealedRecords(b"x" * 32, prefix)      # another cluster's key
    attacker.put("/v1/witnesses/0", '{"node_id": "evil"}')
    attacker.put("/v1/witnesses/1", other.seal(Kind.WITNESS, "/v1/witnesses/1",
                                               json.dumps({"node_id": "evil"})))
    attacker.put("/v1/lost/n-z", json.dumps({"node_id": "n-z", "lost_at": time.time()}))
    attacker.put("/v1/lost/n-y", records.seal(Kind.LOST, "/v1/lost/n-x", json.dumps(
        {"node_id": "n-x", "lost_at": time.time(), "record": {"node_id": "n-x"},
         "witness": "n-a"})))                     # a genuine row moved to another key
    me = Daemon(etcd, prefix, records, "n-a", slots=2, tend=1.0)
    try:
        _witnessing(me)
        assert me.witness.slot in (0, 1)
        assert me.watcher.snapshot().lost == {}
        wait_for(lambda: attacker.list("/v1/lost")[0] == [], 10, what="the forged rows gone")
    finally:
        me.close()
        attacker.close()
