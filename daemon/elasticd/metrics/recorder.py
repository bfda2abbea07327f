"""``Metrics``: the counters and histograms this daemon's parts move, and what a scrape adds.

The registry's events move the job-life counters (``_on_event``), the agent reports the
faults it handled (``fault_handled``), the control service its RPCs, ``TimedStore``
(metrics/timed_store.py) the store's requests; ``attach*`` registers the collectors
that read gauges from the live objects at scrape time (metrics/collectors.py).
"""
from __future__ import annotations

import threading
import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               ProcessCollector, disable_created_metrics)

from .. import __version__
from ..jobs.jobevent import JobEvent
from ..jobs.registry import JobRecord
from ..jobs.ladder import Layer
from ..jobs.records import Failure
from ..trust.rejections import RejectReason
from ..trust.sealed import Kind, Reason
from ..jobs.states import TERMINAL_STATES, JobState
from ..workers.template import StartPath
from ..store import Store
from .collectors import (GpuCollector, JobCollector, LeaseCollector, QuarantineCollector,
                         PhaseWatchCollector, ReplicationCollector,
                         SnapshotCollector, StateCollector)
from .timed_store import STORE_OPERATIONS, WATCHED_KINDS, TimedStore, store_error_kind

# Restart layers, fastest first (DESIGN.md), and what caused a restart.
LAYERS = tuple(layer.value for layer in Layer)
CAUSES = ("exit", "signal", "hang", "node_lost")
_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)
_START_PATHS = frozenset(p.value for p in StartPath)

_FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_SLOW_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Recovery spans in-process restarts (tens of ms) to hangs killed after minutes.
_RECOVERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self, node_id: str):
        # No *_created series: they double every counter's series and nothing reads them.
        # (A process-wide switch of prometheus_client; this process is the daemon.)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._node_id = node_id
        self._build = Info("elasticd_build", "elasticd build information", registry=r)
        self._build.info({"version": __version__, "node_id": node_id, "store": ""})
        ProcessCollector(namespace="elasticd", registry=r)
        self.transitions = Counter(
            "elasticd_job_transitions_total", "Job state transitions, by the state entered",
            ["to_state"], registry=r)
        self.restarts = Counter(
            "elasticd_restarts_total", "Restarts of a job's workers, by layer and cause",
            ["layer", "cause"], registry=r)
        self.faults = Counter(
            "elasticd_faults_total", "Worker-group faults handled, restarted or not, by cause",
            ["cause"], registry=r)
        self.recovery_seconds = Histogram(
            "elasticd_recovery_duration_seconds",
            "From a fault seen to the job running again, by the layer that recovered it",
            ["layer"], registry=r, buckets=_RECOVERY_BUCKETS)
        self.rendezvous_seconds = Histogram(
            "elasticd_rendezvous_duration_seconds",
            "Time a job spent in RENDEZVOUS (forming its round and starting workers) "
            "before RUNNING", registry=r, buckets=_SLOW_BUCKETS)
        self.round_nodes_seen = Histogram(
            "elasticd_rendezvous_round_nodes", "Nodes in each rendezvous round this node ran",
            registry=r, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
        self.workers_started = Counter(
            "elasticd_workers_started_total", "Worker processes started", registry=r)
        self.rank_starts = Counter(
            "elasticd_rank_starts_total", "Starts of a node's ranks for a round, by the "
            "slowest path a rank took: template | spare | cold", ["path"], registry=r)
        self.rank_start_seconds = Histogram(
            "elasticd_rank_start_duration_seconds", "How long starting a node's ranks for a "
            "round took, by the slowest path a rank took", ["path"], registry=r,
            buckets=_FAST_BUCKETS)
        self.rpc_seconds = Histogram(
            "elasticd_control_rpc_duration_seconds", "Control RPC latency, by method and code",
            ["method", "code"], registry=r, buckets=_FAST_BUCKETS)
        self.store_seconds = Histogram(
            "elasticd_store_request_duration_seconds",
            "Requests to the cluster store (etcd; in memory under --standalone), by operation",
            ["operation"], registry=r, buckets=_FAST_BUCKETS)
        self.store_errors = Counter(
            "elasticd_store_request_errors_total",
            "Failed store requests, by operation and error (unavailable: etcd did not answer)",
            ["operation", "error"], registry=r)
        self.watch_events = Counter(
            "elasticd_store_watch_events_total",
            "Changes this node's watches of the cluster store received, by the kind of key "
            "(its folder: jobs, rounds, joins, workers, phases, phasedigests, nodes, drain, "
            "faults, events, other)",
            ["kind"], registry=r)
        self._watch_events = {k: self.watch_events.labels(k) for k in WATCHED_KINDS}
        self.lease_refresh_seconds = Histogram(
            "elasticd_node_lease_refresh_duration_seconds",
            "Latency of refreshing this node's lease in the store", registry=r,
            buckets=_FAST_BUCKETS)
        self.specs_rejected = Counter(
            "elasticd_cluster_specs_rejected_total",
            "Job specs read from etcd that this node refused to run, by reason (unsigned, "
            "bad_signature, id_mismatch, undecryptable, malformed, invalid, uid_not_allowed)",
            ["reason"], registry=r)
        for reason in RejectReason:
            self.specs_rejected.labels(reason.value)
        self.phase_records_rejected = Counter(
            "elasticd_phase_records_rejected_total",
            "Other nodes' phase records (jobs across nodes) read from etcd and refused as "
            "malformed or oversized", registry=r)
        self.records_rejected = Counter(  # trust/refusals.py
            "elasticd_etcd_records_rejected_total",
            "Records read from etcd that this node refused and never acted on, by kind (state, "
            "join, done, workers, phases, node, drain, faults, event, spec, key) and reason "
            "(unsigned, bad_mac, replayed, invalid, too_large, too_deep, ...: "
            "trust/sealed.Reason)",
            ["kind", "reason"], registry=r)
        for kind in (Kind.STATE, Kind.JOIN, Kind.NODE, Kind.EVENT):   # ElasticdUnvouched...
            self.records_rejected.labels(kind.value, Reason.UNSIGNED.value)
        # Series that alerts use exist from the start, so increase() sees the first one.
        for layer in LAYERS:
            for cause in CAUSES:
                self.restarts.labels(layer, cause)
        for cause in CAUSES:
            self.faults.labels(cause)
        for state in JobState:
            self.transitions.labels(state.value)
        for op in STORE_OPERATIONS:
            self.store_errors.labels(op, "unavailable")
        self._lock = threading.Lock()
        self._entered_rendezvous: dict[str, float] = {}   # job id -> time
        self._faulted: dict[str, tuple[float, str]] = {}  # job id -> (fault time, layer)
        self._beats: dict[str, float] = {}                # job id -> last progress beat
        # Which jobs are live, and how many ended in each way, kept from events so
        # a scrape reads only the live jobs however long this node's history is.
        self._live: set[str] = set()
        self._ended: dict[str, int] = {s: 0 for s in _TERMINAL}
        self.gpu_health_checks = Counter(  # gpus/health.py
            "elasticd_gpu_health_checks_total", "GPU health checks before a round, by result",
            ["result"], registry=r)
        for result in ("ok", "failed"):
            self.gpu_health_checks.labels(result)
        # Spare nodes (agent/standby.py): the jobs this node stands by for, and the
        # rounds that took it from standing by into a lost member's place.
        self._standing: set[str] = set()
        self.spare_jobs = Gauge(
            "elasticd_node_spare_jobs", "Jobs this node stands by for as a spare node now "
            "(no ranks here; summed over nodes: the cluster's free spares)", registry=r)
        self.spare_takeovers = Counter(
            "elasticd_spare_takeovers_total", "Rounds that took this node from standing by as "
            "a spare into a job's ranks (the cluster's spares used, summed over nodes)",
            registry=r)

    def attach(self, registry, manager) -> None:
        """Count registry events; export job and worker gauges at scrape time."""
        registry.subscribe(self._on_event, seed=self._count_jobs)
        self.registry.register(JobCollector(registry, manager, self))

    def _count_jobs(self, jobs: list) -> None:
        """The jobs there were before the first event this counts."""
        with self._lock:
            for job in jobs:
                if job.state in TERMINAL_STATES:
                    self._ended[job.state.value] += 1
                else:
                    self._live.add(job.id)

    def attach_state(self, cfg, keeper) -> None:
        """Export the state dir's free space and the log keeper's work at scrape time."""
        self.registry.register(StateCollector(cfg, keeper))

    def attach_cluster(self, cluster) -> None:
        """Export the node lease kept by ``cluster.keeper`` at scrape time."""
        self.registry.register(LeaseCollector(cluster.keeper))

    def attach_snapshots(self, registry, manager) -> None:
        """Export the jobs' snapshots here and the node's budget at scrape time."""
        self.registry.register(SnapshotCollector(registry, manager))

    def attach_replication(self, stats) -> None:
        """Export what snapshot replication sent, got and refused (replication/stats.py)."""
        self.registry.register(ReplicationCollector(stats))

    def attach_quarantine(self, faults, cluster) -> None:
        """Export this node's faults and quarantine, and the cluster's quarantined nodes."""
        self.registry.register(QuarantineCollector(faults, cluster))

    def attach_phases(self, watch) -> None:
        """Export the phase watches (rendezvous/phase_watch.py) at scrape time."""
        self.registry.register(PhaseWatchCollector(watch))

    def attach_gpus(self, manager) -> None:
        """Export this node's GPUs, total and free, at scrape time."""
        self.registry.register(GpuCollector(manager))

    def spare_standing(self, job_id: str, standing: bool) -> None:
        with self._lock:
            (self._standing.add if standing else self._standing.discard)(job_id)
            self.spare_jobs.set(len(self._standing))

    def spare_job_ids(self) -> frozenset:
        with self._lock:
            return frozenset(self._standing)

    def spare_taken(self, job_id: str) -> None:
        """A round took this node from standing by for ``job_id``: counted, and the job's
        time in RENDEZVOUS (the histogram's) starts now, not when it began to stand by."""
        self.spare_takeovers.inc()
        with self._lock:
            if job_id in self._entered_rendezvous:
                self._entered_rendezvous[job_id] = time.time()

    def gpu_health(self, ok: bool) -> None:
        self.gpu_health_checks.labels("ok" if ok else "failed").inc()

    def watch_event(self, kind: str) -> None:
        """One change a watch received, of a key of ``kind`` (timed_store.WATCHED_KINDS)."""
        self._watch_events[kind].inc()

    def timed_store(self, store: Store) -> "TimedStore":
        """``store``, with every request timed and every error counted."""
        self._build.info({"version": __version__, "node_id": self._node_id,
                          "store": store.name})
        return TimedStore(store, self)

    # -- registry events (called under the registry's lock) --------------------
    def spec_rejected(self, reason: str) -> None:
        self.specs_rejected.labels(RejectReason(reason).value).inc()

    def record_rejected(self, kind: str, reason: str) -> None:
        """A record from etcd refused (trust/refusals.py: both labels from its enums)."""
        self.records_rejected.labels(Kind(kind).value, Reason(reason).value).inc()
        if kind == Kind.PHASES.value:
            self.phase_records_rejected.inc()

    def _on_event(self, ev: JobEvent) -> None:
        if ev.kind == "start" and ev.start_path in _START_PATHS:
            self.rank_starts.labels(ev.start_path).inc()
            self.rank_start_seconds.labels(ev.start_path).observe(ev.duration_seconds)
            return
        if ev.kind != "state" or not ev.to_state:
            return
        job, to, at = ev.job_id, ev.to_state, ev.time
        self.transitions.labels(to).inc()
        with self._lock:
            if to in _TERMINAL:
                self._live.discard(job)
                self._ended[to] += 1
            else:
                self._live.add(job)
            since = self._entered_rendezvous.pop(job, None)
            if to == JobState.RENDEZVOUS.value:
                self._entered_rendezvous[job] = at
            elif to == JobState.RUNNING.value:
                if since is not None:
                    self.rendezvous_seconds.observe(max(0.0, at - since))
                faulted = self._faulted.pop(job, None)
                if faulted is not None:
                    self.observe_recovery(faulted[1], max(0.0, at - faulted[0]))
            elif to == JobState.RESTARTING.value:
                self._beats.pop(job, None)
            elif to in _TERMINAL:
                self._faulted.pop(job, None)
                self._beats.pop(job, None)

    # -- hooks for the agent, the control service and the restart layers ------
    def workers_started_n(self, n: int) -> None:
        self.workers_started.inc(n)

    def round_nodes(self, n: int) -> None:
        self.round_nodes_seen.observe(n)

    def fault_handled(self, job: JobRecord, failure: Failure, layer: Layer) -> None:
        """The agent handled this worker-group fault and moved the job to ``job``
        (the record the move returned): RESTARTING counts a restart of ``layer``
        (the one that restarts after it), timed until RUNNING again; FAILED
        counts the fault alone; any other end (the cluster's word) neither."""
        if job.state not in (JobState.RESTARTING, JobState.FAILED):
            return
        cause = failure_cause(failure)
        self.faults.labels(cause).inc()
        if job.state is JobState.RESTARTING:
            self.count_restart(layer.value, cause)
            with self._lock:
                if job.id in self._live:  # not ended meanwhile by another thread
                    self._faulted[job.id] = (failure.time or job.state_since, layer.value)

    def count_restart(self, layer: str, cause: str) -> None:
        self.restarts.labels(layer, cause).inc()

    def observe_recovery(self, layer: str, seconds: float) -> None:
        self.recovery_seconds.labels(layer).observe(seconds)

    def progress_beat(self, job_id: str, at: float | None = None) -> None:
        """A progress beat of one of the job's ranks was seen (``at``: on
        the monotonic clock)."""
        with self._lock:
            self._beats[job_id] = time.monotonic() if at is None else at

    def job_counts(self) -> tuple[set[str], dict[str, int]]:
        """(ids of live jobs, {terminal state: jobs that ended so})."""
        with self._lock:
            return set(self._live), dict(self._ended)

    def progress_beat_ages(self) -> list[float]:
        now = time.monotonic()
        with self._lock:
            return [max(0.0, now - t) for t in self._beats.values()]

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_seconds.labels(method, code).observe(seconds)

    def observe_store(self, operation: str, seconds: float, error: BaseException | None) -> None:
        self.store_seconds.labels(operation).observe(seconds)
        if operation == "refresh_lease":
            self.lease_refresh_seconds.observe(seconds)
        if error is not None:
            self.store_errors.labels(operation, store_error_kind(error)).inc()


def failure_cause(failure: Failure) -> str:
    """The cause label of a failure the agent handles: its kind where that is
    one of CAUSES (``hang``, ``node_lost``), else signal or exit from how the
    worker ended."""
    if failure.kind.value in CAUSES:
        return failure.kind.value
    return "signal" if failure.signal else "exit"

