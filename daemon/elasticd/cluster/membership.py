"""This node's lease key in etcd, and the cluster's node list.

``LeaseKeeper`` owns ``<prefix>/v1/nodes/<node-id>``: registered with a lease
at start (refusing a node id a live daemon holds), refreshed every
``membership.refresh_interval`` (the only steady-state write), rewritten
only when what it says changes, re-registered after an etcd outage, revoked
on a clean stop.

``NodeWatcher`` keeps the cluster view: it reads live records when asked and
lists the lost rows that the loss witnesses (cluster/witness.py, a few daemons
watching the node keys' deletes) write when a node's lease expires; they stay
listed for ``membership.lost_node_retention`` seconds so an operator sees what
happened.

A node record is sealed with the cluster key, bound to its key
(trust/sealed.py), and read in one place (``open_node``): a record that does
not verify, does not check, or is older than the one held for that node is
counted and logged once (trust/refusals.py) and changes nothing; the node
keeps the record last verified.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

from ..logsetup import ctx
from ..store import CompareFailed, KeyExists, Lease, LeaseNotFound, Store, StoreError
from ..fields import is_ident
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused
from .lost import LOST, lost_key, open_lost
from .node_record import NODES, node_key, open_node, parse_node

log = logging.getLogger("elasticd.cluster.membership")

DRAIN = "/v1/drain"


class NodeIdInUse(RuntimeError):
    pass


_MAX_REMEMBERED = 1 << 16    # nodes whose newest record's count is kept
ABSENT_KEPT = 4096            # nodes remembered as found without a record (record())
REGISTER_TRIES = 3            # looks at our key while it changes under a registration


class LeaseKeeper:
    def __init__(self, store: Store, node_id: str, ttl: int, interval: float,
                 info: Callable[[], dict], clock=time.time, *, records):
        self._store = store
        self._records = records     # seals our record (trust/sealed.py)
        self._node_id = node_id
        self._ttl = ttl
        self._interval = interval
        self._info = info
        self._clock = clock
        self._lease: Lease | None = None
        self._written: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.health = "registering"
        self.last_refresh = 0.0
        self.refreshes = 0
        self.reregistrations = 0
        self.errors = 0
        self._retry_at_once = False   # see _next_wait
        self.lease_lost_listeners: list[Callable[[], None]] = []  # called when it expired

    def _sealed(self, info: dict) -> str:
        key = node_key(self._node_id)
        return self._records.seal(Kind.NODE, key, json.dumps(info))

    # -- registration ----------------------------------------------------------
    def register(self) -> None:
        """Put our key under a new lease; NodeIdInUse if a live daemon holds it."""
        key = node_key(self._node_id)
        info = self._info()
        lease = self._store.grant_lease(self._ttl)
        # The key may change between a look and a write: our stale key expiring, another
        # daemon taking it. Look again, a few times; only a live daemon's record refuses.
        for _ in range(REGISTER_TRIES):
            try:
                self._store.create(key, self._sealed(info), lease=lease)
                break
            except KeyExists:
                pass
            current = self._store.get(key)
            if current is None:
                continue        # it expired meanwhile: create it
            theirs = parse_node(key, current.value, self._records)
            if theirs is not None and not _is_our_stale_key(theirs):
                self._store.revoke_lease(lease)
                raise NodeIdInUse(f"node id {self._node_id!r} is held by a live daemon (host "
                                  f"{theirs.get('host')}, pid {theirs.get('pid')}); "
                                  "give this one another --node-id") from None
            if theirs is None:
                # No daemon of this cluster writes a record we cannot vouch for: a
                # forgery or garbage, take the key over.
                log.warning("%s: replacing an unreadable record at %s", ctx(node=self._node_id),
                            key)
            # Our own key from before a crash: deleted, then created at the next look, so
            # every daemon hears it go (peers keep a record until its key is deleted).
            try:
                self._store.delete(key, prev_revision=current.revision)
            except CompareFailed:
                pass            # changed since the look: look again
        else:
            self._store.revoke_lease(lease)
            raise NodeIdInUse(f"node id {self._node_id!r} kept changing while this daemon "
                              f"registered ({REGISTER_TRIES} looks): is another daemon "
                              "starting with it?")
        self._lease, self._written = lease, info
        try:        # a lost row of this node from before (cluster/lost.py): it is back
            self._store.delete(lost_key(self._node_id))
        except StoreError as exc:
            log.debug("%s: deleting this node's lost row: %s (a witness prunes it)",
                      ctx(node=self._node_id), exc)
        self.last_refresh = self._clock()
        self.health = "ok"
        log.info("%s: registered in the cluster (lease %d s)", ctx(node=self._node_id),
                 self._ttl)

    @property
    def lease(self) -> Lease | None:
        """The node's current lease: keys that must vanish with this node use it."""
        return self._lease

    # -- the loop ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Our record changed (slots, jobs, state): write it at the next tick."""
        self._written = None

    def _run(self) -> None:
        took = 0.0
        while not self._stop.wait(self._next_wait(took)):
            began = time.monotonic()
            self.tick()
            took = time.monotonic() - began

    def _next_wait(self, took: float = 0.0) -> float:
        """Seconds before the next tick, counted from the start of the last one,
        which took ``took``: refreshes leave every interval however long each
        takes (on a link with 200 ms each way and loss, a refresh can take a
        second or two; waiting a whole interval after it as well let a healthy
        node's lease expire). After the first failure following a
        refresh, none: a refresh that hung on an unreachable member took up to
        a request timeout of the lease's TTL (config checks refresh interval +
        request timeout <= TTL), and the store already points at the next
        endpoint; waiting any longer lets the lease expire under a healthy
        cluster (a minority etcd member partitioned). Later failures: every
        half second at most, so a dead cluster is not hammered."""
        if self.health == "ok":
            return max(0.0, self._interval - took)
        if self._retry_at_once:
            self._retry_at_once = False
            return 0.0
        return max(0.0, min(self._interval, 0.5) - took)

    def tick(self) -> str:
        """One refresh cycle; returns what it did, in one sentence."""
        try:
            if self._lease is None:
                self.register()
                self.reregistrations += 1
                return "registered again after losing the lease"
            self._store.refresh_lease(self._lease)
            self.refreshes += 1
            self.last_refresh = self._clock()
            info = self._info()
            if info != self._written:
                self._store.put(node_key(self._node_id), self._sealed(info), lease=self._lease)
                self._written = info
            if self.health != "ok":
                log.info("%s: etcd reachable again; lease kept", ctx(node=self._node_id))
            self.health = "ok"
            return "refreshed the lease"
        except LeaseNotFound:
            log.warning("%s: our lease expired (etcd was unreachable too long); "
                        "registering again", ctx(node=self._node_id))
            self._lease = None
            for listener in self.lease_lost_listeners:   # the fault memory: quick, no I/O
                listener()
            self.errors += 1
            return self.tick() if not self._stop.is_set() else "stopping"
        except NodeIdInUse as exc:
            self.health = f"conflict: {exc}"
            log.error("%s: %s", ctx(node=self._node_id), exc)
            return "node id taken"
        except StoreError as exc:
            self.errors += 1
            if self.health == "ok":
                self._retry_at_once = True
                log.warning("%s: etcd unavailable: %s; jobs keep running, retrying",
                            ctx(node=self._node_id), exc)
            self.health = f"unavailable: {exc}"
            return "etcd unavailable"

    def stop(self) -> None:
        """Stop refreshing and revoke the lease so peers see us leave at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._store.timeout + self._interval + 1)
        if self._lease is not None:
            try:
                self._store.revoke_lease(self._lease)
            except StoreError as exc:
                log.warning("%s: could not revoke the lease: %s (it expires in %d s)",
                            ctx(node=self._node_id), exc, self._ttl)
            self._lease = None


def _is_our_stale_key(record: dict | None) -> bool:
    """A record this host wrote from a daemon process that no longer runs."""
    if not record or record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return isinstance(pid, int)
    try:
        proc = psutil.Process(pid)
        return "elasticd" not in " ".join(proc.cmdline())
    except psutil.Error:
        return True


@dataclass
class NodeView:
    live: dict = field(default_factory=dict)       # node id -> record
    lost: dict = field(default_factory=dict)       # node id -> (time lost, last record)


@dataclass(frozen=True)
class _Held:
    record: dict
    read_at: float      # monotonic


class NodeWatcher:
    """The cluster's nodes as this daemon needs them, without every record or every
    loss reaching it.

    A node record is rewritten whenever its free slots or jobs change; a watch of
    the records delivered each rewrite to every daemon (N x N at a cluster-wide
    cold start), and a watch of their deletes each loss to every daemon (a loss of
    100 of 1,000 nodes: 90,000 deliveries). No daemon watches the records; only
    the loss witnesses (cluster/witness.py) watch their deletes and tell this
    watcher (``went``), which answers the record it last read of the node (its id
    alone where it read none; nothing for a key whose record its last read
    refused: no daemon of this cluster wrote it). Live records are read when asked:
    ``snapshot()`` lists them all and the lost rows the witnesses wrote
    (`elasticctl nodes`); ``record(node)`` reads one and keeps it (a peer's
    replication port: replication/peers.py, the rendezvous' gone probe) for
    ``port_recheck`` seconds (a witness drops it when the key goes), or ``recheck``
    seconds if it publishes no replication port yet; a node found with no record is
    not read again for ``recheck`` seconds (a lost buddy is asked for each
    replication interval until the round moves on). A daemon taking over its own
    key after a crash deletes it first (``LeaseKeeper.register``)."""

    def __init__(self, store: Store, node_id: str, retention: float,
                 clock=time.time, *, records, refusals: Refusals | None = None,
                 recheck: float = 1.0, port_recheck: float = 10.0, list_wait: float = 0.3):
        self._store = store
        self._node_id = node_id
        self._retention = retention
        self._recheck = recheck
        self._port_recheck = port_recheck
        self._list_wait = list_wait
        self._listing: threading.Event | None = None   # set when the list in flight ends
        self._clock = clock
        self._records = records
        self._refusals = refusals or Refusals(ctx(node=node_id))
        self._lock = threading.Lock()
        self._view = NodeView()            # the last full list, and the lost rows
        self._held: dict[str, _Held] = {}  # node -> its record as last read
        self._absent: dict[str, float] = {}  # node -> when it was found without a record
        self._refused: set[str] = set()    # keys whose record the last read refused
        # node -> the revision a witness saw its key deleted at, until a list newer than
        # that (a list read before a delete and ended after it must not bring it back)
        self._deleted_at: dict[str, int] = {}
        # node -> writer's count of the newest record accepted (kept after the node
        # leaves: a record of it put back later is older)
        self._seqs: dict[str, int] = {}

    # -- reading ---------------------------------------------------------------
    def snapshot(self) -> NodeView:
        """Every live node's record and the lost rows within the retention. Both are
        listed now, waited for at most ``list_wait`` seconds (one list in flight at a
        time, in a thread of its own, bounded by the store's timeout); past it, or if
        etcd fails, the last list (the caller never blocks on a hung etcd)."""
        with self._lock:
            done = self._listing
            if done is None:
                done = self._listing = threading.Event()
                threading.Thread(target=self._list_once, args=(done,), name="node-list",
                                 daemon=True).start()
        done.wait(self._list_wait)
        with self._lock:
            now = self._clock()
            live = dict(self._view.live)
            lost = {k: v for k, v in self._view.lost.items()
                    if now - v[0] < self._retention and k not in live}
            return NodeView(live, lost)

    def record(self, node: str, fresh: bool = False) -> dict | None:
        """``node``'s live record: the one held, else read now (None: no live record, or
        etcd did not answer and none is held); ``fresh``: a node lately found without
        one is read again now (an operator's drain answers no node only after a look)."""
        with self._lock:
            held = self._held.get(node)
            absent = self._absent.get(node)
        now = time.monotonic()
        if held is not None and now - held.read_at < (
                self._port_recheck if held.record.get("replication_port") else self._recheck):
            return held.record
        if held is None and not fresh and absent is not None and now - absent < self._recheck:
            return None
        try:
            kv = self._store.get(node_key(node))
        except StoreError as exc:
            log.debug("%s: reading node %s: %s", ctx(node=self._node_id), node, exc)
            return held.record if held is not None else None
        if kv is None:
            with self._lock:
                self._held.pop(node, None)
                self._gone(node)
            return None
        record = self._verified(kv.key, kv.value, held.record if held else None)
        with self._lock:
            if record is not None:
                self._held[node] = _Held(record, time.monotonic())
                self._absent.pop(node, None)
                self._refused.discard(node)
            elif len(self._refused) < ABSENT_KEPT:
                self._refused.add(node)
        return record

    def relist(self) -> list[str]:
        """List the node records now (a loss witness, so it knows each node when it
        goes); the live nodes' ids. StoreError if etcd does not answer."""
        self._list()
        with self._lock:
            return list(self._view.live)

    def _gone(self, node: str) -> None:
        """``node`` has no record now; the caller holds the lock. What is older than
        ``recheck`` is forgotten as the table grows (any name may be asked for)."""
        now = time.monotonic()
        if len(self._absent) >= ABSENT_KEPT:
            self._absent = {n: t for n, t in self._absent.items() if now - t < self._recheck}
            while len(self._absent) >= ABSENT_KEPT:
                del self._absent[next(iter(self._absent))]
        self._absent[node] = now

    def _list_once(self, done: threading.Event) -> None:
        try:
            self._list()
            self._list_lost()
        except StoreError as exc:
            log.debug("%s: listing the nodes: %s; the last list stands",
                      ctx(node=self._node_id), exc)
        except Exception:   # a bug: the last list stands, the next call lists again
            log.exception("%s: listing the nodes failed", ctx(node=self._node_id))
        finally:
            with self._lock:
                self._listing = None
            done.set()

    def _list(self) -> None:
        kvs, revision = self._store.list(NODES)
        with self._lock:
            held = dict(self._view.live)
        live, refused = {}, set()
        for kv in kvs:
            node = kv.key.rsplit("/", 1)[-1]
            record = self._verified(kv.key, kv.value, held.get(node))
            if record is not None:
                live[node] = record
            else:
                refused.add(node)
        now = time.monotonic()
        with self._lock:
            # A witness may have told a delete after this list was read: that node is
            # gone, not live again. A refused key the list no longer has stays refused
            # until its delete comes (else its delete would be taken for a lost node).
            for node in [n for n, rev in self._deleted_at.items() if rev > revision]:
                live.pop(node, None)
                refused.discard(node)
            self._deleted_at = {n: rev for n, rev in self._deleted_at.items()
                                if rev > revision}
            self._view.live = live
            merged = (self._refused - set(live)) | refused
            self._refused = next((s for s in (merged, refused) if len(s) <= ABSENT_KEPT),
                                 set())
            for node, record in live.items():
                self._held[node] = _Held(record, now)
                self._absent.pop(node, None)

    def _list_lost(self) -> None:
        """The lost rows the witnesses wrote (cluster/lost.py); a refused one lists
        nothing."""
        kvs, _ = self._store.list(LOST)
        lost = {}
        for kv in kvs:
            try:
                row = open_lost(self._records, kv.key, kv.value)
            except Refused as exc:
                self._refusals.refused(Kind.LOST, kv.key, exc.reason, exc.detail)
                continue
            except Exception as exc:  # a bug: this key only
                self._refusals.refused(Kind.LOST, kv.key, Reason.ERROR, repr(exc), trace=True)
                continue
            lost[row.node_id] = (row.lost_at, row.record)
        with self._lock:
            self._view.lost = lost

    def _verified(self, key: str, value: str, held: dict | None) -> dict | None:
        """The record to hold for ``key`` now: the new one if it verifies and is not older
        than the held one, else the held one (None: none); a refusal is counted."""
        try:
            node = key[len(NODES) + 1:]
            if not key.startswith(NODES + "/") or not is_ident(node):
                raise Refused(Reason.BAD_KEY, "not a node key")
            record, seq = open_node(self._records, key, value)
            with self._lock:   # the same record read again is no replay; an older one is
                if seq and seq < self._seqs.get(node, 0):
                    raise Refused(Reason.REPLAYED, "older than the record this daemon holds")
                if seq:
                    self._seqs[node] = seq
                    if len(self._seqs) > _MAX_REMEMBERED:
                        self._seqs = {n: q for n, q in self._seqs.items()
                                      if n in self._held or n == node}
            return record
        except Refused as exc:
            self._refusals.refused(Kind.NODE, key, exc.reason, exc.detail)
        except Exception as exc:  # a bug: this key only, never the watch
            self._refusals.refused(Kind.NODE, key, Reason.ERROR, repr(exc), trace=True)
        return held

    # -- a witness's news ----------------------------------------------------------
    def went(self, node: str, revision: int) -> dict | None:
        """A loss witness saw ``node``'s key deleted at ``revision``: what this daemon
        knew of it (the record it last read; its id alone where it read none), or None
        when the key's record was refused at its last read (no node was lost)."""
        with self._lock:
            held = self._held.pop(node, None)
            listed = self._view.live.pop(node, None)
            refused = node in self._refused
            self._refused.discard(node)
            self._gone(node)
            if len(self._deleted_at) < ABSENT_KEPT:
                self._deleted_at[node] = revision
        last = held.record if held is not None else listed
        if last is None and refused:
            return None
        if node == self._node_id:  # our clean stop, or a lapse the lease keeper reports
            log.info("%s: this node's key is gone from the cluster", ctx(node=self._node_id))
        return last or {"node_id": node}
