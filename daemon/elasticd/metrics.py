"""Prometheus metrics of this daemon (``elasticd_`` prefix, units in names).

Where each number comes from:

- Counters and histograms of job life move from the events the job
  registry emits (``_on_event``), so every state change is seen in one
  place: transitions, rendezvous duration (time in RENDEZVOUS: forming the
  round and starting the workers), fault -> RUNNING again.
- The agent reports each fault it handled (``fault_handled``: a failed
  worker, a hung rank killed, a lost node) with the layer that restarts
  after it and the record its move left: RESTARTING counts a restart,
  FAILED only the fault.
- Store requests are timed by ``TimedStore``, a proxy with the ``Store``
  interface that the daemon puts around its store.
- Gauges (jobs by state, workers, slots, the node lease) are read from
  the live objects at scrape time, so they are never stale.

Labels stay bounded: no label takes a job name, rank or round; only the
per-job straggler gauges take the job id (label ``job_id``: ``job`` is
Prometheus's own), for live jobs on this node (as
many as its slots at most), and a rank is a value, never a label.
``elasticd_job_progress_beat_max_age_seconds`` has a sample only once
something calls ``progress_beat`` (the hang detector, when it sees a beat);
until then it is declared with no sample.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Histogram, Info, ProcessCollector,
                               disable_created_metrics)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import __version__, statedir
from .jobs.registry import JobNotFound, JobRecord
from .jobs.ladder import Layer
from .jobs.records import Failure
from .trust.rejections import RejectReason
from .trust.sealed import Kind, Reason
from .jobs.restartpolicy import RestartWindow
from .jobs.states import LIVE_STATES, TERMINAL_STATES, JobState, WorkerState
from .workers.template import StartPath
from .store import (KV, CompareFailed, KeyExists, Lease, LeaseNotFound, Store,
                    StoreAuthError, StoreCorrupt, StoreError, StoreUnavailable,
                    WatchCompacted, WatchEvent)

# Restart layers, fastest first (DESIGN.md), and what caused a restart.
LAYERS = tuple(layer.value for layer in Layer)
CAUSES = ("exit", "signal", "hang", "node_lost")
_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)
_START_PATHS = frozenset(p.value for p in StartPath)

STORE_OPERATIONS = ("get", "list", "put", "create", "compare_and_swap", "delete",
                    "delete_prefix", "grant_lease", "refresh_lease", "revoke_lease",
                    "watch", "health")
# The error label of a failed store request: one value per StoreError kind.
_STORE_ERRORS = ((StoreUnavailable, "unavailable"), (StoreAuthError, "auth"),
                 (KeyExists, "key_exists"), (CompareFailed, "compare_failed"),
                 (LeaseNotFound, "lease_not_found"), (WatchCompacted, "compacted"),
                 (StoreCorrupt, "corrupt"))

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
            "join, done, workers, phases, node, drain, event, spec, key) and reason (unsigned, "
            "bad_mac, replayed, invalid, too_large, too_deep, ...: trust/sealed.Reason)",
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

    def attach(self, registry, manager) -> None:
        """Count registry events; export job and worker gauges at scrape time."""
        registry.subscribe(self._on_event, seed=self._count_jobs)
        self.registry.register(_JobCollector(registry, manager, self))

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
        self.registry.register(_StateCollector(cfg, keeper))

    def attach_cluster(self, cluster) -> None:
        """Export the node lease kept by ``cluster.keeper`` at scrape time."""
        self.registry.register(_LeaseCollector(cluster.keeper))

    def attach_gpus(self, manager) -> None:
        """Export this node's GPUs, total and free, at scrape time."""
        self.registry.register(_GpuCollector(manager))

    def gpu_health(self, ok: bool) -> None:
        self.gpu_health_checks.labels("ok" if ok else "failed").inc()

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

    def _on_event(self, ev: dict) -> None:
        if ev["kind"] == "start" and ev.get("start_path") in _START_PATHS:
            self.rank_starts.labels(ev["start_path"]).inc()
            self.rank_start_seconds.labels(ev["start_path"]).observe(
                ev.get("duration_seconds", 0.0))
            return
        if ev["kind"] != "state" or not ev["to_state"]:
            return
        job, to, at = ev["job_id"], ev["to_state"], ev["time"]
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


def store_error_kind(exc: BaseException) -> str:
    for cls, kind in _STORE_ERRORS:
        if isinstance(exc, cls):
            return kind
    return "other"


class TimedStore(Store):
    """The same store, each request timed into ``Metrics.observe_store``.

    A watch is counted once per call, and only if it fails (it runs for as
    long as the caller wants); its duration is not observed.
    """

    def __init__(self, inner: Store, metrics: Metrics):
        self.inner = inner
        self.name = inner.name
        self.timeout = inner.timeout
        self._metrics = metrics

    def __getattr__(self, attr):  # anything beyond the Store interface
        return getattr(self.inner, attr)

    def _timed(self, operation: str, fn: Callable, *args):
        t0 = time.perf_counter()
        try:
            result = fn(*args)
        except StoreError as exc:
            self._metrics.observe_store(operation, time.perf_counter() - t0, exc)
            raise
        self._metrics.observe_store(operation, time.perf_counter() - t0, None)
        return result

    def get(self, key: str) -> KV | None:
        return self._timed("get", self.inner.get, key)

    def list(self, prefix: str) -> tuple[list[KV], int]:
        return self._timed("list", self.inner.list, prefix)

    def put(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self._timed("put", self.inner.put, key, value, lease)

    def create(self, key: str, value: str, lease: Lease | None = None) -> int:
        return self._timed("create", self.inner.create, key, value, lease)

    def compare_and_swap(self, key: str, value: str, prev_revision: int,
                         lease: Lease | None = None) -> int:
        return self._timed("compare_and_swap", self.inner.compare_and_swap, key, value,
                           prev_revision, lease)

    def delete(self, key: str, prev_revision: int | None = None) -> bool:
        return self._timed("delete", self.inner.delete, key, prev_revision)

    def delete_prefix(self, prefix: str) -> int:
        return self._timed("delete_prefix", self.inner.delete_prefix, prefix)

    def grant_lease(self, ttl: int) -> Lease:
        return self._timed("grant_lease", self.inner.grant_lease, ttl)

    def refresh_lease(self, lease: Lease) -> None:
        self._timed("refresh_lease", self.inner.refresh_lease, lease)

    def revoke_lease(self, lease: Lease) -> None:
        self._timed("revoke_lease", self.inner.revoke_lease, lease)

    def watch(self, prefix: str, start_revision: int,
              stop_event: threading.Event | None = None,
              timeout: float | None = None) -> Iterator[WatchEvent]:
        try:
            yield from self.inner.watch(prefix, start_revision, stop_event, timeout)
        except StoreError as exc:
            self._metrics.store_errors.labels("watch", store_error_kind(exc)).inc()
            raise

    def health(self) -> str:
        return self._timed("health", self.inner.health)

    def close(self) -> None:
        self.inner.close()


class _JobCollector:
    """Jobs, workers and slots of this node, read at scrape time."""

    def __init__(self, registry, manager, metrics: Metrics):
        self._jobs = registry
        self._manager = manager
        self._metrics = metrics

    def describe(self):
        return []

    def collect(self):
        now = time.time()
        live, ended = self._metrics.job_counts()
        by_state = {s.value: 0 for s in JobState}
        by_state.update(ended)
        oldest = {s.value: 0.0 for s in JobState if s in LIVE_STATES}
        workers = 0
        budget_used = 0.0
        stragglers: list[tuple[str, dict]] = []
        templates: list[int] = []
        for job_id in live:
            try:
                job = self._jobs.get(job_id)
            except JobNotFound:
                continue
            state = job.state.value
            by_state[state] += 1
            if job.state in LIVE_STATES:
                oldest[state] = max(oldest[state], now - job.state_since)
                if job.max_restarts > 0:
                    budget_used = max(budget_used, job.restarts / job.max_restarts)
                window = RestartWindow(job.max_restarts_per_window, job.restart_window)
                if window.limit > 0:
                    in_window = len(window.recent(job.restart_times, time.time()))
                    budget_used = max(budget_used, in_window / window.limit)
            workers += sum(1 for w in job.workers if w.state is WorkerState.RUNNING)
            if job.straggler and job.state is JobState.RUNNING:
                stragglers.append((job.id, job.straggler))
            if job.template_rss_bytes and job.state in LIVE_STATES:
                templates.append(job.template_rss_bytes)
        g = GaugeMetricFamily("elasticd_jobs", "Jobs known to this node, by state",
                              labels=["state"])
        for state, n in by_state.items():
            g.add_metric([state], n)
        yield g
        g = GaugeMetricFamily(
            "elasticd_job_state_max_age_seconds",
            "How long the job longest in each live state has been in it (0: none there)",
            labels=["state"])
        for state, age in oldest.items():
            g.add_metric([state], max(0.0, age))
        yield g
        yield GaugeMetricFamily(
            "elasticd_job_restart_budget_used_ratio",
            "Restarts used over restarts allowed, for the live job that used the most "
            "(of its lifetime budget or of its budget over the restart window)",
            value=min(budget_used, 1.0))
        ages = self._metrics.progress_beat_ages()
        g = GaugeMetricFamily(
            "elasticd_job_progress_beat_max_age_seconds",
            "Age of the oldest last progress beat among running jobs that send beats "
            "(no sample until beats are sent)")
        if ages:
            g.add_metric([], max(ages))
        yield g
        ratio = GaugeMetricFamily(
            "elasticd_job_straggler_ratio",
            "Work per step of the job's slowest rank on this node over the median rank's "
            "(live jobs with two or more ranks here that stepped enough)", labels=["job_id"])
        slowest = GaugeMetricFamily(
            "elasticd_job_slowest_rank", "The global rank of the job's slowest rank on this "
            "node (see elasticd_job_straggler_ratio)", labels=["job_id"])
        for job_id, straggler in stragglers:
            ratio.add_metric([job_id], straggler.get("ratio", 0.0))
            slowest.add_metric([job_id], straggler.get("rank", -1))
        yield ratio
        yield slowest
        yield GaugeMetricFamily(
            "elasticd_job_template_rss_bytes", "Resident memory of the live jobs' worker "
            "templates on this node, summed (elasticctl status: each job's)",
            value=sum(templates))
        yield GaugeMetricFamily(
            "elasticd_job_templates", "Live jobs with a worker template running on this node",
            value=len(templates))
        pool = getattr(self._manager, "templates", None)  # workers/template_pool.py
        if pool is not None:
            idle = pool.idle()
            yield GaugeMetricFamily(
                "elasticd_idle_templates", "Worker templates kept idle on this node for "
                "their user's next job (agent.template_idle_timeout)", value=len(idle))
            yield GaugeMetricFamily(
                "elasticd_idle_template_rss_bytes", "Resident memory of the idle worker "
                "templates on this node, summed", value=sum(t.rss_bytes for t in idle))
            yield CounterMetricFamily(
                "elasticd_template_reuses", "Jobs whose worker template was taken from "
                "the idle ones on this node (no import after the submit)", value=pool.reuses)
        yield GaugeMetricFamily("elasticd_workers_running", "Worker processes running",
                                value=workers)
        yield GaugeMetricFamily("elasticd_slots", "Worker slots of this node",
                                value=self._manager.slots_total)
        yield GaugeMetricFamily("elasticd_slots_used", "Worker slots in use on this node",
                                value=self._manager.slots_used())


class _LeaseCollector:
    """This node's lease in the store, as the lease keeper last saw it."""

    def __init__(self, keeper):
        self._keeper = keeper

    def describe(self):
        return []

    def collect(self):
        k = self._keeper
        yield GaugeMetricFamily("elasticd_node_lease_ok",
                                "1 while this node holds its lease and its last refresh "
                                "succeeded, else 0", value=1 if k.health == "ok" else 0)
        yield GaugeMetricFamily("elasticd_node_lease_last_refresh_timestamp_seconds",
                                "When the lease was last registered or refreshed (0: never)",
                                value=k.last_refresh)
        yield CounterMetricFamily("elasticd_node_lease_refreshes",
                                  "Successful lease refreshes", value=k.refreshes)
        yield CounterMetricFamily("elasticd_node_lease_errors",
                                  "Lease refreshes or registrations that failed", value=k.errors)
        yield CounterMetricFamily("elasticd_node_lease_reregistrations",
                                  "Registrations again after the lease was lost",
                                  value=k.reregistrations)


class _StateCollector:
    """The state dir's filesystem and the bounding of rank logs (workers/logrotate.py)."""

    def __init__(self, cfg, keeper):
        self._dir = cfg.daemon.state_dir
        self._min_free = cfg.limits.state_min_free_bytes
        self._keeper = keeper

    def describe(self):
        return []

    def collect(self):
        try:
            space = statedir.disk_space(self._dir, self._min_free)
        except OSError:
            space = None
        yield GaugeMetricFamily("elasticd_state_disk_free_bytes",
                                "Free bytes on the state dir's filesystem",
                                value=space.free_bytes if space else 0)
        yield GaugeMetricFamily("elasticd_state_disk_full",
                                "1 while the state dir's filesystem has less than "
                                "limits.state_min_free_bytes free (submits fail, logs may "
                                "lose output), else 0", value=1 if space is None or space.full
                                else 0)
        k = self._keeper
        yield CounterMetricFamily("elasticd_log_rotations", "Rank logs rotated to stay under "
                                  "agent.log_max_bytes", value=k.rotations)
        yield CounterMetricFamily("elasticd_log_dropped_bytes", "Bytes of rank logs dropped "
                                  "by rotation (the oldest output)", value=k.dropped_bytes)
        yield CounterMetricFamily("elasticd_log_rotation_errors", "Rotations of rank logs "
                                  "that failed (disk full, ...)", value=k.errors)


# -- GPUs (gpus/alloc.py, gpus/health.py) ----------------------------------------------
class _GpuCollector:
    """This node's GPUs, total and free, read at scrape time (no per-device labels)."""

    def __init__(self, manager):
        self._manager = manager

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("elasticd_gpus", "GPUs of this node (daemon.gpus)",
                                value=self._manager.gpus.total)
        yield GaugeMetricFamily("elasticd_gpus_free", "GPUs of this node no job holds",
                                value=self._manager.gpus_free())

