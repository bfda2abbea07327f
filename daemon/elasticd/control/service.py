"""The control service: elasticctl's gRPC API on the local unix socket.

Every call first turns its credential token into a ``Caller`` (see control/auth.py),
checks its request (control/validation.py), then asks the job manager. Errors leave
as gRPC status codes with a message a person can act on; an unexpected
exception becomes INTERNAL and is logged, and the daemon carries on.
"""
from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..cluster import remote_jobs as clusterjobs
from .. import errors, statedir
from . import validation
from .auth import TOKEN_METADATA_KEY, AuthError, Caller, TokenIssuer, set_socket_access
from ..config import Config
from ..jobs.names import AmbiguousName
from ..jobs.registry import JobNotFound, JobRecord, JobRegistry
from .logs import LogReader
from ..jobs.scheduler import JobManager, check_access
from .messages import (
    add_worker, event_to_proto, gpus_to_proto, job_to_proto, node_to_proto, rejection_to_proto)
from ..store import StoreError
from .streamgate import StreamGate
from ..jobs.states import TERMINAL_STATES, WorkerState
from ..v1 import control_pb2 as pb
from ..v1 import control_pb2_grpc as pb_grpc
from ..workers import hostname

log = logging.getLogger("elasticd.control.service")

SERVICE_NAME = "elasticd.v1.Control"
SETTLE_SECONDS = 2.0  # how long WaitJob waits for the rows of a job other nodes ended


def _status(exc: errors.ElasticdError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def _handle(method):
    """Map our errors to status codes; never let an exception kill a call badly."""
    name = method.__name__

    def fail(self, context, exc: BaseException) -> None:
        if isinstance(exc, errors.ElasticdError):
            code, msg = _status(exc), str(exc)
        else:
            log.exception("control %s failed", name)
            code, msg = grpc.StatusCode.INTERNAL, f"internal error in elasticd: {exc!r} " \
                                                  "(see the daemon's log)"
        self._observe(name, code, context)
        context.abort(code, msg)

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):
            context.started = time.perf_counter()
            try:
                caller = self._caller(context)
                with self._streams.slot(caller.uid, name):
                    yield from method(self, request, context, caller)
                self._observe(name, grpc.StatusCode.OK, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                if _is_abort(exc):
                    raise
                fail(self, context, exc)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        context.started = time.perf_counter()
        try:
            result = method(self, request, context, self._caller(context))
            self._observe(name, grpc.StatusCode.OK, context)
            return result
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if _is_abort(exc):
                raise
            fail(self, context, exc)
    return unary


def _is_abort(exc: BaseException) -> bool:
    # grpc raises a bare Exception from context.abort(); it carries no type of its own.
    return type(exc) is Exception and not exc.args


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


def _suspect_line(reason: str) -> str:
    return f"suspect, preferred last for cluster jobs: {reason}" if reason else ""


def _settled(job: JobRecord) -> bool:
    """Ended, and every node's last worker rows published (none still running)."""
    return job.state in TERMINAL_STATES and not any(w.state is WorkerState.RUNNING
                                                    for w in job.workers)


class ControlServicer(pb_grpc.ControlServicer):
    def __init__(self, cfg: Config, manager: JobManager, registry: JobRegistry,
                 issuer: TokenIssuer, metrics=None, cluster=None, view=None):
        self._cfg = cfg
        self._manager = manager
        self._registry = registry
        self._issuer = issuer
        self._metrics = metrics
        self._cluster = cluster
        self._view = view
        self._streams = StreamGate(cfg.limits.streams_total, cfg.limits.streams_per_user)

    def _caller(self, context) -> Caller:
        token = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY)
        try:
            return self._issuer.verify(token)
        except AuthError as exc:
            raise errors.Unauthenticated(str(exc)) from None

    def _observe(self, method: str, code: grpc.StatusCode, context) -> None:
        if self._metrics is not None:
            self._metrics.observe_rpc(method, code.name,
                                      time.perf_counter() - getattr(context, "started", 0))

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

    @_handle
    def Submit(self, request, context, caller):
        req = validation.submit_request(request, self._cfg.control)
        validation.caller_can_enter(req.cwd, caller.uid, caller.gid,
                                    self._cfg.control.cwd_check_timeout)
        return pb.SubmitResponse(job=self._fit(job_to_proto(self._manager.submit(req, caller))))

    @_handle
    def ListJobs(self, request, context, caller):
        # root sees every job; anyone else only their own. This node's records
        # only: a cluster job other nodes run is found by GetJob (see _find).
        # In pages of at most limits.response_bytes, oldest first; a page
        # token is the (created_at, id) of the last job of the page before.
        after = _page_key(request.page_token)
        jobs = [j for j in self._registry.list()
                if caller.may_act_on(j.uid) and (after is None or (j.created_at, j.id) > after)]
        resp, budget = pb.ListJobsResponse(), self._cfg.limits.response_bytes
        for job in jobs:
            msg = self._fit(job_to_proto(job))
            if resp.jobs and resp.ByteSize() + msg.ByteSize() + 16 > budget:
                last = resp.jobs[-1]
                resp.next_page_token = f"{last.created_at!r} {last.id}"
                break
            resp.jobs.append(msg)
        return resp

    def _with_cluster(self, job: JobRecord) -> pb.Job:
        """The job as this node knows it, with the other nodes' workers added."""
        msg = job_to_proto(job)
        keys = self._view.job(job.id) if self._view is not None else None
        if keys is not None:
            for row in clusterjobs.worker_rows(keys, skip=self._cfg.daemon.node_id):
                add_worker(msg, row)
        return msg

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
        return clusterjobs.record_from_keys(found[1], time.time())

    def _refresh(self, job: JobRecord, here: bool) -> JobRecord:
        """The job's record now: from the registry, or from the cluster's keys."""
        if here:
            return self._registry.get(job.id)
        keys = self._view.job(job.id)
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

    @_handle
    def GetJob(self, request, context, caller):
        job, here, rejected = self._find_or_rejected(request.id, caller)
        if rejected is not None:
            return rejection_to_proto(rejected, self._cfg.daemon.node_id)
        return self._fit(self._with_cluster(job) if here else job_to_proto(job))

    @_handle
    def CancelJob(self, request, context, caller):
        job, here = self._find(request.id, caller)
        if not here:
            return self._fit(job_to_proto(self._cancel_elsewhere(job, caller)))
        job = self._manager.cancel(job.id, caller)
        # Answer once the workers are stopped (graceful stop plus a margin), so
        # the caller sees CANCELLED rather than a job still shutting down.
        finished = lambda: self._registry.get(job.id).state in TERMINAL_STATES  # noqa: E731
        self._registry.wait_for_change(finished, self._cfg.agent.stop_grace_period + 2.0)
        return self._fit(job_to_proto(self._registry.get(job.id)))

    def _cancel_elsewhere(self, job: JobRecord, caller) -> JobRecord:
        """Cancel a job only other nodes run, through its round state; answer
        once its workers there are stopped (their grace period plus a margin)."""
        if job.state in TERMINAL_STATES:
            return job
        self._manager.cancel_elsewhere(job, caller)
        return self._wait_until(job, False, _settled, self._cfg.agent.stop_grace_period + 2.0)

    @_handle
    def WaitJob(self, request, context, caller):
        job, here, rejected = self._find_or_rejected(request.id, caller)
        timeout = request.timeout_seconds
        if timeout < 0 or timeout != timeout:
            raise errors.InvalidArgument(f"timeout_seconds: must be >= 0, got {timeout}")
        if rejected is not None:  # it will never run here
            return rejection_to_proto(rejected, self._cfg.daemon.node_id)
        gone = self._gone(context)
        with self._streams.slot(caller.uid, "wait"):  # long-lived: a stream's thread
            job = self._wait_until(job, here, lambda j: j.state in TERMINAL_STATES,
                                   timeout or None, gone)
            if not here and job.state in TERMINAL_STATES:
                # A node ends the round, then publishes its workers' last rows.
                job = self._wait_until(job, here, _settled, SETTLE_SECONDS, gone)
        return self._fit(job_to_proto(job))

    @_handle
    def Logs(self, request, context, caller):
        job, here = self._find(request.id, caller)
        if not here:
            keys = self._view.job(job.id)
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
        keys = self._view.job(job_id) if self._view is not None else None
        if keys is None:
            return ""
        me = self._cfg.daemon.node_id
        for node, rows in keys.workers.items():
            if node != me and any(isinstance(w, dict) and w.get("rank") == rank for w in rows):
                address = next((m.address for m in (keys.state.members if keys.state else ())
                                if m.node_id == node), "")
                return f"{node} ({address})" if address else node
        return ""

    @_handle
    def Events(self, request, context, caller):
        job_id = ""
        if request.id:
            job, _, rejected = self._find_or_rejected(request.id, caller)
            job_id = job.id if job is not None else rejected.job_id
        owners: dict[str, int] = {}

        def visible(ev: dict) -> bool:
            if caller.is_root:
                return True
            if ev["kind"] == "rejected":  # its uid only if the signature vouched for it
                return ev.get("uid") == caller.uid
            if ev["job_id"] not in owners:
                uid = self._owner(ev["job_id"])
                if uid is None:
                    return False  # not known yet: ask again at its next event
                owners[ev["job_id"]] = uid
            return owners[ev["job_id"]] == caller.uid

        last = max(0, request.after_seq)
        gone = self._gone(context)
        while not gone.is_set():
            batch = self._registry.events(last, job_id or None)
            for ev in batch:
                last = ev["seq"]
                if visible(ev):
                    yield event_to_proto(ev)
            if len(batch) == 1000:
                continue
            if not request.follow:
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
        try:
            return int(keys.spec["uid"])
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    @_handle
    def ListNodes(self, request, context, caller):
        cluster = self._cluster
        view = cluster.watcher.snapshot()
        try:
            drains = cluster.drain_states()
        except StoreError:
            drains = {}
        me = self._cfg.daemon.node_id
        live = dict(view.live)
        if me not in live:  # not (yet) registered: still say who we are
            live[me] = cluster.record()
        nodes = []
        for node_id, rec in sorted(live.items()):
            # Our own refresh we timed; a peer's lease is alive, so its last
            # refresh was within its TTL (-1: "less than lease_ttl_seconds").
            age = (time.time() - cluster.keeper.last_refresh
                   if node_id == me and cluster.keeper.last_refresh else -1.0)
            msg = node_to_proto(rec, "draining" if node_id in drains else "ready", age)
            if node_id == me:
                msg.problems.extend(self._problems())
                gpus_to_proto(msg, self._manager.gpus.inventory, self._manager.gpu_holders())
                msg.gpus_free = self._manager.gpus_free()  # now, not at the last refresh
                msg.idle_templates.extend(
                    pb.IdleTemplate(uid=t.uid, pid=t.pid, key=t.key,
                                    idle_seconds=t.idle_seconds, rss_bytes=t.rss_bytes)
                    for t in self._manager.templates.idle())
            nodes.append(msg)
        for node_id, (lost_at, rec) in sorted(view.lost.items()):
            if node_id not in live:
                msg = node_to_proto(rec, "lost", time.time() - lost_at)
                msg.lost_at = lost_at
                nodes.append(msg)
        return pb.ListNodesResponse(nodes=nodes, store=cluster.kind,
                                    store_health=cluster.health())

    def _problems(self) -> list[str]:
        """What is wrong on this node, one line each."""
        try:
            space = statedir.disk_space(self._cfg.daemon.state_dir,
                                        self._cfg.limits.state_min_free_bytes)
        except OSError as exc:
            return [f"state dir {self._cfg.daemon.state_dir}: {exc}"]
        return [p for p in (space.problem(self._cfg.daemon.state_dir),
                            hostname.cached_problem(),
                            self._manager.gpu_problem(),
                            _suspect_line(self._manager.suspect_reason())) if p]

    @_handle
    def SetNodeState(self, request, context, caller):
        if not caller.is_root:
            raise errors.PermissionDenied("only root may drain or uncordon a node")
        if request.state not in ("draining", "ready"):
            raise errors.InvalidArgument(f"state: must be draining or ready, got "
                                         f"{request.state[:40]!r}")
        node_id = validation.job_key(request.node_id)
        view = self._cluster.watcher.snapshot()
        if node_id not in view.live and node_id != self._cfg.daemon.node_id:
            raise errors.NotFound(f"no live node {node_id!r}; `elasticctl nodes` lists them")
        try:
            self._cluster.set_drain(node_id, request.state == "draining", caller.user)
        except StoreError as exc:
            raise errors.FailedPrecondition(f"etcd unavailable, node state unchanged: {exc}") \
                from None
        rec = view.live.get(node_id) or self._cluster.record()
        return node_to_proto(rec, request.state, 0.0)


class ControlServer:
    """Owns the gRPC server on the control socket and its health service."""

    def __init__(self, cfg: Config, servicer: ControlServicer, gid: int | None):
        self._cfg = cfg
        self._gid = gid
        c = cfg.control
        lim = cfg.limits
        threads = c.rpc_threads + lim.streams_total  # streams never take the short calls' share
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
            options=[("grpc.max_receive_message_length", c.max_message_bytes),
                     ("grpc.max_send_message_length", 64 * 1024 * 1024),
                     # A flood of connections is closed, not kept until the fds run out:
                     ("grpc.max_allowed_incoming_connections", lim.max_connections),
                     ("grpc.server_handshake_timeout_ms", int(lim.handshake_timeout * 1000)),
                     ("grpc.max_connection_idle_ms", int(lim.idle_timeout * 1000))],
            maximum_concurrent_rpcs=threads * 4)
        pb_grpc.add_ControlServicer_to_server(servicer, self._server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def start(self) -> None:
        path = self._cfg.daemon.socket
        if os.path.exists(path):
            os.unlink(path)  # auth.CredentialServer already refused a live daemon
        old = os.umask(0o177)
        try:
            if not self._server.add_insecure_port(f"unix:{path}"):
                raise RuntimeError(f"cannot listen on {path}")
        finally:
            os.umask(old)
        self._server.start()
        set_socket_access(path, self._gid)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1)
        try:
            os.unlink(self._cfg.daemon.socket)
        except FileNotFoundError:
            pass
