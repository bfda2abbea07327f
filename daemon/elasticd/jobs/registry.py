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
import copy
import dataclasses
import logging
import secrets
import sqlite3
import threading
import time
from typing import Any

from . import jobdb, names
from ..logsetup import ctx
from .restartpolicy import RestartPlan
from .jobevent import JobEvent, local_event, rejection_event
from .jobrecord import JobRecord, spec_bytes
from .retention import Finished
from .states import TERMINAL_STATES, JobState, check_transition

__all__ = ["JobExists", "JobNotFound", "JobRecord", "JobRegistry", "NameInUse", "NotPersisted",
           "new_job_id", "spec_bytes"]  # JobRecord and spec_bytes: jobs/jobrecord.py

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


class JobRegistry:
    def __init__(self, state_dir: str, node_id: str, clock=time.time):
        self._db = jobdb.open_db(state_dir)  # jobs.sqlite3, private
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self._node_id = node_id
        self._clock = clock
        self._jobs: dict[str, JobRecord] = {}
        self._spec_sizes: dict[str, int] = {}  # job id -> spec_bytes(record)
        self.last_seq = 0
        self.listeners: list = []  # callables(JobEvent), e.g. metrics
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

    def list(self, where=None) -> list[JobRecord]:
        """Copies of the jobs, oldest first; with ``where(job)``, of those it keeps only
        (chosen before anything is copied: a user's `list` copies their jobs alone)."""
        with self._lock:
            return [copy.deepcopy(j) for j in
                    sorted(self._jobs.values(), key=lambda j: j.created_at)
                    if where is None or where(j)]

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
               limit: int = 1000) -> list[JobEvent]:
        with self._lock:
            return jobdb.read_events(self._db, after_seq, job_id, limit)

    def recent_events(self, kind: str, node_id: str, since: float,
                      limit: int = 1000) -> list[JobEvent]:
        """This node's events of one kind since ``since`` (newest ``limit``, oldest
        first): what a listener that outlives the daemon's restarts reads back."""
        with self._lock:
            return jobdb.recent_events(self._db, kind, node_id, since, limit)

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
                    by = rec.user or rec.uid
                    ev = self._insert_event(rec, "state", f"submitted by {by}",
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
              duration: float = 0.0, start_path: str = "", signal: int = 0) -> None:
        with self._lock:
            rec = self._require(job_id)
            self._append_event(rec, kind, reason, rank=rank, layer=layer, duration=duration,
                               start_path=start_path, signal=signal)

    def record_rejection(self, rej) -> None:
        """An event for a job spec from etcd this node refused (rejections.Rejection):
        there is no record of that job here, only this event, kind ``rejected``."""
        ev = rejection_event(rej, self._node_id)
        with self._lock:
            self.last_seq = jobdb.insert_event(self._db, ev)
            self.changed.notify_all()

    def has_rejection(self, job_id: str, reason: str) -> bool:
        with self._lock:
            return jobdb.has_rejection(self._db, job_id, reason)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- retention (jobs/retirer.py decides and calls) -------------------------
    def live_ids(self) -> set[str]:
        with self._lock:
            return {j.id for j in self._jobs.values() if j.live}

    def finished(self) -> list[Finished]:
        """Every finished job here, as retention weighs it (logs not measured: 0)."""
        with self._lock:
            return [Finished(j.id, j.finished_at or j.state_since,
                             record_bytes=self._spec_sizes.get(j.id, 0))
                    for j in self._jobs.values() if j.state in TERMINAL_STATES]

    def event_only_jobs(self) -> list[Finished]:
        """The jobs that have events here but no record (other nodes' jobs mirrored
        here, refused specs), each as of its newest event."""
        with self._lock:
            rows = self._db.execute("SELECT job_id, MAX(seq) FROM events GROUP BY job_id")
            newest = [(j, seq) for j, seq in rows.fetchall() if j not in self._jobs]
            out = []
            for job_id, seq in newest:
                row = self._db.execute("SELECT json_extract(data, '$.time') FROM events "
                                       "WHERE seq=?", (seq,)).fetchone()
                when = row[0] if row and isinstance(row[0], (int, float)) else 0.0
                out.append(Finished(job_id, float(when)))
            return out

    def retire(self, job_ids: list[str]) -> int:
        """Forget finished jobs: their records and events, in one transaction (a
        live job is left alone); how many records went. Raises sqlite3.Error."""
        with self._lock:
            gone = [j for j in job_ids if j in self._jobs and not self._jobs[j].live]
            events = [j for j in job_ids if j not in self._jobs]
            with self._transaction():
                for job_id in gone + events:
                    self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,))
                    self._db.execute("DELETE FROM events WHERE job_id=?", (job_id,))
            for job_id in gone:
                self._jobs.pop(job_id, None)
                self._spec_sizes.pop(job_id, None)
            self.changed.notify_all()
        self.compact()
        return len(gone)

    def compact(self) -> None:
        """Fold the write-ahead log into the database and empty it: without this it
        keeps the size it grew to (up to ~4 MiB between SQLite's own checkpoints)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    # -- internals ---------------------------------------------------------
    def _transaction(self):
        return jobdb.transaction(self._db)

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
                      plan: RestartPlan | None = None, start_path: str = "",
                      signal: int = 0) -> None:
        self._announce(self._insert_event(rec, kind, reason, from_state=from_state,
                                          to_state=to_state, rank=rank, layer=layer,
                                          duration=duration, plan=plan, start_path=start_path,
                                          signal=signal))

    def _insert_event(self, rec: JobRecord, kind: str, reason: str, *,
                      from_state: JobState | None = None, to_state: JobState | None = None,
                      rank: int = -1, layer: str = "", duration: float = 0.0,
                      plan: RestartPlan | None = None, start_path: str = "",
                      signal: int = 0) -> JobEvent:
        ev = local_event(rec, kind, reason, self._node_id, self._clock(),
                         from_state=from_state, to_state=to_state, rank=rank, layer=layer,
                         duration=duration, plan=plan, start_path=start_path, signal=signal)
        return dataclasses.replace(ev, seq=jobdb.insert_event(self._db, ev))

    def _announce(self, ev: JobEvent) -> None:
        """A stored event: to the listeners, and wake the watchers."""
        self.last_seq = ev.seq
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

    def import_events(self, events: list[JobEvent]) -> int:
        """Add other nodes' events (cluster/eventlog.py) under new local seqs; how many
        were new.

        Each carries ``node_id`` and ``origin_seq`` (its seq on that node); a unique
        index on the pair (events_origin) makes importing again (a re-list, a daemon
        restart) a no-op.
        Listeners are not called: they count this node's own events.
        """
        with self._lock:
            added, last = jobdb.import_events(self._db, events)
            if added:
                self.last_seq = last
                self.changed.notify_all()
            return added
