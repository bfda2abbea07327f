"""Which cluster jobs this node takes on.

Every daemon watches the job list (rendezvous.view.JobsView): each job's
spec and a copy of its round state, not its joins. The dispatcher adopts a
job submitted on another node when this node may and can run it: not
draining, named by the job (or the job names no nodes), enough free slots,
and the job's round not already at its max nodes (counted from its joins,
read from the job's rounds only once the rest says yes; a round found full
is not read again for ``FULL_KEPT`` intervals unless its state changes). It
also ends the local record of a job that ended elsewhere while it waited
here. ``eligible()`` decides without I/O.

It also reports, once each, the specs this node refuses: those the jobs
view could not verify or validate (``JobKeys.rejection``) and those whose
user this node does not run from the cluster (``ClusterPolicy``): a log
line, ``elasticd_cluster_specs_rejected_total{reason}``, and a ``rejected``
event in the local registry (``elasticctl events``); ``status`` reads the
rejection from the view.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from ..gpus.alloc import needed
from ..jobs.spec import JobSpec
from ..logsetup import ctx
from ..trust.rejections import RejectReason, Rejection
from ..rendezvous.protocol import CLOSED, OPEN
from ..store import StoreError

log = logging.getLogger("elasticd.cluster.dispatch")

FULL_KEPT = 5      # dispatch intervals a job's round read full is not read again


def eligible(spec: JobSpec, state, joined: int, node_id: str, free_slots: int, draining: bool,
             daemon_uid: int, free_gpus: int = 0, node_gpus: int = 0,
             hold_back: float = 0.0, now: float = 0.0) -> tuple[bool, str]:
    """(whether this node should join the job, why not). ``joined``: the nodes in the
    job's round (its joins; a closed round's spares stand by among them). A job takes
    up to its max nodes plus its spares. ``free_gpus`` of the node's ``node_gpus``: the
    job takes gpu_alloc.needed() of them. ``hold_back`` (a suspect node,
    cluster/suspicion.py): join only a round open (or closed) for at least that many
    seconds at ``now``, so other nodes go first."""
    if draining:
        return False, "this node is draining"
    if spec.nodes and node_id not in spec.nodes:
        return False, "the job names other nodes"
    nproc, max_nodes, uid = spec.nproc_per_node, spec.max_nodes, spec.uid
    if nproc > free_slots:
        return False, f"needs {nproc} slots, {free_slots} free"
    gpus = needed(spec.gpus_per_node, nproc, node_gpus)
    if gpus > free_gpus:
        return False, f"needs {gpus} GPUs, {free_gpus} free of {node_gpus}"
    spares = spec.spares
    plus = f" and its {spares} spare(s)" if spares else ""
    if state.status == OPEN and joined >= max_nodes + spares:
        return False, f"its round already has its max nodes{plus}"
    if state.status == CLOSED and max(joined, len(state.member_ids())) >= max_nodes + spares:
        return False, f"it already runs on its max nodes{plus}"
    if state.status not in (OPEN, CLOSED):
        return False, f"it is {state.status}"
    since = state.opened_at if state.status == OPEN else state.closed_at
    if hold_back > 0 and now - since < hold_back:
        return False, f"this node is suspect: it lets other nodes take the job first " \
                      f"(for {hold_back:g}s, daemon.suspect_adopt_delay)"
    if daemon_uid != 0 and uid != daemon_uid:
        return False, f"this daemon cannot run jobs as uid {uid}"
    return True, ""


def _joined(keys) -> int:
    """The nodes in the job's round: its members and those that joined it (a closed
    round's spares stand by among them)."""
    return len(set(keys.joins.get(keys.state.round, {})) | set(keys.state.member_ids()))


class Dispatcher:
    def __init__(self, cfg, view, registry, manager, cluster, interval: float = 1.0,
                 policy=None, metrics=None, suspicion=None):
        self._cfg = cfg
        self._suspicion = suspicion   # node_suspicion.SuspectTracker, or None
        self._policy = policy
        self._metrics = metrics
        self._reported: dict[str, Rejection] = {}   # job id -> what was reported
        self._full: dict[str, tuple] = {}   # job id -> (state order, until): its round full
        self._view = view
        self._registry = registry
        self._manager = manager
        self._cluster = cluster
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dispatch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._view.wake_waiters()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 2)

    def _run(self) -> None:
        while not self._stop.is_set():
            seen = self._view.revision
            try:
                self.tick()
            except StoreError as exc:
                log.debug("dispatch: etcd unavailable: %s", exc)
            except Exception:
                log.exception("dispatch failed")
            self._view.wait(self._interval, seen, self._stop)

    def tick(self) -> list[str]:
        """One look at the job list; returns what it did, a sentence per job."""
        done = []
        known = {j.id: j for j in self._registry.list()}
        me = self._cfg.daemon.node_id
        draining = None
        ids = self._view.job_ids()
        for gone in set(self._reported) - set(ids):  # its keys were deleted
            del self._reported[gone]
        for job_id in ids:
            keys = self._view.job(job_id)
            if keys is None:
                continue
            local = known.get(job_id)
            if local is not None:  # ours: its round state is all that matters here
                if keys.state is not None and keys.state.final and local.live:
                    self._manager.end_from_cluster(job_id, keys.state)
                    done.append(f"job {job_id} ended elsewhere: {keys.state.status}")
                continue
            if keys.rejection is not None:
                self._report(keys.rejection)
                continue
            if keys.spec is None or keys.state is None or keys.state.final:
                continue
            if draining is None:
                draining = me in self._cluster.drain_states()
            waiting = [j for j in known.values()
                       if j.live and j.id not in self._manager.active_jobs()]
            pending = sum(j.nproc_per_node for j in waiting)
            free = self._manager.slots_total - self._manager.slots_used() - pending
            # (a job needing more GPUs than the node has never starts here: not counted)
            total_gpus = self._manager.gpus.total
            gpus_free = self._manager.gpus_free() - sum(
                n for n in map(self._manager.gpus_needed, waiting) if n <= total_gpus)
            hold = (self._cfg.daemon.suspect_adopt_delay if self._suspicion is not None
                    and self._suspicion.verdict().suspect else 0.0)

            def judge(keys):
                return eligible(keys.spec, keys.state, _joined(keys), me, free, draining,
                                os.geteuid(), gpus_free, total_gpus, hold, time.time())
            ok, why = judge(keys)
            if ok and not keys.detailed:   # the list's copy: how many joined, from its rounds
                keys = self._rounds_of(job_id, keys)
                ok, why = judge(keys) if keys is not None else (False, "its round is full")
            if not ok:
                log.debug("%s: not joining: %s", ctx(job=job_id, node=me), why)
                continue
            refused = self._refusal(job_id, keys.spec)  # it would join, but may it?
            if refused is not None:
                self._report(refused)
                continue
            if self._manager.adopt(keys.spec) is not None:
                known = {j.id: j for j in self._registry.list()}
                done.append(f"adopted job {job_id}")
        return done

    def _rounds_of(self, job_id: str, keys):
        """The job's keys with its round's joins, read from its rounds (this node does not
        follow them); None while a read found the round full at the same state copy,
        for up to ``FULL_KEPT`` dispatch intervals (no read per node and tick)."""
        order = keys.state.order
        full = self._full.get(job_id)
        if full is not None and full[0] == order and time.monotonic() < full[1]:
            return None
        fresh = self._view.job(job_id, fresh=True)
        if fresh is None or fresh.state is None or not fresh.detailed:
            return None
        joined = _joined(fresh)
        room = fresh.spec.max_nodes + fresh.spec.spares if isinstance(fresh.spec, JobSpec) \
            else joined + 1
        if joined >= room:
            self._full[job_id] = (order, time.monotonic() + FULL_KEPT * self._interval)
            while len(self._full) > 10_000:
                self._full.pop(next(iter(self._full)))
        else:
            self._full.pop(job_id, None)
        return fresh

    def _refusal(self, job_id: str, spec: JobSpec) -> Rejection | None:
        if self._policy is None:
            return None
        why = self._policy.refusal(spec.uid, spec.gid)
        return Rejection(job_id, RejectReason.UID_NOT_ALLOWED, why, time.time(),
                         spec.uid) if why else None

    def _report(self, rej: Rejection) -> None:
        """Log, count and record a refused spec, once per job id and reason (the
        registry remembers across restarts: no second event after one)."""
        seen = self._reported.get(rej.job_id)
        if seen is not None and seen.reason is rej.reason:
            return
        self._reported[rej.job_id] = rej
        me = self._cfg.daemon.node_id
        if self._registry.has_rejection(rej.job_id, rej.reason.value):
            return
        log.warning("%s: refused a job spec from etcd: %s", ctx(job=rej.job_id[:80], node=me),
                    rej.message)
        if self._metrics is not None:
            self._metrics.spec_rejected(rej.reason.value)
        self._registry.record_rejection(rej)
