"""Job records, their persistence, and the one writer of job state.

Records and events live in SQLite under the state dir (WAL, synchronous
writes), so a daemon killed at any moment restarts with every job and its
history. ``JobRegistry.transition`` is the only way a job changes state: it
checks the move against ``states.JOB_TRANSITIONS``, keeps time-in-state,
persists the record and appends an event, all under one lock; watchers
(WaitJob, Events -f) wake on the registry's condition.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import dataclasses
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .. import statedir
from . import names
from ..logsetup import ctx
from ..agent.ladder import Attempt
from .records import Failure, WorkerRow
from ..agent.restartpolicy import RestartPlan
from .states import LIVE_STATES, TERMINAL_STATES, JobState, check_transition

log = logging.getLogger("elasticd.jobs.registry")


class JobNotFound(KeyError):
    pass


class NameInUse(ValueError):
    pass


class JobExists(ValueError):
    pass


class NotPersisted(Exception):
    """A job could not be written to the state dir; nothing of it was kept.
    ``disk_full``: because the filesystem (or SQLite's file) is full."""

    def __init__(self, job_id: str, exc: sqlite3.Error):
        self.disk_full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
        super().__init__(f"job {job_id} could not be stored: {exc}")


def new_job_id() -> str:
    """8 characters of base32 (40 random bits): short enough to type."""
    return base64.b32encode(secrets.token_bytes(5)).decode().lower()


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
    # The restart ladder (agent/ladder.py): restarts used and allowed per layer, and
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

    @property
    def live(self) -> bool:
        return self.state in LIVE_STATES

    def recovery_summary(self) -> dict:
        """What this node shares of the job's recovery with the other nodes
        (published with its worker rows; see cluster/remote_jobs.py), size-bounded."""
        failure = self.last_failure.bounded().to_dict() if self.last_failure else None
        return {"restarts_by_layer": dict(self.restarts_by_layer),
                "restart_budget": dict(self.restart_budget), "last_failure": failure,
                "attempts": [dataclasses.replace(a, cause=a.cause[:500]).to_dict()
                             for a in self.attempts[-10:]]}

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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, seq);
-- Other nodes' events, mirrored here (import_events): once each.
CREATE UNIQUE INDEX IF NOT EXISTS events_origin ON events
    (json_extract(data, '$.node_id'), json_extract(data, '$.origin_seq'))
    WHERE json_extract(data, '$.origin_seq') IS NOT NULL;
"""


class JobRegistry:
    def __init__(self, state_dir: str, node_id: str, clock=time.time):
        statedir.private_dir(state_dir)
        path = os.path.join(state_dir, "jobs.sqlite3")
        # Every job's environment is in here: 0600 from the first byte, the
        # WAL and shared-memory files too (SQLite copies the database's mode
        # when it makes them again; made here first all the same).
        for name in (path, path + "-wal", path + "-shm"):
            statedir.touch_private(name)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self._node_id = node_id
        self._clock = clock
        self._jobs: dict[str, JobRecord] = {}
        self._spec_sizes: dict[str, int] = {}  # job id -> spec_bytes(record)
        self.last_seq = 0
        self.listeners: list = []  # callables(event dict), e.g. metrics
        for (data,) in self._db.execute("SELECT data FROM jobs"):
            try:
                rec = JobRecord.from_json(data)
            except (ValueError, TypeError, KeyError) as exc:
                log.error("skipping unreadable job record: %s", exc)
                continue
            self._jobs[rec.id] = rec
            self._spec_sizes[rec.id] = spec_bytes(rec)
        row = self._db.execute("SELECT MAX(seq) FROM events").fetchone()
        self.last_seq = row[0] or 0

    # -- reading -----------------------------------------------------------
    def get(self, key: str) -> JobRecord:
        """A copy of the job with this id, or of the live job with this name."""
        with self._lock:
            rec = self._jobs.get(key)
            if rec is None:
                named = [j for j in self._jobs.values() if j.name == key]
                live = [j for j in named if j.live]
                rec = live[0] if live else (max(named, key=lambda j: j.created_at)
                                            if named else None)
            if rec is None:
                raise JobNotFound(key)
            return copy.deepcopy(rec)

    def lookup(self, key: str, may_see) -> JobRecord:
        """A copy of the job with id ``key``, else of the one named ``key`` among the jobs
        whose uid ``may_see(uid)`` allows (jobs/names.py): JobNotFound when there is
        none, names.AmbiguousName when it stands for several."""
        with self._lock:
            rec = self._jobs.get(key) or names.stands_for(key, self._jobs.values(), may_see)
            if rec is None:
                raise JobNotFound(key)
            return copy.deepcopy(rec)

    def control_flags(self, job_id: str) -> tuple[int, int, bool]:
        """(restarts, max_restarts, cancel_requested): what a monitor tick needs,
        without copying the whole record (its environment can be large)."""
        with self._lock:
            rec = self._require(job_id)
            return rec.restarts, rec.max_restarts, rec.cancel_requested

    def list(self) -> list[JobRecord]:
        with self._lock:
            return [copy.deepcopy(j) for j in
                    sorted(self._jobs.values(), key=lambda j: j.created_at)]

    def subscribe(self, listener, seed=None) -> None:
        """Call ``listener(event)`` for every event from now on, under the registry's
        lock; first ``seed(jobs)`` with every job as it is now, under the same lock,
        so that no event falls between the two."""
        with self._lock:
            if seed is not None:
                seed(self.list())
            self.listeners.append(listener)

    def count_live(self) -> int:
        with self._lock:
            return sum(1 for j in self._jobs.values() if j.live)

    def events(self, after_seq: int = 0, job_id: str | None = None,
               limit: int = 1000) -> list[dict]:
        with self._lock:
            if job_id:
                rows = self._db.execute(
                    "SELECT seq, data FROM events WHERE job_id=? AND seq>? ORDER BY seq LIMIT ?",
                    (job_id, after_seq, limit))
            else:
                rows = self._db.execute(
                    "SELECT seq, data FROM events WHERE seq>? ORDER BY seq LIMIT ?",
                    (after_seq, limit))
            out = []
            for seq, data in rows.fetchall():
                ev = json.loads(data)
                ev["seq"] = seq
                out.append(ev)
            return out

    def recent_events(self, kind: str, node_id: str, since: float,
                      limit: int = 1000) -> list[dict]:
        """This node's events of one kind since ``since`` (newest ``limit``, oldest
        first): what a listener that outlives the daemon's restarts reads back."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, data FROM events WHERE json_extract(data, '$.kind')=? "
                "AND json_extract(data, '$.node_id')=? AND json_extract(data, '$.time')>=? "
                "ORDER BY seq DESC LIMIT ?", (kind, node_id, since, limit)).fetchall()
        out = []
        for seq, data in reversed(rows):
            ev = json.loads(data)
            ev["seq"] = seq
            out.append(ev)
        return out

    # -- writing -----------------------------------------------------------
    def create(self, rec: JobRecord) -> JobRecord:
        with self._lock:
            if rec.id in self._jobs:
                raise JobExists(f"job {rec.id} is already known here")
            if rec.name and any(j.name == rec.name and j.live and j.uid == rec.uid
                                for j in self._jobs.values()):
                raise NameInUse(rec.name)  # one namespace per user: others' names are theirs
            now = self._clock()
            rec.created_at = rec.created_at or now
            rec.state_since = now
            rec.node_id = rec.node_id or self._node_id
            # Record and first event in one transaction: a full disk leaves
            # neither behind (no job listed PENDING that was never stored).
            try:
                with self._transaction():
                    self._persist(rec)
                    ev = self._insert_event(rec, "state", f"submitted by {rec.user or rec.uid}",
                                            from_state=None, to_state=rec.state)
            except sqlite3.Error as exc:
                raise NotPersisted(rec.id, exc) from None
            self._jobs[rec.id] = rec
            self._spec_sizes[rec.id] = spec_bytes(rec)
            self._announce(ev)
            return copy.deepcopy(rec)

    def transition(self, job_id: str, new: JobState, reason: str, *,
                   plan: RestartPlan | None = None, **changes: Any) -> JobRecord:
        """Move the job to ``new``; ``plan``: the restart plan (rule, delay) the
        event carries, for the RESTARTING of a process restart."""
        with self._lock:
            rec = self._require(job_id)
            check_transition(rec.state, new)
            now = self._clock()
            old = rec.state
            rec.seconds_in_state[old.value] = (rec.seconds_in_state.get(old.value, 0.0)
                                               + max(0.0, now - rec.state_since))
            rec.state, rec.reason, rec.state_since = new, reason, now
            if new == JobState.RUNNING and not rec.started_at:
                rec.started_at = now
            if new in TERMINAL_STATES:
                rec.finished_at = now
            self._apply(rec, changes)
            self._persist(rec)
            self._append_event(rec, "state", reason, from_state=old, to_state=new, plan=plan)
            log.info("%s: %s -> %s: %s", ctx(job=rec.id, node=self._node_id, round=rec.round),
                     old.value, new.value, reason)
            return copy.deepcopy(rec)

    def discard(self, job_id: str) -> None:
        """Forget a job that never got going (its submission failed half way)."""
        with self._lock:
            self._jobs.pop(job_id, None)
            self._spec_sizes.pop(job_id, None)
            try:
                with self._transaction():
                    self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
                    self._db.execute("DELETE FROM events WHERE job_id=?", (job_id,))
            except sqlite3.Error as exc:
                log.error("%s: could not remove the record of a failed submission: %s",
                          ctx(job=job_id, node=self._node_id), exc)
            self.changed.notify_all()

    def usage(self, uid: int) -> tuple[int, int]:
        """(unfinished jobs, bytes of their specs) that ``uid`` holds here."""
        with self._lock:
            live = [j.id for j in self._jobs.values() if j.uid == uid and j.live]
            return len(live), sum(self._spec_sizes.get(j, 0) for j in live)

    def spec_bytes_total(self) -> int:
        """Bytes of the specs of every unfinished job here."""
        with self._lock:
            return sum(self._spec_sizes.get(j.id, 0) for j in self._jobs.values() if j.live)

    def update(self, job_id: str, **changes: Any) -> JobRecord:
        with self._lock:
            rec = self._require(job_id)
            self._apply(rec, changes)
            self._persist(rec)
            self.changed.notify_all()
            return copy.deepcopy(rec)

    def event(self, job_id: str, kind: str, reason: str, rank: int = -1, layer: str = "",
              duration: float = 0.0, start_path: str = "") -> None:
        with self._lock:
            rec = self._require(job_id)
            self._append_event(rec, kind, reason, rank=rank, layer=layer, duration=duration,
                               start_path=start_path)

    def record_rejection(self, rej) -> None:
        """An event for a job spec from etcd this node refused (rejections.Rejection):
        there is no record of that job here, only this event, kind ``rejected``."""
        ev = {"job_id": rej.job_id, "time": rej.time, "kind": "rejected", "from_state": "",
              "to_state": "", "reason": rej.message, "node_id": self._node_id, "round": 0,
              "rank": -1, "restart": 0, "rejected_reason": rej.reason.value}
        if rej.uid is not None:
            ev["uid"] = rej.uid  # vouched for by the signature: its user may see the event
        with self._lock:
            cur = self._db.execute("INSERT INTO events (job_id, data) VALUES (?, ?)",
                                   (rej.job_id, json.dumps(ev)))
            self.last_seq = cur.lastrowid
            self.changed.notify_all()

    def has_rejection(self, job_id: str, reason: str) -> bool:
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM events WHERE job_id=? AND json_extract(data, '$.kind')='rejected' "
                "AND json_extract(data, '$.rejected_reason')=? LIMIT 1",
                (job_id, reason)).fetchone() is not None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- internals ---------------------------------------------------------
    @contextlib.contextmanager
    def _transaction(self):
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise

    def _require(self, job_id: str) -> JobRecord:
        rec = self._jobs.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        return rec

    @staticmethod
    def _apply(rec: JobRecord, changes: dict) -> None:
        for key, value in changes.items():
            if not hasattr(rec, key):
                raise AttributeError(f"JobRecord has no field {key}")
            setattr(rec, key, value)

    def _persist(self, rec: JobRecord) -> None:
        self._db.execute("INSERT OR REPLACE INTO jobs (id, data) VALUES (?, ?)",
                         (rec.id, rec.to_json()))

    def _append_event(self, rec: JobRecord, kind: str, reason: str, *,
                      from_state: JobState | None = None, to_state: JobState | None = None,
                      rank: int = -1, layer: str = "", duration: float = 0.0,
                      plan: RestartPlan | None = None, start_path: str = "") -> None:
        self._announce(self._insert_event(rec, kind, reason, from_state=from_state,
                                          to_state=to_state, rank=rank, layer=layer,
                                          duration=duration, plan=plan, start_path=start_path))

    def _insert_event(self, rec: JobRecord, kind: str, reason: str, *,
                      from_state: JobState | None = None, to_state: JobState | None = None,
                      rank: int = -1, layer: str = "", duration: float = 0.0,
                      plan: RestartPlan | None = None, start_path: str = "") -> dict:
        ev = {"job_id": rec.id, "time": self._clock(), "kind": kind,
              "from_state": from_state.value if from_state else "",
              "to_state": to_state.value if to_state else "",
              "reason": reason, "node_id": self._node_id, "round": rec.round,
              "rank": rank, "restart": rec.restarts}
        if layer:
            ev["layer"], ev["duration_seconds"] = layer, duration
        if start_path:  # a start of ranks: the path they took and how long it took
            ev["start_path"], ev["duration_seconds"] = start_path, duration
        if plan is not None:
            ev["restart_rule"], ev["restart_delay_seconds"] = plan.rule.value, plan.delay
        cur = self._db.execute("INSERT INTO events (job_id, data) VALUES (?, ?)",
                               (rec.id, json.dumps(ev)))
        ev["seq"] = cur.lastrowid
        return ev

    def _announce(self, ev: dict) -> None:
        """A stored event: to the listeners, and wake the watchers."""
        self.last_seq = ev["seq"]
        for listener in self.listeners:
            try:
                listener(ev)
            except Exception:  # a listener must never break a transition
                log.exception("event listener failed")
        self.changed.notify_all()

    def wait_for_change(self, predicate, timeout: float) -> bool:
        """Block until ``predicate()`` holds (checked under the lock) or timeout."""
        with self._lock:
            return self.changed.wait_for(predicate, timeout=timeout)

    def import_events(self, events: list[dict]) -> int:
        """Add other nodes' events (cluster/eventlog.py) under new local seqs; how many were new.

        Each carries ``node_id`` and ``origin_seq`` (its seq on that node); a unique
        index on the pair (events_origin) makes importing again (a re-list, a daemon
        restart) a no-op.
        Listeners are not called: they count this node's own events.
        """
        with self._lock:
            added, last = 0, self.last_seq
            self._db.execute("BEGIN")
            try:
                for ev in events:
                    cur = self._db.execute("INSERT OR IGNORE INTO events (job_id, data) "
                                           "VALUES (?, ?)", (ev["job_id"], json.dumps(ev)))
                    if cur.rowcount == 1:
                        added, last = added + 1, cur.lastrowid
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            if added:
                self.last_seq = last
                self.changed.notify_all()
            return added
