"""The daemon: wires the parts together and owns the main loop.

Threads and their owners: the main thread runs this loop (watchdog pings,
signals); the credential socket and the gRPC server own their accept
threads; the cluster owns the lease keeper and the node watch; the jobs
view owns the watch over every job's keys; the event log owns the writer
that shares this node's job events and the watch that mirrors the other
nodes'; the log keeper bounds running jobs' logs; the retirer retires what
finished jobs left (retention); the dispatcher adopts cluster jobs; the job
manager owns one agent thread per active job. Each stops on its own stop
event with a bounded wait, in reverse order of starting.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import signal
import threading
import time

from .. import __version__, statedir
from ..control.auth import CredentialServer, TokenIssuer
from ..cluster.node import Cluster, ClusterStartError, open_cluster_store
from ..trust.clusterkey import ClusterKeyError
from ..trust.refusals import Refusals
from ..trust.specs import ClusterPolicy, codec_for
from ..config import Config, socket_gid
from ..control.server import ControlServer
from ..control.service import ControlServicer
from ..jobs.registry import JobRegistry
from ..jobs.retirer import Retirer
from ..workers.logrotate import LogKeeper
from ..logsetup import ctx
from ..cluster.dispatch import Dispatcher
from ..cluster.eventlog import EventLog
from ..gpus.alloc import GpuLedger
from ..gpus.health import HealthGate
from ..gpus.inventory import Inventory, InventoryError, discover, nvml_module
from ..cluster.quarantine import FaultMemory
from ..cluster.suspicion import MAX_REMEMBERED as SUSPECT_REMEMBERED, SuspectTracker
from .coordinator import Coordinator
from ..metrics import Metrics
from ..rendezvous.round import forget_job
from ..exposition.endpoint import MetricsEndpoint
from ..rendezvous.phase_watch import PhaseWatch
from ..rendezvous.view import JobsView
from ..sdnotify import Notifier
from ..store import StoreError
from ..workers import hostname
from ..workers.snapshot_dirs import SnapshotBudgets, prepare_root
from ..replication.peers import Peers
from ..replication.pusher import Pusher
from ..replication.asking import RowAsker
from ..replication.receiver import ReplicationServer
from ..replication.stats import ReplicationStats

log = logging.getLogger("elasticd")
OWN_FILES = 1024  # fds kept for the daemon's own use beside control connections


def _take_priority(cfg: Config) -> None:
    """Run this thread, and so every thread it starts, at ``daemon.nice``: a node's
    training must not starve the lease, the beats and the control socket. A job's
    processes go back to WORKER_NICE as they start (workers/launch.py)."""
    want = cfg.daemon.nice
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != want:
            os.setpriority(os.PRIO_PROCESS, 0, want)
    except OSError as exc:  # expected of a user's own daemon: said, not warned
        say = log.warning if os.geteuid() == 0 else log.info
        say("%s: cannot run at nice %d (daemon.nice): %s; running at nice %d (as root, "
            "or with Nice= in the unit, it can)", ctx(node=cfg.daemon.node_id), want,
            exc.strerror, os.getpriority(os.PRIO_PROCESS, 0))


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.stop_event = threading.Event()
        self._notifier = Notifier()
        self._snapshots: SnapshotBudgets | None = None

    def request_stop(self, signum=None, frame=None) -> None:
        self.stop_event.set()

    def run(self) -> int:
        cfg, d = self.cfg, self.cfg.daemon
        t0 = time.monotonic()
        _take_priority(cfg)   # first: every thread started from here on inherits it
        _fit_open_files(cfg)
        # Root's socket dir must let group elasticd through; a user's is theirs alone.
        os.makedirs(os.path.dirname(d.socket), mode=0o755 if os.geteuid() == 0 else 0o700,
                    exist_ok=True)
        try:
            _private_state(cfg)
        except OSError as exc:
            log.error("state dir %s: %s", d.state_dir, exc)
            return 1
        lock = _lock_state_dir(d.state_dir)
        if lock is None:
            log.error("another elasticd already uses the state dir %s; give this one its own "
                      "(--state-dir)", d.state_dir)
            return 1
        try:  # jobs' snapshot dirs: the root ours alone (workers/snapshot_dirs.py)
            prepare_root(cfg.snapshot.root)
            self._snapshots = SnapshotBudgets.for_node(cfg.snapshot, d.node_id)
        except OSError as exc:
            log.error("%s: %s", ctx(node=d.node_id), exc)
            return 1
        try:
            self.codec = codec_for(cfg)
        except ClusterKeyError as exc:
            log.error("%s", exc)
            return 1
        try:
            store = open_cluster_store(cfg)
        except ClusterStartError as exc:
            log.error("%s", exc)
            return 1
        with contextlib.ExitStack() as stops:
            try:
                self._start_parts(store, stops)
            except (RuntimeError, OSError, StoreError) as exc:
                log.error("%s", exc)
                return 1
            log.info("%s: elasticd %s ready in %.0f ms on %s (store %s, %d slots, state in %s)",
                     ctx(node=d.node_id), __version__, (time.monotonic() - t0) * 1000, d.socket,
                     self.cluster.kind, d.slots, d.state_dir)
            unresolved = hostname.cached_problem()
            if unresolved:  # workers need it (gloo, torchrun's store address): say so now
                log.warning("%s: %s", ctx(node=d.node_id), unresolved)
            self._notifier.ready(f"serving on {d.socket}")
            self._main_loop()
            log.info("%s: stopping", ctx(node=d.node_id))
            self._notifier.stopping()
        log.info("%s: stopped", ctx(node=d.node_id))
        return 0

    def _start_parts(self, store, stops: contextlib.ExitStack) -> None:
        """Start every part in order; ``stops`` stops them in reverse."""
        cfg, d = self.cfg, self.cfg.daemon
        stops.callback(store.close)
        registry = JobRegistry(d.state_dir, d.node_id)
        stops.callback(registry.close)
        metrics = Metrics(d.node_id)
        store = metrics.timed_store(store)  # metrics: store request latency and errors
        # Every spec read from etcd is verified, decrypted and checked as it
        # enters the view (trust/specs.py); a refused one never reads as a job.
        # Every other record is sealed with the cluster key too (trust/sealed.py):
        # one that does not verify is counted, logged once and never acted on.
        records = self.codec.records
        refusals = Refusals(ctx(node=d.node_id), metrics.record_rejected)
        view = JobsView(store, records=records, retry=cfg.membership.watch_retry,
                        open_spec=self.codec.open, refusals=refusals)
        # The phase records of the jobs this node runs, one scoped watch per job while it
        # runs here (rendezvous/phase_watch.py); stopped after the agents.
        phases = PhaseWatch(store, records=records, retry=cfg.membership.watch_retry,
                            refusals=refusals)
        stops.callback(phases.stop)
        policy = ClusterPolicy.from_settings(cfg.cluster)
        inventory = _gpu_inventory(cfg)
        suspicion = SuspectTracker(d.node_id, d.suspect_window, d.suspect_jobs)
        suspicion.remember(registry.recent_events(   # no agent runs yet: nothing in between
            "worker_exit", d.node_id, time.time() - d.suspect_window, SUSPECT_REMEMBERED))
        registry.subscribe(suspicion.on_event)
        cluster = Cluster(cfg, store, records=records, refusals=refusals)
        health = HealthGate(
            cfg, inventory, registry,
            lambda why: cluster.set_drain(d.node_id, True, "elasticd: " + why[:200]),
            metrics, nvml=nvml_module() if inventory.source == "nvml" else None)
        manager = Coordinator(cfg, registry, cluster, view, metrics, codec=self.codec,
                             policy=policy, gpus=GpuLedger(inventory), health=health,
                             suspicion=suspicion, snapshots=self._snapshots, phases=phases)
        cluster.capacity_from(manager.capacity, lambda: dict(
            manager.gpu_record(), suspect=suspicion.verdict().reason))
        self.cluster = cluster
        # Faults of this node, kept in etcd across restarts; over the threshold the
        # node quarantines itself (cluster/quarantine.py). Not standalone: with one
        # node there is nowhere else for its jobs to go.
        faults = None
        if not d.standalone:
            faults = FaultMemory(cfg, store, records, cluster, registry, refusals, health)
            registry.subscribe(faults.on_event)
            cluster.keeper.lease_lost_listeners.append(faults.lease_lost)
        replication = None
        if not d.standalone:   # snapshot replicas to and from the jobs' buddy nodes
            replication = self._start_replication(manager, registry, view, metrics, stops)
        metrics.attach(registry, manager)
        metrics.attach_cluster(cluster)  # metrics: the node lease
        metrics.attach_gpus(manager)  # metrics: GPUs free/total, health
        metrics.attach_phases(phases)  # metrics: the phase records this node's watches got
        if faults is not None:
            metrics.attach_quarantine(faults, cluster)  # metrics: quarantines and their causes
        metrics.attach_snapshots(registry, manager)  # metrics: jobs' snapshots, the budget
        issuer = TokenIssuer(cfg.control.token_ttl)
        gid = socket_gid(cfg)
        if gid is None and os.geteuid() == 0:
            log.warning("group %r does not exist: only root can use the control socket",
                        d.socket_group)
        cred = CredentialServer(cfg.cred_socket, issuer, gid)
        cred.start()
        stops.callback(cred.stop)
        cluster.start()
        stops.callback(cluster.stop)
        if faults is not None:
            faults.start()
            stops.callback(faults.stop)
        view.start()
        stops.callback(view.stop)
        watches = [view, cluster]
        events = None
        if not d.standalone and cfg.events.share:  # one node has nobody to share with
            events = EventLog(cfg, store, registry, records=records, refusals=refusals)
            view.also_follow(events)   # a job's events, watched with its rounds
            events.start()
            stops.callback(events.stop)
            watches.append(events)
        keeper = LogKeeper(cfg.logs_dir, cfg.agent.log_max_bytes, cfg.agent.log_check_interval,
                           manager.active_jobs, d.node_id, lambda: statedir.disk_space(
                               d.state_dir, cfg.limits.state_min_free_bytes).full)
        keeper.start()
        stops.callback(keeper.stop)
        # Retention: what finished jobs left, retired by age, count and bytes; in the
        # store, this node's events of the job (a cluster), or the job's keys (standalone:
        # its in-memory store is this node's alone, and nothing else ends them).
        forget = events.forget_job if events is not None else None
        if d.standalone:
            forget = lambda job_id: forget_job(store, job_id)  # noqa: E731
        retirer = Retirer(cfg, registry, keeper, manager.active_jobs, forget)
        manager.agent_exit_listeners.append(retirer.wake)
        retirer.start()
        stops.callback(retirer.stop)
        metrics.attach_state(cfg, keeper)  # metrics: the state dir's disk, log rotation
        # A port it cannot have now never stops the daemon: it says so and tries again.
        endpoint = MetricsEndpoint(metrics.registry, cfg.metrics.address, cfg.metrics.port,
                                   cfg.metrics.retry_interval, d.node_id)
        asker = RowAsker(cfg.snapshot, self.codec.replication_key, cfg.etcd.prefix, d.node_id,
                         cluster.daemon_port) if replication is not None else None
        server = ControlServer(cfg, ControlServicer(cfg, manager, registry, issuer, metrics,
                                                    cluster, view, endpoint, replication,
                                                    asker, events), gid, issuer)
        server.start()
        stops.callback(server.stop, 1.0)
        endpoint.on_change = server.metrics_health
        endpoint.start()
        stops.callback(endpoint.stop)
        # Once the workers are stopped, every watch winds down at once (each
        # takes up to a watch poll to notice), rather than one after another.
        stops.callback(lambda: [w.request_stop() for w in watches])
        # Once the workers are stopped, leave the cluster at once (peers see the
        # revoke now, not after the TTL); the rest can wind down after.
        stops.callback(cluster.keeper.stop)
        stops.callback(manager.shutdown, d.shutdown_timeout)
        manager.resume()
        dispatcher = Dispatcher(cfg, view, registry, manager, cluster, policy=policy,
                                metrics=metrics, suspicion=suspicion)
        dispatcher.start()
        stops.callback(dispatcher.stop)

    def _start_replication(self, manager, registry, view, metrics,
                           stops: contextlib.ExitStack) -> ReplicationStats:
        """The replication listener (its port goes into the node record, so before the
        cluster registers) and the pusher (replication/)."""
        cfg, d = self.cfg, self.cfg.daemon
        stats = ReplicationStats()
        peers = Peers(d.node_id, manager, registry, view, self.cluster.watcher)
        key = self.codec.replication_key
        listener = ReplicationServer(
            cfg.snapshot, key, cfg.etcd.prefix, d.node_id, peers.target, stats,
            rows=lambda job_id: peers.row(job_id, stats))
        listener.start()
        stops.callback(listener.stop)
        self.cluster.replication_port = listener.port
        pusher = Pusher(cfg.snapshot, key, cfg.etcd.prefix, d.node_id, peers.plans, stats,
                        peers.forward_plans)
        pusher.start()
        stops.callback(pusher.stop)
        metrics.attach_replication(stats)
        return stats

    def _main_loop(self) -> None:
        interval = self.cfg.daemon.main_loop_interval
        wd = self._notifier.watchdog_interval()
        if wd:
            interval = min(interval, wd)
        while not self.stop_event.wait(interval):
            self._notifier.watchdog()


def _gpu_inventory(cfg: Config) -> Inventory:
    """This node's GPUs (gpus/inventory.py), logged once; RuntimeError if the setting
    names GPUs the node does not have or a source answers garbage."""
    d = cfg.daemon
    try:
        inv = discover(d.gpus, d.fake_gpus_file, d.nvidia_smi_timeout)
    except InventoryError as exc:
        raise RuntimeError(f"GPUs: {exc} (daemon.gpus, daemon.fake_gpus_file)") from None
    if inv.count:
        log.info("%s: %d GPU(s) from %s: %s", ctx(node=d.node_id), inv.count, inv.source,
                 ", ".join(f"{g.index} {g.uuid} {g.memory_mib} MiB numa {g.numa_node}"
                           for g in inv.gpus))
        if inv.source == "fake":
            log.warning("%s: FAKE GPUs from %s (daemon.fake_gpus_file is for tests only)",
                        ctx(node=d.node_id), d.fake_gpus_file)
    return inv


def _fit_open_files(cfg: Config) -> None:
    """Raise the soft open-file limit to the hard one, so limits.max_connections
    control connections fit beside the daemon's own files; warn if they do not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
    need = cfg.limits.max_connections + OWN_FILES
    if soft < need:
        log.warning("open-file limit %d is below limits.max_connections %d plus %d for the "
                    "daemon's own files: a connection flood may exhaust it (raise LimitNOFILE "
                    "or lower limits.max_connections)", soft, cfg.limits.max_connections,
                    OWN_FILES)


def _private_state(cfg: Config) -> None:
    """The state dir and its logs dir, root's alone; what an older version left
    readable is tightened (statedir.py)."""
    statedir.private_dir(cfg.daemon.state_dir)
    statedir.private_dir(cfg.logs_dir)
    # Jobs' run dirs (each 0700, its user's) under a root dir anyone may pass.
    os.makedirs(cfg.jobs_run_dir, mode=0o711, exist_ok=True)
    os.chmod(cfg.jobs_run_dir, 0o711)
    statedir.tighten_files(cfg.daemon.state_dir)
    for name in os.listdir(cfg.logs_dir):
        job_dir = os.path.join(cfg.logs_dir, name)
        if os.path.isdir(job_dir) and not os.path.islink(job_dir):
            statedir.tighten_files(job_dir)


def _lock_state_dir(path: str):
    """An exclusive lock on the state dir, held for the daemon's life, or None."""
    fh = open(statedir.open_private(os.path.join(path, "lock")), "a")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        return None
    return fh


def install_signal_handlers(daemon: Daemon) -> None:
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    # SIGHUP: nothing is reloadable yet; say so rather than die.
    signal.signal(signal.SIGHUP, lambda *_: log.info("SIGHUP: no settings are reloadable; "
                                                     "restart elasticd to apply changes"))
