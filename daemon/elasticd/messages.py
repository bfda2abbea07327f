"""Job records, events and node records as control API messages (control.proto).

The daemon keeps plain dicts and dataclasses; these functions are the one
place that turns them into what ``elasticctl`` receives.
"""
from __future__ import annotations

import time

from .jobs import JobRecord
from .restartpolicy import RestartPlan, RestartWindow
from .states import TERMINAL_STATES
from .v1 import control_pb2 as pb


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
            rank=f.get("rank", -1), exit_code=f.get("exit_code", 0), signal=f.get("signal", 0),
            cause=f.get("cause", ""), traceback=f.get("traceback", ""), time=f.get("time", 0.0),
            restart=f.get("restart", 0), node_id=f.get("node_id", "")))
    msg.restarts_by_layer.update({k: int(v) for k, v in job.restarts_by_layer.items()})
    msg.restart_budget.update({k: int(v) for k, v in job.restart_budget.items()})
    for a in job.attempts:
        msg.attempts.add(layer=a.get("layer", ""), cause=a.get("cause", ""),
                         time=a.get("time", 0.0), duration_seconds=a.get("duration", 0.0),
                         outcome=a.get("outcome", ""), rank=a.get("rank", -1),
                         node_id=a.get("node_id", ""))
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
            node_id=s.get("node_id", "")))
    for w in job.workers:
        msg.workers.add(rank=w["rank"], local_rank=w["local_rank"], pid=w["pid"],
                        state=w["state"], exit_code=w["exit_code"], node_id=w["node_id"],
                        start_path=w.get("start_path", ""))
    msg.template_state, msg.template_reason = job.template_state, job.template_reason
    msg.template_rss_bytes, msg.start_path = job.template_rss_bytes, job.start_path
    msg.start_seconds = job.start_seconds
    msg.learned_preload.extend(job.learned_preload)
    return msg


def event_to_proto(ev: dict) -> pb.Event:
    def state(value: str) -> int:
        return pb.JobState.Value(value) if value else pb.JOB_STATE_UNSPECIFIED
    return pb.Event(seq=ev["seq"], job_id=ev["job_id"], time=ev["time"], kind=ev["kind"],
                    from_state=state(ev["from_state"]), to_state=state(ev["to_state"]),
                    reason=ev["reason"], node_id=ev["node_id"], round=ev["round"],
                    rank=ev["rank"], restart=ev["restart"], layer=ev.get("layer", ""),
                    duration_seconds=ev.get("duration_seconds", 0.0),
                    rejected_reason=ev.get("rejected_reason", ""),
                    restart_rule=ev.get("restart_rule", ""),
                    restart_delay_seconds=ev.get("restart_delay_seconds", 0.0),
                    start_path=ev.get("start_path", ""))


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
                   jobs=[str(j) for j in rec.get("jobs", [])][:1000])
