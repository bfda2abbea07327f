"""A job's record as this node keeps it: the fields, its JSON form, what its spec weighs.

Built by the job manager (node/coordinator.py) at a submit or an adoption, changed
only through the registry (jobs/registry.py), which persists it as ``to_json``
and reads it back with ``from_json`` (fields an older release did not write take
their defaults; a saved sub-record that no longer parses is dropped, never the
record).
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field

from .ladder import Attempt
from .records import Failure, WorkerRow
from .states import LIVE_STATES, JobState
from .summary import RecoverySummary

log = logging.getLogger("elasticd.jobs.registry")


@dataclass
class JobRecord:
    id: str
    command: list
    cwd: str
    uid: int
    gid: int
    user: str = ""
    name: str = ""
    env: dict = field(default_factory=dict)
    state: JobState = JobState.PENDING
    reason: str = ""
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 3                 # over the job's life; -1: no lifetime limit
    restarts: int = 0
    # The budget over a window (restartpolicy.RestartWindow), counted cluster-wide:
    # at most max_restarts_per_window (-1: none) within restart_window seconds;
    # restart_times: the unix times of those in the latest window, oldest first.
    max_restarts_per_window: int = -1
    restart_window: float = 3600.0
    restart_times: list = field(default_factory=list)
    # The latest wait chosen before a process restart here (RestartPlan.to_dict()
    # plus node_id and time), or None.
    last_restart_plan: dict | None = None
    # The crash loop this node's agent is counting (restartpolicy.CrashLoop.saved()):
    # [count, exit code, signal, kind, cause], or empty; a restarted daemon goes on
    # counting from it instead of granting the job crash_loop_limit tries anew.
    crash_loop: list = field(default_factory=list)
    round: int = 0
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    exit_code: int = 0
    last_failure: Failure | None = None
    workers: list[WorkerRow] = field(default_factory=list)
    node_id: str = ""
    cancel_requested: bool = False
    inprocess: bool = False
    nodes: list = field(default_factory=list)   # the nodes it may run on (empty: any)
    state_since: float = 0.0
    seconds_in_state: dict = field(default_factory=dict)
    # The restart ladder (jobs/ladder.py): restarts used and allowed per layer, and
    # the latest recovery attempts (the cause chain), oldest first.
    restarts_by_layer: dict = field(default_factory=dict)
    restart_budget: dict = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    # Hang detection on this node (hangs/detector.py): the limits per phase, learned from
    # the job's gaps between beats (hang_timeouts.PhaseLimit dicts), which also seed
    # the learning after a daemon restart; the slowest rank (stragglers.Straggler dict).
    hang_timeouts: list = field(default_factory=list)
    straggler: dict | None = None
    # GPUs (gpus/alloc.py): per node asked (-1: one per local rank where the node has
    # GPUs), CPU binding (none | numa), and the indices it holds on this node (kept
    # so a restarted daemon gives it the same devices).
    gpus_per_node: int = -1
    cpu_bind: str = "none"
    spares: int = 0                     # spare nodes it keeps beside max_nodes (JobSpec)
    gpu_indices: list = field(default_factory=list)
    # The worker template on this node (workers/template.py): its state, why not
    # ready when it is not, its resident memory; and how the latest start of this
    # node's ranks went: template | spare | cold (the slowest path any rank took),
    # and how long starting them took, in seconds.
    template_state: str = ""
    template_reason: str = ""
    template_rss_bytes: int = 0
    start_path: str = ""
    start_seconds: float = 0.0
    # Modules the job's ranks imported by their first step (workers/preload.py), which its
    # next worker template imports ahead (after agent.warm_preload).
    learned_preload: list = field(default_factory=list)
    # When retention (jobs/retirer.py) removed its logs to keep the node under
    # retention.log_bytes (0: never); the record and events stay.
    logs_retired_at: float = 0.0

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def recovery_summary(self) -> RecoverySummary:
        """What this node shares of the job's recovery with the other nodes
        (published with its worker rows; see control/remote_jobs.py), size-bounded."""
        return RecoverySummary.of_record(self.restarts_by_layer, self.restart_budget,
                                         self.last_failure, self.attempts)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["state"] = self.state.value
        data["last_failure"] = self.last_failure.to_dict() if self.last_failure else None
        data["workers"] = [w.to_dict() for w in self.workers]
        data["attempts"] = [a.to_dict() for a in self.attempts]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        data = json.loads(text)
        data["state"] = JobState(data["state"])
        data["last_failure"] = (Failure.from_dict(data["last_failure"])
                                if data.get("last_failure") else None)
        data["workers"] = _parsed(WorkerRow, data.get("workers") or (), "worker row")
        data["attempts"] = _parsed(Attempt, data.get("attempts") or (), "recovery attempt")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def _parsed(record, saved, what: str) -> list:
    """The saved ``record``s that still parse (one never stops a job record loading)."""
    got = []
    for d in saved:
        try:
            got.append(record.from_dict(d))
        except (KeyError, TypeError, ValueError, OverflowError):
            log.warning("dropping an unreadable %s: %.200r", what, d)
    return got


def spec_bytes(rec: JobRecord) -> int:
    """What a job's spec weighs: its command, environment and cwd, in bytes
    (what limits.spec_bytes_per_user counts)."""
    return (sum(len(a.encode()) for a in rec.command) + len(rec.cwd.encode())
            + sum(len(k.encode()) + len(v.encode()) for k, v in rec.env.items()))
