"""The daemon's place in the cluster: store, lease keeper, node watcher, drain marks.

Standalone mode runs the very same parts on the in-memory store, so a
single node and a cluster differ only in where the keys live. Node records
and drain marks are sealed with the cluster key (trust/sealed.py); a drain
mark that does not verify is counted, logged once and ignored (the node
keeps the mark, or the lack of one, last verified).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from urllib.parse import urlparse

from .. import __version__
from ..config import Config
from ..logsetup import ctx
from .faults import MAX_LINE, MAX_REASONS, reason_lines
from .membership import DRAIN, LeaseKeeper, NodeWatcher
from .witness import LossWitness
from ..store import EVENT_PUT, Store, StoreAuthError, StoreError, StoreUnavailable, open_store
from ..store.follow import Follower
from .. import fields
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused

log = logging.getLogger("elasticd.cluster.node")

MAX_JOBS_LISTED = 2000   # job ids in this node's record (it stays under what readers take)


class ClusterStartError(RuntimeError):
    pass


def open_cluster_store(cfg: Config) -> Store:
    """The store the config names; waits up to membership.startup_timeout for etcd."""
    if cfg.daemon.standalone:
        return open_store("memory", prefix=cfg.etcd.prefix)
    e = cfg.etcd
    password = None
    if e.password_file:
        with open(e.password_file) as fh:
            password = fh.read().strip()
    kind = {"auto": "auto", "v3": "etcd3", "v2": "etcd2"}[e.api]
    deadline = time.monotonic() + cfg.membership.startup_timeout
    while True:
        try:
            return open_store(kind, e.endpoints, prefix=e.prefix, timeout=e.request_timeout,
                              ca_cert=e.ca_cert or None, cert=e.cert or None,
                              key=e.key or None, username=e.username or None,
                              password=password,
                              lease_transport=cfg.membership.lease_transport,
                              watch_transport=cfg.membership.watch_transport)
        except StoreAuthError as exc:
            raise ClusterStartError(f"etcd at {', '.join(e.endpoints)} refused us: {exc} "
                                    "(check etcd.ca_cert, etcd.cert/key, etcd.username)") from None
        except StoreError as exc:
            if time.monotonic() >= deadline:
                raise ClusterStartError(
                    f"cannot reach etcd at {', '.join(e.endpoints)} within "
                    f"{cfg.membership.startup_timeout:g}s: {exc}") from None
            time.sleep(0.5)


def advertised_address(cfg: Config) -> str:
    """The address peers should use for this node (MASTER_ADDR when rank 0 is here)."""
    if cfg.daemon.address:
        return cfg.daemon.address
    if cfg.daemon.standalone:
        return "127.0.0.1"
    host = urlparse(cfg.etcd.endpoints[0]).hostname or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 2379))  # no packet is sent; this only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Cluster:
    def __init__(self, cfg: Config, store: Store, *, records, refusals: Refusals | None = None):
        self.cfg = cfg
        self.store = store
        self._records = records       # trust/sealed.py: node records and drain marks
        self._refusals = refusals or Refusals(ctx(node=cfg.daemon.node_id))
        self.address = advertised_address(cfg)
        # What the node record reads from the job manager: set by capacity_from.
        self._slots_info = None                # () -> (slots_free, [job ids])
        self._gpu_info = None                  # () -> the GPU fields of the record
        self._started_at = time.time()
        self.replication_port = 0    # replication/receiver.py's, once it listens
        m = cfg.membership
        self.keeper = LeaseKeeper(store, cfg.daemon.node_id, m.lease_ttl, m.refresh_interval,
                                  self.record, records=records)
        self.watcher = NodeWatcher(store, cfg.daemon.node_id, m.lost_node_retention,
                                   records=records, refusals=self._refusals,
                                   recheck=m.record_recheck,
                                   port_recheck=m.port_record_recheck, list_wait=m.list_wait)
        self.witness = LossWitness(store, cfg.daemon.node_id, self.watcher,
                                   lambda: self.keeper.lease, records=records,
                                   slots=m.loss_witnesses, retry=m.watch_retry,
                                   list_interval=m.witness_list_interval,
                                   retention=m.lost_node_retention, refusals=self._refusals)
        self._drains: dict[str, dict] = {}
        self._drain_lock = threading.Lock()
        self._drains_loaded = False
        self._drain_follower = Follower(store, DRAIN, "drain-watch", m.watch_retry,
                                        self._drain_reset, self._drain_event)

    def daemon_port(self, node_id: str) -> int:
        """The replication port ``node_id``'s live node record publishes (0: none)."""
        return (self.watcher.record(node_id) or {}).get("replication_port", 0)

    def capacity_from(self, slots_info, gpu_info=None) -> None:
        """Where this node's record reads its free slots and its jobs: ``() ->
        (slots_free, [job ids])``, the job manager's (made after the cluster,
        which it needs), and its GPU fields (``() -> dict``, gpus.py); set before
        ``start``."""
        self._slots_info = slots_info
        self._gpu_info = gpu_info

    @property
    def kind(self) -> str:
        """The store's kind (memory, etcd2, etcd3), through any wrapper around it."""
        return self.store.name

    def record(self) -> dict:
        free, jobs = self._slots_info()
        return {"node_id": self.cfg.daemon.node_id, "host": socket.gethostname(),
                "address": self.address, "slots": self.cfg.daemon.slots, "slots_free": free,
                "version": __version__, "started_at": self._started_at, "pid": os.getpid(),
                "lease_ttl": self.cfg.membership.lease_ttl,
                "jobs": sorted(jobs)[:MAX_JOBS_LISTED],
                **({"replication_port": self.replication_port} if self.replication_port
                   else {}),
                **(self._gpu_info() if self._gpu_info else {})}

    def start(self) -> None:
        """Register (NodeIdInUse if the id is taken) and start the loops."""
        try:
            self.keeper.register()
        except StoreUnavailable as exc:
            log.warning("etcd unavailable at start (%s); registering when it returns", exc)
            self.keeper.health = f"unavailable: {exc}"
        self.keeper.start()
        self.witness.start()
        self._drain_follower.start()

    def request_stop(self) -> None:
        """The watches start winding down (each sees it within a watch poll)."""
        self._drain_follower.request_stop()
        self.witness.request_stop()

    def stop(self) -> None:
        """Stop the lease and the watches; the store stays open (its opener,
        node/daemon.py, closes it once, after every part that uses it stopped)."""
        self.request_stop()
        self.keeper.stop()
        self._drain_follower.stop()
        self.witness.stop()

    def health(self) -> str:
        return self.keeper.health

    def drain_states(self) -> dict[str, dict]:
        """Drain marks by node id, as last seen by the drain watch (no etcd call)."""
        with self._drain_lock:
            return dict(self._drains)

    def _drain_record(self, key: str, value: str | None, held: dict | None) -> dict | None:
        """The drain mark to hold for ``key``: the new one if it verifies, else the one
        held (a refusal counted and logged once)."""
        try:
            if not key.startswith(DRAIN + "/") or not fields.is_ident(key[len(DRAIN) + 1:]):
                raise Refused(Reason.BAD_KEY, "not a drain key")
            doc = self._records.open(Kind.DRAIN, key, value).doc
            try:
                if doc.get("state") != "draining":
                    raise ValueError("state: not draining")
                return {"state": "draining", "by": fields.text(doc, "by", 500, ""),
                        "at": fields.real(doc, "at", 0.0, 1e11, 0.0), "reasons": reason_lines(doc)}
            except ValueError as exc:
                raise Refused(Reason.INVALID, str(exc)) from None
        except Refused as exc:
            self._refusals.refused(Kind.DRAIN, key, exc.reason, exc.detail)
        except Exception as exc:  # a bug: this key only, never the watch
            self._refusals.refused(Kind.DRAIN, key, Reason.ERROR, repr(exc), trace=True)
        return held

    def _drain_reset(self, kvs: list, revision: int) -> None:
        with self._drain_lock:
            held = dict(self._drains)
        marks = {}
        for kv in kvs:
            node = kv.key.rsplit("/", 1)[-1]
            record = self._drain_record(kv.key, kv.value, held.get(node))
            if record is not None:
                marks[node] = record
        with self._drain_lock:
            self._drains = marks
            self._drains_loaded = True

    def _drain_event(self, ev) -> None:
        node = ev.key.rsplit("/", 1)[-1]
        with self._drain_lock:
            held = self._drains.get(node)
        if ev.type != EVENT_PUT:
            if ev.key == f"{DRAIN}/{node}":
                with self._drain_lock:
                    self._drains.pop(node, None)
            return
        record = self._drain_record(ev.key, ev.value, held)
        with self._drain_lock:
            if record is not None:
                self._drains[node] = record

    def drains_loaded(self) -> bool:
        """Whether the drain watch has read etcd's marks at least once."""
        with self._drain_lock:
            return self._drains_loaded

    def set_drain(self, node_id: str, draining: bool, by: str, reasons: tuple = ()) -> None:
        """Mark ``node_id`` draining (``reasons``: a quarantine's, cluster/quarantine.py)
        or ready again."""
        key = f"{DRAIN}/{node_id}"
        said = [r[:MAX_LINE] for r in reasons[:MAX_REASONS]]
        record = {"state": "draining", "by": by[:500], "at": time.time(), "reasons": said}
        if draining:
            self.store.put(key, self._records.seal(Kind.DRAIN, key, json.dumps(record)))
            record["reasons"] = tuple(said)
        else:
            self.store.delete(key)
        with self._drain_lock:  # the watch confirms it a moment later
            if draining:
                self._drains[node_id] = record
            else:
                self._drains.pop(node_id, None)
        if node_id == self.cfg.daemon.node_id:
            self.keeper.poke()
