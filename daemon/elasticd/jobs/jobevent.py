"""One job event as it crosses modules: the typed, frozen ``JobEvent``.

A job's moves and what happened to it on the way (a worker's exit, a hang, a
restart on a layer of the ladder, a start of ranks, a spec refused) are
events, kept in the registry's log (jobs/registry.py, stored by jobs/jobdb.py)
and handed to its listeners (metrics, retention, suspicion, the event log's
writer), read by `elasticctl events` (control/messages.py) and shared with
the other nodes (cluster/eventlog.py, which checks theirs before they become
one). This node's events are built here (``local_event``, ``rejection_event``);
``to_dict`` is the one form they are stored and shared in, ``from_dict`` the
one way back (of a dict already checked where it entered).
"""
from __future__ import annotations

from dataclasses import dataclass

from .jobrecord import JobRecord
from .restartpolicy import RestartPlan
from .states import JobState


@dataclass(frozen=True)
class JobEvent:
    job_id: str
    time: float
    kind: str                    # "state", "worker_exit", "restart", "start", "rejected", ...
    from_state: str = ""         # a move's states (JobState values); "" for other kinds
    to_state: str = ""
    reason: str = ""
    node_id: str = ""            # the node the event happened on
    round: int = 0
    rank: int = -1
    restart: int = 0             # the job's restart count then
    seq: int = 0                 # its seq in this node's log (0: not stored yet)
    layer: str = ""              # a restart on a layer of the ladder, and how long it took
    start_path: str = ""         # a start of ranks: the path they took, and how long
    duration_seconds: float = 0.0
    restart_rule: str = ""       # a process restart's plan (restartpolicy.RestartRule value)
    restart_delay_seconds: float = 0.0
    rejected_reason: str = ""    # a refused spec: why (rejections.RejectReason value)
    uid: int | None = None       # a refused spec's user, where its signature vouched for it
    origin_seq: int | None = None  # another node's event: its seq in that node's log
    signal: int = 0              # a worker_exit's: the signal that ended the worker (0: none)

    def to_dict(self) -> dict:
        """The event as stored and shared: the optional fields only where they apply;
        ``seq`` once stored."""
        d = {"job_id": self.job_id, "time": self.time, "kind": self.kind,
             "from_state": self.from_state, "to_state": self.to_state,
             "reason": self.reason, "node_id": self.node_id, "round": self.round,
             "rank": self.rank, "restart": self.restart}
        if self.layer:
            d["layer"], d["duration_seconds"] = self.layer, self.duration_seconds
        if self.start_path:
            d["start_path"], d["duration_seconds"] = self.start_path, self.duration_seconds
        if self.restart_rule:
            d["restart_rule"] = self.restart_rule
            d["restart_delay_seconds"] = self.restart_delay_seconds
        if self.rejected_reason:
            d["rejected_reason"] = self.rejected_reason
        if self.uid is not None:
            d["uid"] = self.uid
        if self.origin_seq is not None:
            d["origin_seq"] = self.origin_seq
        if self.signal:
            d["signal"] = self.signal
        if self.seq:
            d["seq"] = self.seq
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "JobEvent":
        """An event from ``to_dict``'s form: read back from the log, or another node's
        once cluster/eventlog.py checked it."""
        return cls(job_id=d["job_id"], time=d["time"], kind=d["kind"],
                   from_state=d.get("from_state", ""), to_state=d.get("to_state", ""),
                   reason=d.get("reason", ""), node_id=d.get("node_id", ""),
                   round=d.get("round", 0), rank=d.get("rank", -1),
                   restart=d.get("restart", 0), seq=d.get("seq", 0),
                   layer=d.get("layer", ""), start_path=d.get("start_path", ""),
                   duration_seconds=d.get("duration_seconds", 0.0),
                   restart_rule=d.get("restart_rule", ""),
                   restart_delay_seconds=d.get("restart_delay_seconds", 0.0),
                   rejected_reason=d.get("rejected_reason", ""), uid=d.get("uid"),
                   origin_seq=d.get("origin_seq"), signal=d.get("signal", 0))


def local_event(rec: JobRecord, kind: str, reason: str, node_id: str, now: float, *,
                from_state: JobState | None = None, to_state: JobState | None = None,
                rank: int = -1, layer: str = "", duration: float = 0.0,
                plan: RestartPlan | None = None, start_path: str = "",
                signal: int = 0) -> JobEvent:
    """An event of job ``rec`` on this node; ``plan``: the restart plan a process
    restart's RESTARTING carries; ``signal``: a worker_exit's."""
    return JobEvent(
        job_id=rec.id, time=now, kind=kind,
        from_state=from_state.value if from_state else "",
        to_state=to_state.value if to_state else "", reason=reason, node_id=node_id,
        round=rec.round, rank=rank, restart=rec.restarts, layer=layer,
        start_path=start_path, duration_seconds=duration if layer or start_path else 0.0,
        restart_rule=plan.rule.value if plan is not None else "",
        restart_delay_seconds=plan.delay if plan is not None else 0.0, signal=signal)


def rejection_event(rej, node_id: str) -> JobEvent:
    """The event for a job spec from etcd this node refused (rejections.Rejection)."""
    return JobEvent(job_id=rej.job_id, time=rej.time, kind="rejected", reason=rej.message,
                    node_id=node_id, round=0, rank=-1, restart=0,
                    rejected_reason=rej.reason.value, uid=rej.uid)
