"""Job records, events and node records as control API messages (control.proto).

The daemon keeps plain dicts and dataclasses; these functions are the one
place that turns them into what ``elasticctl`` receives.
"""
from __future__ import annotations

import time

from ..gpus.inventory import cpu_list_text
from ..jobs.jobevent import JobEvent
from ..jobs.registry import JobRecord
from ..jobs.records import WorkerRow
from ..jobs.restartpolicy import RestartPlan, RestartWindow
from ..jobs.states import TERMINAL_STATES
from ..v1 import control_pb2 as pb
from ..workers.snapshot_status import SnapshotRow


def job_to_proto(job: JobRecord) -> pb.Job:
    msg = pb.Job(
        id=job.id, name=job.name, state=pb.JobState.Value(job.state.value), reason=job.reason,
        command=job.command, cwd=job.cwd, uid=job.uid, gid=job.gid, user=job.user,
        min_nodes=job.min_nodes, max_nodes=job.max_nodes, nproc_per_node=job.nproc_per_node,
        max_restarts=job.max_restarts, restarts=job.restarts, round=job.round,
        created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
        exit_code=job.exit_code, node_id=job.node_id, inprocess=job.inprocess,
        max_restarts_per_window=job.max_restarts_per_window,
        restart_window_seconds=job.restart_window,
        restarts_in_window=len(RestartWindow(job.max_restarts_per_window, job.restart_window)
                               .recent(job.restart_times, time.time())))
    plan = job.last_restart_plan
    if plan:
        try:
            p = RestartPlan.from_dict(plan)
            msg.last_restart_plan.CopyFrom(pb.RestartPlan(
                rule=p.rule.value, delay_seconds=p.delay, no_progress_streak=p.streak,
                beats=p.beats, ran_seconds=p.ran_for, summary=p.sentence(),
                node_id=str(plan.get("node_id", "")), time=float(plan.get("time", 0.0))))
        except (KeyError, TypeError, ValueError):
            pass  # a record from another version: leave it out
    seconds = dict(job.seconds_in_state)
    if job.state not in TERMINAL_STATES:
        seconds[job.state.value] = seconds.get(job.state.value, 0.0) + max(
            0.0, time.time() - job.state_since)
    msg.seconds_in_state.update(seconds)
    if job.last_failure:
        f = job.last_failure
        msg.last_failure.CopyFrom(pb.Failure(
            rank=f.rank, exit_code=f.exit_code, signal=f.signal, cause=f.cause,
            traceback=f.traceback, time=f.time, restart=f.restart, node_id=f.node_id))
    msg.restarts_by_layer.update({k: int(v) for k, v in job.restarts_by_layer.items()})
    msg.restart_budget.update({k: int(v) for k, v in job.restart_budget.items()})
    for a in job.attempts:
        msg.attempts.add(layer=a.layer.value, cause=a.cause, time=a.time,
                         duration_seconds=a.duration, outcome=a.outcome.value, rank=a.rank,
                         node_id=a.node_id)
    for p in job.hang_timeouts:
        msg.hang_timeouts.add(phase=p.get("phase", ""), soft_seconds=p.get("soft", 0.0),
                              hard_seconds=p.get("hard", 0.0), learned=p.get("learned", False),
                              longest_gap_seconds=p.get("longest", 0.0), gaps=p.get("gaps", 0))
    if job.straggler:
        s = job.straggler
        msg.straggler.CopyFrom(pb.Straggler(
            rank=s.get("rank", -1), ratio=s.get("ratio", 0.0),
            step_seconds=s.get("step_seconds", 0.0),
            median_step_seconds=s.get("median_step_seconds", 0.0), ranks=s.get("ranks", 0),
            node_id=s.get("node_id", ""), nodes=s.get("nodes", 1),
            rank_node_id=s.get("rank_node", "")))
    for w in job.workers:
        add_worker(msg, w)
    msg.gpus_per_node, msg.cpu_bind = job.gpus_per_node, job.cpu_bind
    msg.spares = job.spares
    msg.template_state, msg.template_reason = job.template_state, job.template_reason
    msg.template_rss_bytes, msg.start_path = job.template_rss_bytes, job.start_path
    msg.start_seconds = job.start_seconds
    msg.learned_preload.extend(job.learned_preload)
    return msg


def add_worker(msg: pb.Job, w: WorkerRow) -> None:
    """One worker row into the job message's ``workers``."""
    msg.workers.add(rank=w.rank, local_rank=w.local_rank, pid=w.pid, state=w.state.value,
                    exit_code=w.exit_code, node_id=w.node_id, gpus=w.gpus,
                    gpu_uuids=w.gpu_uuids, cpus=w.cpus, start_path=w.start_path)


def add_snapshot(msg: pb.Job, node_id: str, row: SnapshotRow, now: float) -> None:
    """One node's snapshots of the job (replication/messages.py SnapshotRow: its own, or
    what another node answered) into ``snapshots``; where its newest replica is, as
    "<node> step <n>"."""
    msg.snapshots.add(node_id=node_id, step=row.step, saved_at=row.saved_at,
                      age_seconds=row.age(now), bytes=row.bytes, ranks=row.ranks,
                      held_bytes=row.held_bytes, budget_bytes=row.budget_bytes,
                      replicas=[f"{row.replica_node} step {row.replica_step}"]
                      if row.replica_node else [])


def event_to_proto(ev: JobEvent) -> pb.Event:
    def state(value: str) -> int:
        return pb.JobState.Value(value) if value else pb.JOB_STATE_UNSPECIFIED
    return pb.Event(seq=ev.seq, job_id=ev.job_id, time=ev.time, kind=ev.kind,
                    from_state=state(ev.from_state), to_state=state(ev.to_state),
                    reason=ev.reason, node_id=ev.node_id, round=ev.round,
                    rank=ev.rank, restart=ev.restart, layer=ev.layer,
                    duration_seconds=ev.duration_seconds,
                    rejected_reason=ev.rejected_reason, restart_rule=ev.restart_rule,
                    restart_delay_seconds=ev.restart_delay_seconds,
                    start_path=ev.start_path)


def rejection_to_proto(rej, node_id: str) -> pb.Job:
    """A job spec this node refused (rejections.Rejection), as ``status`` shows it."""
    return pb.Job(id=rej.job_id, state=pb.REJECTED, reason=rej.message,
                  rejected_reason=rej.reason.value, uid=rej.uid or 0, node_id=node_id,
                  created_at=rej.time, finished_at=rej.time, exit_code=1)


def node_to_proto(rec: dict, state: str, age: float) -> pb.Node:
    return pb.Node(node_id=rec.get("node_id", ""), state=state, host=str(rec.get("host", "")),
                   address=str(rec.get("address", "")), slots=int(rec.get("slots", 0)),
                   slots_free=int(rec.get("slots_free", 0)), version=str(rec.get("version", "")),
                   started_at=float(rec.get("started_at", 0.0)), heartbeat_age_seconds=age,
                   lease_ttl_seconds=float(rec.get("lease_ttl", 0) or 0),
                   jobs=[str(j) for j in rec.get("jobs", [])][:1000],
                   gpus=int(rec.get("gpus", 0)), gpus_free=int(rec.get("gpus_free", 0)),
                   gpu_source=str(rec.get("gpu_source", "")),
                   gpu_health=str(rec.get("gpu_health", "")),
                   suspect=str(rec.get("suspect", "")))


def gpus_to_proto(msg: pb.Node, inv, holders: dict) -> None:
    """This node's own devices (gpu_inventory.Inventory) and who holds each."""
    for g in inv.gpus:
        msg.devices.add(index=g.index, uuid=g.uuid, memory_mib=g.memory_mib,
                        numa_node=g.numa_node, cpus=cpu_list_text(g.cpus),
                        job_id=holders.get(g.index, ""))
