"""The control service: elasticctl's gRPC API on the local unix socket.

Every call first turns its credential token into a ``Caller`` (see control/auth.py),
holds one of that caller's slots while it runs (control/streamgate.py), checks
its request (control/validation.py), then asks the job manager; none waits on
a job (``cancel`` answers at once, ``wait`` is the long-lived call for that). Errors leave
as gRPC status codes with a message a person can act on; an unexpected
exception becomes INTERNAL and is logged, and the daemon carries on.
"""
from __future__ import annotations

import logging
import os
import threading
import time

from .. import errors
from . import nodes, remote_jobs as clusterjobs, validation
from .handling import CallDoor, handled
from .auth import Caller, TokenIssuer, check_access
from ..config import Config
from ..jobs.jobevent import JobEvent
from ..jobs.names import AmbiguousName
from ..jobs.registry import JobNotFound, JobRecord, JobRegistry
from .logs import LogReader
from ..jobs.retention import logs_retired_message
from .messages import (
    add_snapshot, add_worker, event_to_proto, job_to_proto, node_to_proto, rejection_to_proto)
from ..store import StoreError
from ..jobs.states import TERMINAL_STATES, WorkerState
from ..workers import template_ahead
from ..workers.snapshot_status import row_of
from ..v1 import control_pb2 as pb
from ..v1 import control_pb2_grpc as pb_grpc

log = logging.getLogger("elasticd.control.service")

SERVICE_NAME = "elasticd.v1.Control"
SETTLE_SECONDS = 2.0  # how long WaitJob waits for the rows of a job other nodes ended
def _page_key(token: str) -> tuple[float, str] | None:
    """The (created_at, id) a ListJobs page token stands for; None: from the start."""
    if not token:
        return None
    stamp, _, job_id = token.partition(" ")
    try:
        return float(stamp), validation.job_key(job_id)
    except ValueError:
        raise errors.InvalidArgument(f"page_token: not one this daemon gave, got "
                                     f"{token[:60]!r}") from None


def _settled(job: JobRecord) -> bool:
    """Ended, and every node's last worker rows published (none still running)."""
    return job.state in TERMINAL_STATES and not any(w.state is WorkerState.RUNNING
                                                    for w in job.workers)


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, cfg: Config, manager, registry: JobRegistry,
                 issuer: TokenIssuer, metrics=None, cluster=None, view=None, endpoint=None,
                 replication=None, asker=None, events=None):
        self._cfg = cfg
        self._events = events  # cluster/eventlog.py EventLog: other nodes' events, as asked
        self._replication = replication  # replication/stats.py: where snapshots went
        self._asker = asker  # replication/asking.py RowAsker: the other nodes' rows
        self._manager = manager
        self._registry = registry
        self._cluster = cluster
        self._view = view
        self._endpoint = endpoint  # exposition.endpoint.MetricsEndpoint: its problem, if any
        self.door = CallDoor(cfg, issuer, metrics)  # control/handling.py: every call passes it

    @staticmethod
    def _gone(context) -> threading.Event:
        gone = threading.Event()
        context.add_callback(gone.set)
        return gone

    def _fit(self, msg: pb.Job) -> pb.Job:
        """The job, its command shortened if the answer would pass
        limits.response_bytes (a command may be as long as a request)."""
        budget = self._cfg.limits.response_bytes
        if msg.ByteSize() <= budget:
            return msg
        args, room = list(msg.command), budget // 2
        kept = []
        for arg in args:
            room -= len(arg.encode()) + 8
            if room < 0:
                break
            kept.append(arg)
        kept.append(f"... ({len(args) - len(kept)} more arguments, "
                    f"{sum(len(a.encode()) for a in args)} bytes in all)")
        del msg.command[:]
        msg.command.extend(kept)
        return msg

    @handled
    def Submit(self, request, context, caller):
        req = validation.submit_request(request, self._cfg.control)
        validation.caller_can_enter(req.cwd, caller.uid, caller.gid,
                                    self._cfg.control.cwd_check_timeout)
        return pb.SubmitResponse(job=self._fit(job_to_proto(self._manager.submit(req, caller))))

    @handled
    def ListJobs(self, request, context, caller):
        # root sees every job; anyone else only their own. This node's records
        # only: a cluster job other nodes run is found by GetJob (see _find).
        # In pages of at most limits.response_bytes, oldest first; a page
        # token is the (created_at, id) of the last job of the page before.
        after = _page_key(request.page_token)
        jobs = self._registry.list(lambda j: caller.may_act_on(j.uid) and (
            after is None or (j.created_at, j.id) > after))
        resp, budget = pb.ListJobsResponse(), self._cfg.limits.response_bytes
        for job in jobs:
            msg = self._fit(job_to_proto(job))
            if resp.jobs and resp.ByteSize() + msg.ByteSize() + 16 > budget:
                last = resp.jobs[-1]
                resp.next_page_token = f"{last.created_at!r} {last.id}"
                break
            resp.jobs.append(msg)
        return resp

    def _with_cluster(self, job: JobRecord, keys) -> pb.Job:
        """The job as this node knows it (``keys``: its keys in the jobs view, or None),
        with the other nodes' workers added, and its
        snapshots: here (read from the slot headers: workers/snapshot_status.py) and on
        the round's other nodes (asked: replication/asking.py)."""
        msg = job_to_proto(job)
        now, me = time.time(), self._cfg.daemon.node_id
        ledger = getattr(self._manager, "snapshots", None)  # workers/snapshot_dirs.py
        own = row_of(ledger, job, self._replication.of_job(job.id)
                     if self._replication is not None else None)
        if own is not None:
            add_snapshot(msg, me, own, now)
        for node, row in sorted(self._peer_rows(job, keys).items()):
            if row.step >= 0 or row.ranks:
                add_snapshot(msg, node, row, now)
        if keys is not None:
            for row in clusterjobs.worker_rows(keys, skip=self._cfg.daemon.node_id):
                add_worker(msg, row)
        return msg

    def _peer_rows(self, job: JobRecord, keys) -> dict:
        """The snapshot rows of the job's other nodes in its round, asked over the
        replication channel (bounded: replication/asking.py); {} for a job on one node."""
        state = keys.state if keys is not None else None
        if self._asker is None or state is None:
            return {}
        return self._asker.rows(job.id, [(m.node_id, m.address) for m in state.members
                                         if m.node_id != self._cfg.daemon.node_id])

    def _find(self, key: str, caller) -> tuple[JobRecord, bool]:
        """The job with this id or name, if the caller may see it: (its record
        here, True), else (the record the cluster's keys make of a job only
        other nodes run, False). A name is looked up among the caller's jobs
        only (root: everyone's); another user's is NOT_FOUND, word for word as
        one nobody has. A live job wins over a finished one of the same name
        here; a name of several finished ones (or, for root, several live
        ones) is FAILED_PRECONDITION listing them (jobs/registry.py)."""
        key = validation.job_key(key)
        ambiguous = None
        try:
            local = self._registry.lookup(key, caller.may_act_on)
        except JobNotFound:
            local = None
        except AmbiguousName as exc:
            local, ambiguous = None, exc
        if local is not None and (local.id == key or local.live):
            check_access(local, caller)
            if local.live and local.nodes and self._cfg.daemon.node_id not in local.nodes:
                # submitted here for other nodes: what runs is theirs, in the cluster
                remote = self._remote(local.id, caller)
                if remote is not None:
                    return remote, False
            return local, True
        if ambiguous is not None and ambiguous.live:
            raise errors.FailedPrecondition(str(ambiguous))
        remote = self._remote(key, caller)
        if remote is not None:
            check_access(remote, caller)
            return remote, False
        if ambiguous is not None:
            raise errors.FailedPrecondition(str(ambiguous))
        if local is not None:
            check_access(local, caller)
            return local, True
        raise errors.NotFound(f"no job {key!r} on this node or in the cluster; "
                              "`elasticctl list` shows this node's jobs")

    def _find_or_rejected(self, key: str, caller):
        """(record, here, None) as ``_find``; for an id only known as a spec this node
        refused, (None, False, its Rejection) if the caller may see it."""
        try:
            return (*self._find(key, caller), None)
        except errors.NotFound:
            keys = self._view.job(key) if self._view is not None else None
            rej = keys.rejection if keys is not None else None
            if rej is None or not (caller.is_root or rej.uid == caller.uid):
                raise
            return None, False, rej

    def _remote(self, key: str, caller) -> JobRecord | None:
        if self._view is None:
            return None
        try:
            found = clusterjobs.find(self._view, key, caller.may_act_on)
        except clusterjobs.AmbiguousName as exc:
            if caller.is_root or any(self._owner(j) == caller.uid for j in exc.ids):
                raise errors.FailedPrecondition(str(exc)) from None
            return None  # only others' jobs bear the name: it tells nothing
        if found is None or (found[0] != key and self._owner(found[0]) != caller.uid
                             and not caller.is_root):
            return None  # another user's name: as if nobody had it
        keys = self._view.job(found[0], fresh=True, rows=True) or found[1]
        return clusterjobs.record_from_keys(keys, time.time())

    def _refresh(self, job: JobRecord, here: bool) -> JobRecord:
        """The job's record now: from the registry, or from the cluster's keys."""
        if here:
            return self._registry.get(job.id)
        keys = self._view.job(job.id, fresh=True, rows=True)
        return (clusterjobs.record_from_keys(keys, time.time()) if keys else None) or job

    def _wait_until(self, job: JobRecord, here: bool, done, timeout: float | None, gone=None):
        """Wait (in steps of at most a second) until ``done(record)``, the
        timeout, or the caller goes; the record then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done(job) and not (gone is not None and gone.is_set()):
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                break
            if here:
                self._registry.wait_for_change(lambda: done(self._registry.get(job.id)), left)
                job = self._refresh(job, here)
            else:
                seen = self._view.revision  # before the look: a change after it wakes us
                job = self._refresh(job, here)
                if not done(job):
                    self._view.wait(left, seen)
                    job = self._refresh(job, here)
        return job

    @handled
    def GetJob(self, request, context, caller):
        job, here, rejected = self._find_or_rejected(request.id, caller)
        if rejected is not None:
            return rejection_to_proto(rejected, self._cfg.daemon.node_id)
        # the job's keys, its rounds read once here if this node does not follow them,
        # and every node's worker rows (which no node watches)
        keys = self._view.job(job.id, fresh=True, rows=True) if self._view is not None \
            else None
        msg = self._with_cluster(job, keys) if here else job_to_proto(job)
        if keys is not None:
            msg.spare_nodes.extend(clusterjobs.spares_of(keys))
        return self._fit(msg)

    @handled
    def CancelJob(self, request, context, caller):
        job, here = self._find(request.id, caller)
        if not here:
            return self._fit(job_to_proto(self._cancel_elsewhere(job, caller)))
        # At once: the agent stops the workers in the background (SIGTERM, the grace
        # period, SIGKILL); `wait` and `events` tell when the job has ended.
        return self._fit(job_to_proto(self._manager.cancel(job.id, caller)))

    def _cancel_elsewhere(self, job: JobRecord, caller) -> JobRecord:
        """Cancel a job only other nodes run, through its round state; at once (their
        agents stop the workers)."""
        if job.state in TERMINAL_STATES:
            return job
        self._manager.cancel_elsewhere(job, caller)
        return self._refresh(job, False)

    @handled
    def WaitJob(self, request, context, caller):
        job, here, rejected = self._find_or_rejected(request.id, caller)
        timeout = request.timeout_seconds
        if timeout < 0 or timeout != timeout:
            raise errors.InvalidArgument(f"timeout_seconds: must be >= 0, got {timeout}")
        if rejected is not None:  # it will never run here
            return rejection_to_proto(rejected, self._cfg.daemon.node_id)
        gone = self._gone(context)
        job = self._wait_until(job, here, lambda j: j.state in TERMINAL_STATES,
                               timeout or None, gone)
        if not here and job.state in TERMINAL_STATES:
            # A node ends the round, then publishes its workers' last rows.
            job = self._wait_until(job, here, _settled, SETTLE_SECONDS, gone)
        return self._fit(job_to_proto(job))

    @handled
    def Logs(self, request, context, caller):
        job, here = self._find(request.id, caller)
        if not here:
            keys = self._view.job(job.id, fresh=True, rows=True)
            nodes = clusterjobs.nodes_of(keys) if keys else []
            raise errors.FailedPrecondition(
                f"job {job.id} does not run on this node; its logs are on the nodes that run "
                f"it: " + (f"{', '.join(nodes)}: run `elasticctl logs {job.id}` there"
                           if nodes else "none has joined it yet"))
        ranks = None
        if request.HasField("rank"):
            world = job.nproc_per_node * max(job.max_nodes, 1)
            if not 0 <= request.rank < world:
                raise errors.InvalidArgument(f"rank: job {job.id} has ranks 0..{world - 1}, "
                                             f"got {request.rank}")
            ranks = [request.rank]
            elsewhere = self._rank_elsewhere(job.id, request.rank)
            if elsewhere:
                raise errors.FailedPrecondition(
                    f"rank {request.rank} of job {job.id} runs on node {elsewhere}; run "
                    f"`elasticctl logs {job.id} --rank {request.rank}` there")
        if request.tail_lines < 0:
            raise errors.InvalidArgument(f"tail_lines: must be >= 0, got {request.tail_lines}")
        if job.logs_retired_at:
            raise errors.NotFound(logs_retired_message(job.id, job.logs_retired_at))
        reader = LogReader(os.path.join(self._cfg.logs_dir, job.id), ranks, request.tail_lines)
        if not request.follow:
            for rank, text in reader.read(final=True):
                yield pb.LogChunk(rank=rank, text=text)
            return
        gone = self._gone(context)
        done = lambda: self._registry.get(job.id).state in TERMINAL_STATES  # noqa: E731
        for rank, text in reader.follow(done, gone.wait, self._cfg.control.log_follow_interval):
            yield pb.LogChunk(rank=rank, text=text)

    def _rank_elsewhere(self, job_id: str, rank: int) -> str:
        """The node (and address) where a rank last ran, if not this one."""
        keys = self._view.job(job_id, fresh=True, rows=True) if self._view is not None \
            else None
        if keys is None:
            return ""
        me = self._cfg.daemon.node_id
        for node, rows in keys.workers.items():
            if node != me and any(w.rank == rank for w in rows):
                address = next((m.address for m in (keys.state.members if keys.state else ())
                                if m.node_id == node), "")
                return f"{node} ({address})" if address else node
        return ""

    @handled
    def Events(self, request, context, caller):
        job_id = ""
        if request.id:
            job, _, rejected = self._find_or_rejected(request.id, caller)
            job_id = job.id if job is not None else rejected.job_id
        owners: dict[str, int] = {}

        def visible(ev: JobEvent) -> bool:
            if caller.is_root:
                return True
            if ev.kind == "rejected":  # its uid only if the signature vouched for it
                return ev.uid == caller.uid
            if ev.job_id not in owners:
                uid = self._owner(ev.job_id)
                if uid is None:
                    return False  # not known yet: ask again at its next event
                owners[ev.job_id] = uid
            return owners[ev.job_id] == caller.uid

        last = max(0, request.after_seq)
        gone = self._gone(context)
        followed = self._mirror(job_id, request.follow)
        try:
            yield from self._events_after(last, job_id, request.follow, visible, gone)
        finally:
            if followed:
                self._events.unfollow(job_id)

    def _mirror(self, job_id: str, follow: bool) -> bool:
        """Bring the other nodes' events of the job (``""``: every job's) into the
        registry: watched while the stream follows (True: unfollow after), else read
        once. etcd unavailable: this node's own, and what it imported before."""
        if self._events is None:
            return False
        try:
            if follow:
                self._events.follow(job_id, wait=self._cfg.etcd.request_timeout)
                return True
            self._events.read(job_id)
        except (StoreError, ValueError) as exc:
            log.debug("other nodes' events of %r not read: %s", job_id[:80], exc)
        return False

    def _events_after(self, last: int, job_id: str, follow: bool, visible, gone):
        while not gone.is_set():
            batch = self._registry.events(last, job_id or None)
            for ev in batch:
                last = ev.seq
                if visible(ev):
                    yield event_to_proto(ev)
            if len(batch) == 1000:
                continue
            if not follow:
                return
            self._registry.wait_for_change(lambda: self._registry.last_seq > last, 1.0)

    def _owner(self, job_id: str) -> int | None:
        """The uid a job runs as: from its record here, else (a job another node
        runs, whose events are mirrored here) from its spec in the cluster."""
        try:
            return self._registry.get(job_id).uid
        except JobNotFound:
            pass
        keys = self._view.job(job_id) if self._view is not None else None
        return keys.spec.uid if keys is not None and keys.spec is not None else None

    @handled
    def ListNodes(self, request, context, caller):
        return nodes.answer(self._cfg, self._cluster, self._manager, caller, self._endpoint,
                            clusterjobs.spare_roles(self._view) if self._view is not None
                            else {})

    @handled
    def SetNodeState(self, request, context, caller):
        if not caller.is_root:
            raise errors.PermissionDenied("only root may drain or uncordon a node")
        if request.state not in ("draining", "ready"):
            raise errors.InvalidArgument(f"state: must be draining or ready, got "
                                         f"{request.state[:40]!r}")
        node_id = validation.job_key(request.node_id)
        held = self._cluster.watcher.record(node_id, fresh=True)
        if held is None and node_id != self._cfg.daemon.node_id:
            raise errors.NotFound(f"no live node {node_id!r}; `elasticctl nodes` lists them")
        try:
            self._cluster.set_drain(node_id, request.state == "draining", caller.user)
        except StoreError as exc:
            raise errors.FailedPrecondition(f"etcd unavailable, node state unchanged: {exc}") \
                from None
        rec = held or self._cluster.record()
        return node_to_proto(rec, request.state, 0.0)

    @handled
    def WarmTemplate(self, request, context, caller):
        req = validation.submit_request(pb.SubmitRequest(  # checked as the job it is for
            command=request.command, cwd=request.cwd, env=request.env,
            nproc_per_node=request.nproc_per_node), self._cfg.control)
        validation.caller_can_enter(req.cwd, caller.uid, caller.gid,
                                    self._cfg.control.cwd_check_timeout)
        got = template_ahead.warm(self._manager.templates, self._cfg, caller.uid, caller.gid,
                                  req.command, req.cwd, req.env, req.nproc_per_node)
        return pb.WarmTemplateResponse(pid=got.pid, key=got.key, state=got.state,
                                       already=got.already)
