"""Which finished jobs a node retires, and how much of each: a pure decision.

A node keeps what its finished jobs left (records, events, logs, run dirs) within
the ``[retention]`` settings. ``decide`` takes the finished jobs as plain data
(``Finished``: when each ended, the bytes its logs and its spec take) and the
budget, and returns a ``Plan``: which jobs go whole (record, events here and in
etcd, logs, run dir) and which lose only their logs. Rules, oldest finished first
(ties by id), each applied to what the rules before it kept:

1. age: a job finished more than ``max_age`` seconds ago goes whole;
2. count: beyond the newest ``max_jobs``, the older ones go whole;
3. spec bytes: while the kept records' specs take more than ``record_bytes``, the
   oldest kept goes whole;
4. log bytes: while the kept finished jobs' logs take more than ``log_bytes``,
   the oldest kept finished job with logs loses them; its record and events stay,
   so ``status`` still says it ran and ``logs`` says they were retired (running
   jobs' logs are not counted: ``agent.log_max_bytes`` bounds each rank's, and a
   budget they filled would leave no finished job its logs, not even the newest);
5. a full disk: while the bytes freed fall short of ``shortfall``, the oldest kept
   finished job with logs loses them (as in 4).

A job's logs are never retired while it runs: the caller passes only jobs whose
agents have exited. No I/O here (``logs_retired_message`` reads the clock's zone);
jobs/retirer.py measures and applies.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Sequence


class Scope(str, enum.Enum):
    """How much of a finished job goes."""
    WHOLE = "whole"   # record, events (here and in etcd), logs, run dir
    LOGS = "logs"     # its logs; record and events stay


class Why(str, enum.Enum):
    """Which rule retired it, named as the setting that set the bound."""
    AGE = "retention.max_age"
    COUNT = "retention.max_jobs"
    RECORD_BYTES = "retention.record_bytes"
    LOG_BYTES = "retention.log_bytes"
    DISK_FULL = "limits.state_min_free_bytes"


@dataclass(frozen=True)
class Finished:
    """A finished job as the decision sees it."""
    job_id: str
    finished_at: float        # unix time it ended
    log_bytes: int = 0        # what its logs take on disk now (0: none, or retired)
    record_bytes: int = 0     # what its record's spec takes


@dataclass(frozen=True)
class Budget:
    """The ``[retention]`` settings (config.RetentionSettings) as the decision takes them."""
    max_age: float
    max_jobs: int
    log_bytes: int
    record_bytes: int

    @classmethod
    def from_settings(cls, r) -> "Budget":
        return cls(r.max_age, r.max_jobs, r.log_bytes, r.record_bytes)


@dataclass(frozen=True)
class Retire:
    job_id: str
    scope: Scope
    why: Why
    log_bytes: int            # bytes of logs this frees


@dataclass(frozen=True)
class Plan:
    retire: tuple[Retire, ...] = ()

    def whole(self) -> list[Retire]:
        return [r for r in self.retire if r.scope is Scope.WHOLE]

    def logs_only(self) -> list[Retire]:
        return [r for r in self.retire if r.scope is Scope.LOGS]

    @property
    def freed_log_bytes(self) -> int:
        return sum(r.log_bytes for r in self.retire)

    def sentence(self) -> str:
        """What the plan does, in one line (empty: nothing)."""
        if not self.retire:
            return ""
        parts = []
        for scope, what in ((Scope.WHOLE, "retire {n} finished job(s) whole"),
                            (Scope.LOGS, "retire the logs of {n} finished job(s)")):
            picked = [r for r in self.retire if r.scope is scope]
            if picked:
                whys = sorted({r.why.value for r in picked})
                parts.append(what.format(n=len(picked)) + f" ({', '.join(whys)})")
        return "; ".join(parts) + f", freeing {self.freed_log_bytes} bytes of logs"


def decide(finished: Sequence[Finished], now: float, budget: Budget, *,
           shortfall: int = 0) -> Plan:
    """The plan for ``finished`` (see the module doc); ``now``: the time it is,
    ``shortfall``: bytes the state dir's disk lacks (0 when it has room)."""
    order = sorted(finished, key=lambda f: (f.finished_at, f.job_id))
    out: list[Retire] = []
    kept: list[Finished] = []
    for f in order:  # 1. age
        if now - f.finished_at > budget.max_age:
            out.append(Retire(f.job_id, Scope.WHOLE, Why.AGE, f.log_bytes))
        else:
            kept.append(f)
    over = len(kept) - budget.max_jobs  # 2. count
    for f in kept[:max(0, over)]:
        out.append(Retire(f.job_id, Scope.WHOLE, Why.COUNT, f.log_bytes))
    kept = kept[max(0, over):]
    spec = sum(f.record_bytes for f in kept)  # 3. spec bytes
    while kept and spec > budget.record_bytes:
        f = kept.pop(0)
        spec -= f.record_bytes
        out.append(Retire(f.job_id, Scope.WHOLE, Why.RECORD_BYTES, f.log_bytes))
    logs = sum(f.log_bytes for f in kept)  # 4. log bytes, 5. full disk
    freed = sum(r.log_bytes for r in out)
    for f in kept:
        if f.log_bytes <= 0:
            continue
        if logs > budget.log_bytes:
            why = Why.LOG_BYTES
        elif freed < shortfall:
            why = Why.DISK_FULL
        else:
            break
        out.append(Retire(f.job_id, Scope.LOGS, why, f.log_bytes))
        logs -= f.log_bytes
        freed += f.log_bytes
    return Plan(tuple(out))


def logs_retired_message(job_id: str, when: float) -> str:
    """What ``elasticctl logs`` says of a job whose logs retention took."""
    at = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(when))
    return (f"the logs of job {job_id} were retired at {at} to keep this node within its "
            f"log budget (retention.log_bytes, or a full state dir); the job's record stays: "
            f"`elasticctl status {job_id}` and `elasticctl events {job_id}` show how it ran")
