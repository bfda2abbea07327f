"""The node's coordinator: its jobs accepted, scheduled onto slots, cancelled, resumed.

The coordinator owns the agents (one thread per active job) and the slot count.
A submitted job is written to the store (its spec and first round) and kept
as a local record; daemons on other nodes adopt it through the dispatcher.
A job whose workers do not fit in the free slots waits PENDING; each time an
agent exits, pending jobs are looked at again in submission order. At start,
jobs left unfinished by a previous daemon are resumed: rejoined where the
cluster still runs them, or started again as a counted restart where the
store forgot them (the in-memory store of a standalone daemon): node/resume.py.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from .. import errors
from .resume import Resumer
from ..jobstore import address as jobstore_env
from ..agent.loop import Agent
from ..control.auth import Caller, check_access
from ..control.validation import JobRequest
from ..cluster.daemon_probe import DaemonProbe
from ..cluster.faults import NodeQuarantine
from ..config import Config
from ..gpus.alloc import GpuLedger, binding_for, needed
from ..gpus.inventory import Inventory
from ..jobs.registry import (
    JobExists, JobNotFound, JobRecord, JobRegistry, NameInUse, NotPersisted, new_job_id,
    spec_bytes)
from ..logsetup import ctx
from ..rendezvous.phase_watch import PhaseWatch
from ..rendezvous.round import ClusterRendezvous, create_job
from ..rendezvous.protocol import CANCELLED, JobLimits, final_job_state
from ..jobs.spec import JobSpec
from ..jobs.states import TERMINAL_STATES, JobState
from ..store import StoreError
from ..trust.clusterkey import ephemeral
from ..trust.specs import SpecCodec
from ..workers.snapshot_dirs import SnapshotBudgets
from ..workers.template_pool import TemplatePool

log = logging.getLogger("elasticd.coordinator")


class Coordinator:
    """This node's jobs: admission, slots and GPUs, the agents, adoption, cancel, resume."""

    def __init__(self, cfg: Config, registry: JobRegistry, cluster, view, metrics=None,
                 codec=None, policy=None, gpus: GpuLedger | None = None, health=None,
                 suspicion=None, snapshots: SnapshotBudgets | None = None,
                 phases: PhaseWatch | None = None):
        self._cfg = cfg
        # The phase records of the jobs this node runs (rendezvous/phase_watch.py): the
        # daemon's, or one on the cluster's store for a test that passes none.
        self.phases = phases or PhaseWatch(cluster.store, records=view.records,
                                           retry=cfg.membership.watch_retry,
                                           refusals=view.refusals)
        # The snapshot budgets granted to this node's jobs (workers/snapshot_dirs.py),
        # one each while its agent runs here; None: no snapshot dirs.
        self.snapshots = snapshots
        # This node's GPUs and who holds them (gpus/alloc.py), changed under self._lock;
        # the health gate agents ask before joining a round (gpus/health.py).
        self.gpus = gpus if gpus is not None else GpuLedger(Inventory((), "off"))
        self._health = health
        self._suspicion = suspicion   # node_suspicion.SuspectTracker: this node suspect?
        # Seals every spec this node writes to the store (trust/specs.py); the
        # daemon passes the cluster key's, a test without one gets a throwaway key.
        if codec is None:
            codec = SpecCodec(ephemeral(), cfg.control)
        self._codec = codec
        self._policy = policy
        self._registry = registry
        self._cluster = cluster
        self._view = view
        self._metrics = metrics
        self._lock = threading.RLock()
        self._admit_lock = threading.Lock()
        self._agents: dict[str, Agent] = {}
        self._stopping = False
        # Worker templates kept between a user's jobs on this node (stopped last).
        self.templates = TemplatePool(cfg)
        # Called with a job's id once its agent here has exited (retention: jobs/retirer.py).
        self.agent_exit_listeners: list[Callable[[str], None]] = []

    @property
    def slots_total(self) -> int:
        return self._cfg.daemon.slots

    def slots_used(self) -> int:
        with self._lock:
            return sum(self._registry.get(j).nproc_per_node for j in self._agents)

    def gpus_needed(self, job: JobRecord) -> int:
        """GPUs the job takes on this node."""
        return needed(job.gpus_per_node, job.nproc_per_node, self.gpus.total)

    def gpus_free(self) -> int:
        with self._lock:
            return len(self.gpus.free())

    def gpu_holders(self) -> dict[int, str]:
        """GPU index -> the job holding it ("" free), for `elasticctl nodes`."""
        with self._lock:
            return {g.index: self.gpus.holder(g.index) for g in self.gpus.inventory.gpus}

    def gpu_record(self) -> dict:
        """The GPU fields of this node's record in the cluster (membership.parse_node)."""
        health = self._health.status() if self._health is not None else ""
        return {"gpus": self.gpus.total, "gpus_free": self.gpus_free(),
                "gpu_source": self.gpus.inventory.source, "gpu_health": health}

    def gpu_problem(self) -> str:
        return self._health.problem() if self._health is not None else ""

    def quarantine_state(self) -> NodeQuarantine:
        """Why this node is quarantined, as its drain mark says (cluster/quarantine.py;
        () when it is not), and the nodes with a drain mark: its agents' pre-round gate."""
        marks = self._cluster.drain_states()
        return NodeQuarantine(marks.get(self._cfg.daemon.node_id, {}).get("reasons", ()),
                              frozenset(marks))

    def suspect_reason(self) -> str:
        """Why this node is suspect (cluster/suspicion.py); "" when it is not."""
        return self._suspicion.verdict().reason if self._suspicion is not None else ""

    # -- requests ------------------------------------------------------------
    def submit(self, req: JobRequest, caller: Caller) -> JobRecord:
        if self._stopping:
            raise errors.Unavailable("elasticd is shutting down; submit again once it is back")
        if req.min_nodes > 1 and self._cfg.daemon.standalone:
            raise errors.FailedPrecondition(
                f"this daemon runs standalone (one node) but the job needs {req.min_nodes} "
                "nodes; start elasticd with --etcd to form a cluster")
        if self._cfg.daemon.standalone:
            req = dataclasses.replace(req, max_nodes=1, spares=0)
        spares = self._cfg.cluster.default_spares if req.spares is None else req.spares
        if spares > self._cfg.control.max_spares:
            raise errors.InvalidArgument(
                f"spares: cluster.default_spares ({spares}) is above control.max_spares "
                f"({self._cfg.control.max_spares}); name --spares")
        if req.nproc_per_node > self.slots_total:
            raise errors.FailedPrecondition(
                f"the job needs {req.nproc_per_node} worker slots but this node has "
                f"{self.slots_total} (elasticd --slots); lower --nproc-per-node")
        want = needed(req.gpus_per_node, req.nproc_per_node, self.gpus.total)
        only_here = self._cfg.daemon.standalone or tuple(req.nodes) == (self._cfg.daemon.node_id,)
        if only_here and want > self.gpus.total:
            raise errors.FailedPrecondition(
                f"the job needs {want} GPUs per node but this node has {self.gpus.total} "
                f"(daemon.gpus, found by {self.gpus.inventory.source}); lower --gpus-per-node")
        self._check_cluster_policy(req, caller)
        a = self._cfg.agent
        max_restarts = a.default_max_restarts if req.max_restarts < 0 else req.max_restarts
        per_window = (a.default_max_restarts_per_window if req.max_restarts_per_window is None
                      else req.max_restarts_per_window)
        if max_restarts < 0 and per_window < 0:
            raise errors.InvalidArgument(
                "the job would have no restart budget: this daemon gives no lifetime limit by "
                "default (agent.default_max_restarts = -1), so name --max-restarts, or keep a "
                "budget over a window (--max-restarts-per-window)")
        env = dict(req.env)
        if req.inprocess:  # the ranks' key prefix in the job store; every node needs it
            env[jobstore_env.SECRET] = jobstore_env.new_secret()
        rec = JobRecord(
            id=new_job_id(), name=req.name, command=list(req.command), cwd=req.cwd,
            env=env, uid=caller.uid, gid=caller.gid, user=caller.user,
            min_nodes=req.min_nodes, max_nodes=req.max_nodes,
            nproc_per_node=req.nproc_per_node, max_restarts=max_restarts,
            max_restarts_per_window=per_window, restart_window=a.restart_window,
            reason="waiting for free slots", node_id=self._cfg.daemon.node_id,
            inprocess=req.inprocess, nodes=list(req.nodes),
            gpus_per_node=req.gpus_per_node, cpu_bind=req.cpu_bind.value,
            spares=spares if req.max_nodes > 1 or req.spares else 0, created_at=time.time())
        # The local record first: this node's own dispatcher, woken by the
        # store write, must find the job known here and not adopt it again.
        with self._admit_lock:  # the limits checked and the job counted at once
            self._admit(rec)
            try:
                rec = self._registry.create(rec)
            except NameInUse:
                raise errors.AlreadyExists(
                    f"a live job is already named {req.name!r}; pick another --name or cancel "
                    "that job") from None
            except NotPersisted as exc:
                if exc.disk_full:
                    raise errors.ResourceExhausted(
                        f"the state dir {self._cfg.daemon.state_dir} is full, the job was not "
                        "submitted (nothing of it was kept); free some space there") from None
                raise errors.Unavailable(f"{exc}; the job was not submitted") from None
        try:
            spec = JobSpec.of_record(rec, req.nodes)
            create_job(self._cluster.store, rec.id, self._codec.seal(spec), time.time(),
                       records=self._codec.records, expected=spec.nodes)
        except (StoreError, ValueError) as exc:
            self._registry.discard(rec.id)
            raise errors.Unavailable(f"etcd unavailable, the job was not submitted: {exc}") \
                from None
        log.info("%s: submitted by %s: %s", ctx(job=rec.id, node=self._cfg.daemon.node_id),
                 rec.user, " ".join(rec.command)[:200])
        self.schedule()
        return self._registry.get(rec.id)

    def _admit(self, rec: JobRecord) -> None:
        """Refuse a job over this node's limits or its user's (limits.*)."""
        lim = self._cfg.limits
        if self._registry.count_live() >= self._cfg.control.max_live_jobs:
            raise errors.ResourceExhausted(
                f"this node already holds {self._cfg.control.max_live_jobs} unfinished jobs "
                "(control.max_live_jobs); wait for some to finish or cancel some")
        jobs, held = self._registry.usage(rec.uid)
        who = f"uid {rec.uid}" + (f" ({rec.user})" if rec.user else "")
        if jobs >= lim.jobs_per_user:
            raise errors.ResourceExhausted(
                f"{who} has {jobs} unfinished jobs (limits.jobs_per_user {lim.jobs_per_user}); "
                "wait for some to finish or cancel some")
        size = spec_bytes(rec)
        if held + size > lim.spec_bytes_per_user:
            raise errors.ResourceExhausted(
                f"{who} holds {held} bytes of job specs and this one adds {size} "
                f"(limits.spec_bytes_per_user {lim.spec_bytes_per_user}); submit smaller "
                "commands and environments, or wait for jobs to finish")
        total = self._registry.spec_bytes_total()
        if total + size > lim.spec_bytes_total:
            raise errors.ResourceExhausted(
                f"this node holds {total} bytes of job specs and this one adds {size} "
                f"(limits.spec_bytes_total {lim.spec_bytes_total}); wait for jobs to finish")

    def _check_cluster_policy(self, req: JobRequest, caller: Caller) -> None:
        """Refuse at once a job that cannot start because the other nodes will not run
        it as this caller (clusterspec.ClusterPolicy): it needs nodes besides this one.
        One that may also run here alone is taken; only this node runs it."""
        if self._policy is None or self._cfg.daemon.standalone:
            return
        why = self._policy.refusal(caller.uid, caller.gid)
        me = self._cfg.daemon.node_id
        if why and (req.min_nodes > 1 or (req.nodes and me not in req.nodes)):
            raise errors.FailedPrecondition(
                f"the other nodes will not run this job: {why} (their cluster settings). "
                "Submit it as a regular user, or run it on this node alone (--nnodes 1, "
                "no --nodes), or set cluster.allow_root_jobs = true on every node")

    def get_for(self, key: str, caller: Caller) -> JobRecord:
        try:
            job = self._registry.get(key)
        except JobNotFound:
            raise errors.NotFound(f"no job {key!r} on this node; `elasticctl list` shows "
                                  "the jobs you can see") from None
        check_access(job, caller)
        return job

    def cancel(self, key: str, caller: Caller) -> JobRecord:
        job = self.get_for(key, caller)
        if job.state in TERMINAL_STATES:
            return job
        with self._lock:
            job = self._registry.get(job.id)
            if job.id not in self._agents:
                reason = f"cancelled by {caller.user}"
                self._finish_cancelled(job, reason)
                return self._registry.transition(job.id, JobState.CANCELLED, reason)
            if job.cancel_requested:  # its agent is stopping it: nothing to write again
                return job
            self._registry.update(job.id, cancel_requested=True)
            self._registry.event(job.id, "info", f"cancel requested by {caller.user}")
            agent = self._agents.get(job.id)
        if agent is not None:
            agent.poke()
        return self._registry.get(job.id)

    def cancel_elsewhere(self, job: JobRecord, caller: Caller) -> None:
        """Cancel a cluster job that other nodes run (``job`` as the cluster
        knows it): its round goes to cancelled, and the agents of the nodes
        that run it stop their workers and end their records, as after a
        cancel on one of them."""
        check_access(job, caller)
        self._finish_cancelled(job, f"cancelled by {caller.user} on {self._cfg.daemon.node_id}")

    def _finish_cancelled(self, job: JobRecord, reason: str) -> None:
        rdzv = self._rendezvous_for(job)
        try:
            rdzv.finish(CANCELLED, reason)
        except StoreError as exc:
            raise errors.FailedPrecondition(f"etcd unavailable, job not cancelled: {exc}") \
                from None
        finally:
            rdzv.close()

    # -- scheduling ----------------------------------------------------------
    def schedule(self) -> None:
        """Start agents for pending jobs that fit, oldest first."""
        with self._lock:
            if self._stopping:
                return
            free = self.slots_total - self.slots_used()
            me = self._cfg.daemon.node_id
            waiting = [j for j in self._registry.list()
                       if j.state in (JobState.PENDING, JobState.RESTARTING)
                       and j.id not in self._agents and (not j.nodes or me in j.nodes)]
            # Resumed jobs (RESTARTING) go before new ones.
            waiting.sort(key=lambda j: (j.state != JobState.RESTARTING, j.created_at))
            for job in waiting:
                if job.nproc_per_node > free:
                    continue
                binding = self._bind(job)
                if binding is None:
                    continue
                free -= job.nproc_per_node
                agent = Agent(job.id, self._cfg, self._registry, self._rendezvous_for(job),
                              on_exit=self._agent_exited, metrics=self._metrics,
                              binding=binding, health=self._health,
                              templates=self.templates, snapshots=self.snapshots,
                              quarantine=self.quarantine_state,
                              phases=self.phases.for_job(job.id, self._cfg.daemon.node_id,
                                                         lambda: self._cluster.keeper.lease))
                self._agents[job.id] = agent
                agent.start()

    def _bind(self, job: JobRecord):
        """The job's devices on this node (gpu_alloc.Binding), taken from the ledger;
        None, with the job's reason saying why, while not enough are free."""
        count = self.gpus_needed(job)
        total = self.gpus.total
        if count > total:
            why = (f"needs {count} GPUs per node; this node has {total} "
                   f"(daemon.gpus, found by {self.gpus.inventory.source})")
        else:
            gpus = self.gpus.take(job.id, count, prefer=job.gpu_indices)
            if gpus is not None:
                binding = binding_for(gpus, job.cpu_bind, total > 0)
                if list(binding.indices) != list(job.gpu_indices):
                    self._registry.update(job.id, gpu_indices=binding.indices)
                return binding
            held = sorted(self.gpus.held())
            why = (f"waiting for {count} free GPUs: {len(self.gpus.free())} of {total} free"
                   + (f" (held by job {', '.join(held)})" if held else ""))
        if job.state is JobState.PENDING and job.reason != why:
            self._registry.update(job.id, reason=why)
        return None

    def _rendezvous_for(self, job: JobRecord) -> ClusterRendezvous:
        r = self._cfg.rendezvous
        limits = JobLimits(min_nodes=job.min_nodes, max_nodes=job.max_nodes,
                           max_restarts=job.max_restarts, last_call=r.last_call,
                           join_timeout=r.join_timeout,
                           max_restarts_in_window=job.max_restarts_per_window,
                           restart_window=job.restart_window,
                           rejoin_timeout=r.rejoin_timeout)
        keeper = self._cluster.keeper
        probe = DaemonProbe(lambda node: self._cluster.daemon_port(node), r.gone_probe_timeout)
        return ClusterRendezvous(self._cluster.store, self._view, job.id,
                                 self._cfg.daemon.node_id, self._cluster.address,
                                 job.nproc_per_node, lambda: keeper.lease, limits,
                                 scale_up=r.scale_up, poll=r.poll, probe=probe,
                                 sync_timeout=2 * self._cfg.etcd.request_timeout,
                                 done_recheck=r.done_recheck, ran_before=job.round)

    def adopt(self, spec: JobSpec) -> JobRecord | None:
        """Take on a job submitted on another node (its spec checked where it was read:
        trust/specs.py); None if this node has it already or cannot keep it."""
        rec = spec.record()
        try:
            try:
                rec = self._registry.create(rec)
            except NameInUse:
                rec.name = ""
                rec = self._registry.create(rec)
        except JobExists:
            return None
        except NotPersisted as exc:
            log.error("%s: cannot adopt: %s", ctx(job=rec.id, node=self._cfg.daemon.node_id),
                      exc)
            return None
        log.info("%s: adopted from the cluster (submitted on %s)",
                 ctx(job=rec.id, node=self._cfg.daemon.node_id), rec.node_id)
        self.schedule()
        return rec

    def end_from_cluster(self, job_id: str, state) -> None:
        """A job waiting here ended elsewhere: record how (one with an agent here: the
        agent is woken to see it, from any wait it is in)."""
        with self._lock:
            agent = self._agents.get(job_id)
            if agent is not None:
                agent.poke()
                return
            job = self._registry.get(job_id)
            if job.state in TERMINAL_STATES:
                return
            target = final_job_state(state.status)
            self._registry.transition(job_id, target, state.reason or state.status,
                                      restarts=state.restarts,
                                      restart_times=list(state.restart_times),
                                      exit_code=0 if target is not JobState.FAILED else 1)

    def _agent_exited(self, job_id: str) -> None:
        with self._lock:
            self._agents.pop(job_id, None)
            self.gpus.release(job_id)
            if self.snapshots is not None:
                self.snapshots.release(job_id)
        for listener in self.agent_exit_listeners:
            listener(job_id)
        self.schedule()

    def capacity(self) -> tuple[int, list[str]]:
        """(slots free, ids of the jobs holding slots): what the node record says."""
        return self.slots_total - self.slots_used(), self.active_jobs()

    def active_jobs(self) -> list[str]:
        with self._lock:
            return list(self._agents)

    # -- life cycle ----------------------------------------------------------
    def resume(self) -> None:
        """Pick up jobs a previous daemon left unfinished (node/resume.py)."""
        Resumer(self._cfg, self._registry, self._view, self._cluster.store,
                self._codec).resume(self.end_from_cluster)
        try:  # the templates idle at the last stop: users' next jobs warm from the first
            self.templates.restore()
        except Exception:
            log.exception("%s: could not restore the idle worker templates",
                          ctx(node=self._cfg.daemon.node_id))
        self.schedule()

    def shutdown(self, timeout: float) -> None:
        """Stop every job's workers; their records stay live for the next start."""
        with self._lock:
            self._stopping = True
            agents = list(self._agents.values())
        for agent in agents:
            agent.shutting_down = True
            agent.poke()
        for agent in agents:
            if not agent.join(timeout):
                log.error("%s: agent did not stop within %.0fs", ctx(job=agent.job_id), timeout)
        self.templates.stop()
