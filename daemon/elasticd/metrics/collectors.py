"""The gauges read from the live objects at scrape time, so they are never stale: jobs,
workers and slots; the node lease; the phase watches; the state dir and rank logs; the GPUs;
jobs' snapshots.
"""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import statedir
from ..jobs.registry import JobNotFound
from ..jobs.restartpolicy import RestartWindow
from ..jobs.states import LIVE_STATES, JobState, WorkerState
from ..workers.snapshot_status import read_dir, scan_limit


class JobCollector:
    """Jobs, workers and slots of this node, read at scrape time."""

    def __init__(self, registry, manager, metrics):  # metrics.recorder.Metrics
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
        standing = self._metrics.spare_job_ids()   # a spare waits by design: no stall
        for job_id in live:
            try:
                job = self._jobs.get(job_id)
            except JobNotFound:
                continue
            state = job.state.value
            by_state[state] += 1
            if job.state in LIVE_STATES and job_id not in standing:
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


class LeaseCollector:
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


class PhaseWatchCollector:
    """The watches of the phase records of the jobs this node runs (rendezvous/phase_watch.py)."""

    def __init__(self, watch):
        self._watch = watch

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("elasticd_phase_watches",
                                "Jobs whose phase records this node watches (the jobs across "
                                "nodes it runs)", value=len(self._watch.following()))


class QuarantineCollector:
    """This node's recorded faults and quarantine (cluster/quarantine.py), and the
    quarantined nodes of the cluster as its drain marks say."""

    def __init__(self, faults, cluster):
        self._faults = faults
        self._cluster = cluster

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("elasticd_node_quarantined",
                                "1 while this node is quarantined (too many faults within "
                                "cluster.quarantine_window), else 0",
                                value=1 if self._faults.quarantined() else 0)
        g = GaugeMetricFamily("elasticd_node_faults",
                              "Faults recorded for this node that count toward its "
                              "quarantine now, by cause", labels=["cause"])
        for cause, n in sorted(self._faults.causes().items()):
            g.add_metric([cause], n)
        yield g
        yield GaugeMetricFamily("elasticd_cluster_nodes_quarantined",
                                "Nodes of the cluster quarantined, as this node's drain "
                                "watch sees them",
                                value=sum(1 for m in self._cluster.drain_states().values()
                                          if m.get("reasons")))


class StateCollector:
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
class GpuCollector:
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



# -- jobs' snapshots (workers/snapshot_dirs.py, workers/snapshot_status.py) ------------
class SnapshotCollector:
    """The snapshots of the jobs whose agents run here, read from their slot headers at
    scrape time: one series per such job (bounded by the node's slots, like the
    straggler gauges), and the node's budget."""

    def __init__(self, registry, manager):
        self._jobs = registry
        self._manager = manager

    def describe(self):
        return []

    def collect(self):
        now = time.time()
        ledger = self._manager.snapshots
        held = GaugeMetricFamily(
            "elasticd_job_snapshot_bytes", "Memory the job's snapshot files take on this "
            "node, every slot of every rank (jobs whose agent runs here)", labels=["job_id"])
        age = GaugeMetricFamily(
            "elasticd_job_snapshot_age_seconds", "Age of the newest snapshot every rank of "
            "the job on this node holds complete (jobs with one)", labels=["job_id"])
        stall = GaugeMetricFamily(
            "elasticd_job_snapshot_save_stall_seconds", "How long the last snapshot save held "
            "a rank of the job on this node (the longest among its ranks; as the worker "
            "library published it)", labels=["job_id"])
        restore = GaugeMetricFamily(
            "elasticd_job_snapshot_restore_seconds", "How long the last snapshot restore "
            "took on a rank of the job on this node (the longest among its ranks), by where "
            "it found its step: local, peer (a buddy's replica) or none", labels=["job_id",
                                                                                 "source"])
        for job_id in self._manager.active_jobs():
            try:
                job = self._jobs.get(job_id)
            except JobNotFound:
                continue
            found = read_dir(ledger.path(job_id), job.uid, scan_limit(job.nproc_per_node))
            if found is None:
                continue
            held.add_metric([job_id], found.held_bytes)
            if found.present:
                age.add_metric([job_id], found.age(now))
            if found.save_stall_s is not None:
                stall.add_metric([job_id], found.save_stall_s)
            if found.restore is not None:
                took, source = found.restore
                restore.add_metric([job_id, source], took)
        yield held
        yield age
        yield stall
        yield restore
        yield GaugeMetricFamily("elasticd_snapshot_budget_bytes", "Bytes every job's "
                                "snapshots on this node may hold together "
                                "(snapshot.node_budget)", value=ledger.node_budget)
        yield GaugeMetricFamily("elasticd_snapshot_granted_bytes", "Snapshot budgets of the "
                                "jobs whose agents run on this node, summed",
                                value=ledger.given_bytes())


# -- snapshot replicas (replication/) -------------------------------------------------
class ReplicationCollector:
    """Bytes this node's replication channel sent and received, connections and replicas
    refused by reason, and each job's replication lag here. ``stats`` is the daemon's
    replication/stats.py ``ReplicationStats``, not imported here: metrics/ sits below
    replication/ (tests/test_layout.py), and only reads its counters and records."""

    def __init__(self, stats):
        self._stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self._stats
        b = CounterMetricFamily("elasticd_replication_bytes", "Bytes of the replication "
                                "channel, sealed frames included, by direction",
                                labels=["direction"])
        b.add_metric(["sent"], s.bytes_sent)
        b.add_metric(["received"], s.bytes_received)
        yield b
        r = CounterMetricFamily("elasticd_replication_refused", "Replication connections "
                                "dropped and replicas refused, by reason (garbage, mac, "
                                "too_large, timeout, closed, busy, refused)",
                                labels=["reason"])
        for why, n in s.refusals().items():
            r.add_metric([why.value], n)
        yield r
        lag = GaugeMetricFamily("elasticd_replication_lag_seconds", "Seconds from the "
                                "job's newest complete snapshot here to its replica "
                                "acknowledged by the buddy node (the last replicated)",
                                labels=["job_id", "buddy"])
        for job_id, rec in s.jobs().items():
            lag.add_metric([job_id, rec.node_id], rec.lag_s)
        yield lag
