"""The loss witnesses: a few daemons that watch every node key's deletes and write each
loss where any daemon lists it.

Every daemon watched every node key's deletes: a loss of 100 of 1,000 nodes at once
was 90,000 deliveries, the survivors saw the last loss after 7-10 s and etcd's CPU
trebled (bench/README.md, scale_sim). What needs a loss at once does not need that
watch: a job's nodes see a member go by its join's delete (rendezvous/view.py). Only
`elasticctl nodes` lists every lost node, and for it ``membership.loss_witnesses``
daemons suffice.

Slots: ``/v1/witnesses/<slot>`` for slot 0 .. K-1, each created by one daemon under its
node lease, only where absent (the first daemons to start take them). Every daemon
watches the slots' deletes only (a witness's end: nothing else ever reaches it), and a
daemon without a slot tries the free ones when one goes, after a watch restart, and
every ``witness_list_interval`` (a slot held by garbage is deleted, never honoured). A
witness whose lease ends loses its slot with it.

A witness (state ``WITNESS``):

* watches ``/v1/nodes/``' deletes, from the revision its predecessor's slot went at
  (a node lost with that witness, in the same revision, is still seen) or from its
  list of the slots; membership.NodeWatcher ``went`` answers what it knew of the node
  (the record it last read, the id alone if none, nothing for a key whose record it
  refused: no daemon of this cluster wrote it);
* writes each loss to ``/v1/lost/<node>`` (cluster/lost.py; under no lease, every
  witness its own put: the row stands if any witness lives);
* every ``witness_list_interval`` lists the node records (what it will know of a node
  when it goes) and the lost rows, and deletes the rows older than
  ``lost_node_retention``, of a node live again, or refused.

One thread owns the state (a stop event and a wake, every wait bounded); the two
watches are Followers (store/follow.py) whose handlers only note and wake it, or write
one row.
"""
from __future__ import annotations

import enum
import json
import logging
import threading
import time
from typing import Callable

from ..fields import is_ident
from ..logsetup import ctx
from ..store import CompareFailed, KeyExists, Lease, Store, StoreError
from ..store.follow import Follower
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused
from .lost import LOST, LostNode, lost_key, open_lost
from .membership import NODES, NodeWatcher

log = logging.getLogger("elasticd.cluster.witness")

WITNESSES = "/v1/witnesses"


def slot_key(slot: int) -> str:
    return f"{WITNESSES}/{slot}"


class WitnessState(str, enum.Enum):
    BYSTANDER = "bystander"     # no slot: watches the slots' deletes only
    WITNESS = "witness"         # holds a slot: watches the node keys' deletes too


class LossWitness:
    def __init__(self, store: Store, node_id: str, nodes: NodeWatcher,
                 lease: Callable[[], Lease | None], *, records, slots: int, retry: float,
                 list_interval: float, retention: float, refusals: Refusals | None = None,
                 clock=time.time):
        self._store = store
        self._me = node_id
        self._nodes = nodes
        self._lease = lease
        self._records = records
        self._slots = slots
        self._retry = retry
        self._list_interval = list_interval
        self._retention = retention
        self._refusals = refusals or Refusals(ctx(node=node_id))
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._slot_follower = Follower(store, WITNESSES, "witness-slots", retry,
                                       self._slots_reset, self._slot_gone, deletes_only=True)
        self._node_follower: Follower | None = None
        self._lost_slot = False     # our slot's key went (the loop ends the watch)
        self._gone_at = 0           # revision the first slot went at since the last look
        self.state = WitnessState.BYSTANDER
        self.slot: int | None = None
        self.written = 0            # lost rows written (a count for tests and the bench)

    # -- the owner's loop ----------------------------------------------------------
    def start(self) -> None:
        self._slot_follower.start()
        self._thread = threading.Thread(target=self._run, name="loss-witness", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._slot_follower.request_stop()
        follower = self._node_follower
        if follower is not None:
            follower.request_stop()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=self._store.timeout * 3 + self._retry + 2)
        self._slot_follower.stop()
        follower = self._node_follower
        if follower is not None:
            follower.stop()

    def _run(self) -> None:
        next_look = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            try:
                if self._lost_slot:
                    self._step_down()
                if self.state is WitnessState.BYSTANDER:
                    self._take()
                    next_look = time.monotonic() + self._list_interval
                elif time.monotonic() >= next_look:
                    self._tend()
                    next_look = time.monotonic() + self._list_interval
            except StoreError as exc:
                log.debug("%s: loss witness: %s; trying again", ctx(node=self._me), exc)
                next_look = time.monotonic() + self._retry
            except Exception:   # a bug: logged, and the loop goes on
                log.exception("%s: loss witness failed", ctx(node=self._me))
                next_look = time.monotonic() + self._retry
            self._wake.wait(max(0.0, min(self._list_interval, next_look - time.monotonic())))

    def _take(self) -> None:
        """Take a free slot if there is one (our lease: none while we register)."""
        lease = self._lease()
        if lease is None:
            return
        with self._lock:
            gone_at = self._gone_at
        kvs, revision = self._store.list(WITNESSES)
        self._take_one(kvs, revision, gone_at, lease)
        with self._lock:      # looked (a slot taken, or none free): a later delete counts
            if self._gone_at == gone_at:
                self._gone_at = 0

    def _take_one(self, kvs, revision: int, gone_at: int, lease: Lease) -> None:
        """Of the slots listed (``kvs`` at ``revision``), become the witness of ours or
        of the first free one; garbage at a slot is deleted."""
        held = set()
        for kv in kvs:
            slot = kv.key[len(WITNESSES) + 1:]
            try:
                doc = self._records.open(Kind.WITNESS, kv.key, kv.value).doc
                if not slot.isdigit() or not isinstance(doc, dict) \
                        or not is_ident(doc.get("node_id")):
                    raise Refused(Reason.INVALID, "not a witness slot's record")
            except Refused as exc:
                self._refusals.refused(Kind.WITNESS, kv.key, exc.reason, exc.detail)
                if slot.isdigit() and int(slot) < self._slots:
                    try:          # garbage never holds a slot
                        self._store.delete(kv.key, prev_revision=kv.revision)
                    except CompareFailed:
                        pass
                continue
            if doc["node_id"] == self._me and int(slot) < self._slots:
                # ours: this daemon's (a state lost by an error), or its last process's
                # under its old lease (then it goes with that lease, and we look again)
                self._become(int(slot), (gone_at - 1) if gone_at else revision)
                return
            held.add(int(slot))
        for slot in range(self._slots):
            if slot in held:
                continue
            value = self._records.seal(Kind.WITNESS, slot_key(slot),
                                       json.dumps({"node_id": self._me}))
            try:
                self._store.create(slot_key(slot), value, lease=lease)
            except KeyExists:
                continue
            self._become(slot, (gone_at - 1) if gone_at else revision)
            return

    def _become(self, slot: int, since: int) -> None:
        self.slot, self._lost_slot = slot, False
        self._node_follower = Follower(self._store, NODES, "loss-witness-nodes", self._retry,
                                       lambda kvs, rev: None, self._node_gone,
                                       deletes_only=True, from_revision=since)
        self._node_follower.start()
        self.state = WitnessState.WITNESS
        log.info("%s: loss witness (slot %d): this daemon records the cluster's node "
                 "losses", ctx(node=self._me), slot)
        try:
            self._nodes.relist()      # what it will know of each node when it goes
        except StoreError as exc:     # the next tend lists them
            log.debug("%s: loss witness: listing the nodes: %s", ctx(node=self._me), exc)

    def _step_down(self) -> None:
        self._lost_slot = False
        follower, self._node_follower = self._node_follower, None
        if follower is not None:
            follower.stop()
        if self.state is WitnessState.WITNESS:
            log.info("%s: no longer a loss witness (slot %s went with this node's lease)",
                     ctx(node=self._me), self.slot)
        self.state, self.slot = WitnessState.BYSTANDER, None

    def _tend(self) -> None:
        """A witness's round: the node records listed again, old lost rows deleted (and
        those of a node listed live after its row was written: it came back)."""
        listed_at = self._clock()
        live = set(self._nodes.relist())
        kvs, _ = self._store.list(LOST)
        now = self._clock()
        for kv in kvs:
            try:
                row = open_lost(self._records, kv.key, kv.value)
                back = row.node_id in live and row.lost_at < listed_at
                if now - row.lost_at < self._retention and not back:
                    continue
            except Refused as exc:
                self._refusals.refused(Kind.LOST, kv.key, exc.reason, exc.detail)
            try:
                self._store.delete(kv.key, prev_revision=kv.revision)
            except CompareFailed:
                pass

    # -- the watches' handlers (their threads) -------------------------------------
    def _slots_reset(self, kvs, revision: int) -> None:
        self._wake.set()           # the slots' watch (re)started: a slot may have gone

    def _slot_gone(self, ev) -> None:
        with self._lock:      # the first slot gone since the last look: from there on
            self._gone_at = self._gone_at or ev.revision
        if self.slot is not None and ev.key == slot_key(self.slot):
            self._lost_slot = True
        self._wake.set()

    def _node_gone(self, ev) -> None:
        node = ev.key[len(NODES) + 1:]
        if not ev.key.startswith(NODES + "/") or not is_ident(node):
            return
        last = self._nodes.went(node, ev.revision)
        if last is None or node == self._me:
            # a key no daemon of this cluster wrote went; or our lease lapsed: our slot
            # went too, and the other witnesses record it
            return
        log.warning("%s: node %s lost (its lease expired or was revoked)",
                    ctx(node=self._me), node)
        row = LostNode(node, self._clock(), last, self._me)
        try:
            self._store.put(lost_key(node), row.seal(self._records))
        except StoreError as exc:     # the other witnesses write theirs
            log.warning("%s: could not record node %s's loss: %s", ctx(node=self._me),
                        node, exc)
            return
        self.written += 1
