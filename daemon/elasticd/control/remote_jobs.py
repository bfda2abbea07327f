"""Cluster jobs this node knows only from etcd, as a user sees them.

A cluster job has a local record (jobs/registry.py) only on the nodes that adopted
it. Any other node still answers ``status``, ``wait`` and ``events`` for it
from the job's keys in the ``JobsView`` (see rendezvous/protocol.py): the
spec (what, whose, submitted where), the round state (round, restarts,
open/closed/final and why) and the worker rows each running node publishes
(which no node watches: read when asked, ``JobsView.job(id, fresh=True,
rows=True)``, as the rounds of a job this node does not run).
Each running node also publishes a summary of its recovery (restarts per
layer, the budgets, its last failure with a traceback excerpt, its latest
ladder attempts: ``JobRecord.recovery_summary``), which ``recovery_of``
merges. ``record_from_keys`` builds that record and ``find`` resolves an id
or a live name; neither does I/O beyond reading the view. What other nodes
published was checked field by field where it entered (the view: typed rows,
jobs/summary.py ``RecoverySummary``): a bad row or summary is skipped, never
an error for the caller.
"""
from __future__ import annotations

from ..jobs.registry import JobRecord
from ..jobs.records import WorkerRow
from ..jobs.spec import JobSpec
from ..rendezvous.protocol import CLOSED, OPEN, final_job_state
from ..rendezvous.view import JobKeys
from ..jobs.states import TERMINAL_STATES, JobState


class AmbiguousName(ValueError):
    """Several live cluster jobs carry the name; the ids are in ``ids``."""

    def __init__(self, name: str, ids: list[str]):
        super().__init__(f"{len(ids)} live jobs in the cluster are named {name!r} "
                         f"({', '.join(ids)}); give the job id")
        self.ids = ids


def worker_rows(keys: JobKeys, skip: str = "") -> list[WorkerRow]:
    """Every node's published worker rows (but ``skip``'s), as the record keeps
    them (the view left out rows that do not parse: WorkerRow.published)."""
    rows = [w for node, published in sorted(keys.workers.items()) if node != skip
            for w in published]
    return sorted(rows, key=lambda w: (w.rank, w.node_id))


def recovery_of(keys: JobKeys) -> dict:
    """Every node's recovery summary as one record's fields: restarts and budgets
    per layer, the most any node counted (each node of a round sees its in-process
    restarts and its process restarts); the newest last failure; the nodes'
    attempts by time, the latest 20."""
    by_layer: dict[str, int] = {}
    budget: dict[str, int] = {}
    failure, attempts = None, []
    for _, summary in sorted(keys.summaries.items()):   # those that parsed (the view)
        for table, new in ((by_layer, summary.restarts_by_layer),
                           (budget, summary.restart_budget)):
            for k, v in new.items():
                table[k] = max(table.get(k, v), v)
        f = summary.last_failure
        if f is not None and (failure is None or f.time > failure.time):
            failure = f
        attempts.extend(summary.attempts)
    attempts.sort(key=lambda a: a.time)
    return {"restarts_by_layer": by_layer, "restart_budget": budget, "last_failure": failure,
            "attempts": attempts[-20:]}


def nodes_of(keys: JobKeys) -> list[str]:
    """The nodes that run the job: its round's members once closed (or final),
    those joined so far while open; else whoever published workers."""
    state = keys.state
    nodes: list[str] = []
    if state is not None:
        nodes = state.member_ids() if state.status != OPEN else \
            sorted(keys.joins.get(state.round, {}))
    return nodes or sorted(keys.workers)


def spares_of(keys: JobKeys) -> list[str]:
    """The nodes standing by as the job's spares: those that joined its closed round
    without being its members (rendezvous/round.py); an open round's spares as it
    was opened with them."""
    state = keys.state
    if state is None or state.final:
        return []
    if state.status == OPEN:
        return sorted(state.spares)
    return sorted(set(keys.joins.get(state.round, {})) - set(state.member_ids()))


def spare_roles(view) -> dict[str, list[str]]:
    """{node: [jobs it stands by for]} over every job in ``view`` (rendezvous/view.py):
    a closed round's from its joins, read from its rounds and joins where this node does
    not follow them or does not watch every join (it is not the round's first member)."""
    roles: dict[str, list[str]] = {}
    for job_id in view.job_ids():
        keys = view.job(job_id)
        if keys is not None and keys.state is not None and keys.state.status == CLOSED:
            keys = view.job(job_id, fresh=True)   # no I/O where every join is watched
        for node in spares_of(keys) if keys is not None else ():
            roles.setdefault(node, []).append(job_id)
    return roles


def job_state(keys: JobKeys) -> JobState:
    """The round status as a job state: closed is RUNNING; an open first round
    is PENDING until a node joins, then RENDEZVOUS; a later open round (after a
    fault or a change of nodes) is RESTARTING; final states map one to one."""
    state = keys.state
    if state.final:
        return final_job_state(state.status)
    if state.status == CLOSED:
        return JobState.RUNNING
    if state.restarts > 0 or state.round > 1:
        return JobState.RESTARTING
    return JobState.RENDEZVOUS if keys.joins.get(state.round) else JobState.PENDING


def record_from_keys(keys: JobKeys, now: float) -> JobRecord | None:
    """The job as the cluster knows it; None without a usable spec and state."""
    state = keys.state
    if not isinstance(keys.spec, JobSpec) or state is None:
        return None   # no spec yet, or a refused one (or the torchrun adapter's plain one)
    rec = keys.spec.record()
    rec.state = job_state(keys)
    nodes = ", ".join(nodes_of(keys))
    if rec.state in TERMINAL_STATES:
        where = f"ran on {nodes}" if nodes else "ran on no node"
    elif state.status == OPEN:
        where = f"joined so far: {nodes}" if nodes else "no node joined yet"
    else:
        where = f"running on {nodes}"
    rec.reason = f"this node does not run it; {where}" + (f": {state.reason}"
                                                            if state.reason else "")
    rec.round, rec.restarts = state.round, state.restarts
    rec.restart_times = list(state.restart_times)
    rec.workers = worker_rows(keys)
    for name, value in recovery_of(keys).items():
        setattr(rec, name, value)
    since = state.opened_at if state.status == OPEN else state.closed_at
    rec.state_since = since if 0 < since <= now else now
    if rec.state in TERMINAL_STATES:
        rec.finished_at = state.closed_at
        rec.exit_code = 1 if rec.state is JobState.FAILED else 0
    return rec


def find(view, key: str, may_see) -> tuple[str, JobKeys] | None:
    """The cluster job with id ``key``, else the live one named ``key``:
    (id, keys), or None. Among several live ones of that name, those
    ``may_see(uid)`` allows count first; AmbiguousName if still several."""
    keys = view.job(key)
    if keys is not None and isinstance(keys.spec, JobSpec) and keys.state is not None:
        return key, keys
    named = []
    for job_id in view.job_ids():
        keys = view.job(job_id)
        if keys is None or not isinstance(keys.spec, JobSpec) or keys.state is None \
                or keys.state.final:
            continue
        if keys.spec.name == key:
            named.append((job_id, keys))
    if len(named) > 1:
        mine = [(j, k) for j, k in named if may_see(k.spec.uid)]
        named = mine or named
    if len(named) > 1:
        raise AmbiguousName(key, sorted(j for j, _ in named))
    return named[0] if named else None

