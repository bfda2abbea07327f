"""The job database (SQLite under the state dir): opened private, its schema, and the
event rows (jobs/jobevent.py) stored, read back and mirrored from other nodes (the
registry, jobs/registry.py, holds the lock and calls these)."""
from __future__ import annotations

import contextlib
import json
import os
import sqlite3

from .. import statedir
from .jobevent import JobEvent

SCHEMA = """
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


def open_db(state_dir: str) -> sqlite3.Connection:
    """The state dir's jobs.sqlite3, private, WAL with synchronous writes, schema made."""
    statedir.private_dir(state_dir)
    path = os.path.join(state_dir, "jobs.sqlite3")
    # Every job's environment is in here: 0600 from the first byte, the
    # WAL and shared-memory files too (SQLite copies the database's mode
    # when it makes them again; made here first all the same).
    for name in (path, path + "-wal", path + "-shm"):
        statedir.touch_private(name)
    db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.executescript(SCHEMA)
    return db


@contextlib.contextmanager
def transaction(db: sqlite3.Connection):
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def read_events(db: sqlite3.Connection, after_seq: int, job_id: str | None,
                limit: int) -> list[JobEvent]:
    """Events after ``after_seq`` (of one job, with ``job_id``), oldest first."""
    if job_id:
        rows = db.execute(
            "SELECT seq, data FROM events WHERE job_id=? AND seq>? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit))
    else:
        rows = db.execute(
            "SELECT seq, data FROM events WHERE seq>? ORDER BY seq LIMIT ?",
            (after_seq, limit))
    return [_event(seq, data) for seq, data in rows.fetchall()]


def recent_events(db: sqlite3.Connection, kind: str, node_id: str, since: float,
                  limit: int) -> list[JobEvent]:
    """One node's events of one kind since ``since`` (newest ``limit``, oldest first)."""
    rows = db.execute(
        "SELECT seq, data FROM events WHERE json_extract(data, '$.kind')=? "
        "AND json_extract(data, '$.node_id')=? AND json_extract(data, '$.time')>=? "
        "ORDER BY seq DESC LIMIT ?", (kind, node_id, since, limit)).fetchall()
    return [_event(seq, data) for seq, data in reversed(rows)]


def _event(seq: int, data: str) -> JobEvent:
    return JobEvent.from_dict({**json.loads(data), "seq": seq})


def insert_event(db: sqlite3.Connection, ev: JobEvent) -> int:
    """Store one event (not stored yet: no seq); its seq."""
    cur = db.execute("INSERT INTO events (job_id, data) VALUES (?, ?)",
                     (ev.job_id, json.dumps(ev.to_dict())))
    return cur.lastrowid


def has_rejection(db: sqlite3.Connection, job_id: str, reason: str) -> bool:
    return db.execute(
        "SELECT 1 FROM events WHERE job_id=? AND json_extract(data, '$.kind')='rejected' "
        "AND json_extract(data, '$.rejected_reason')=? LIMIT 1",
        (job_id, reason)).fetchone() is not None


def import_events(db: sqlite3.Connection, events: list[JobEvent]) -> tuple[int, int]:
    """Add other nodes' events under new local seqs: (how many were new, the last new
    seq, 0 when none). A unique index on (node_id, origin_seq) makes importing again
    a no-op."""
    added, last = 0, 0
    db.execute("BEGIN")
    try:
        for ev in events:
            cur = db.execute("INSERT OR IGNORE INTO events (job_id, data) "
                             "VALUES (?, ?)", (ev.job_id, json.dumps(ev.to_dict())))
            if cur.rowcount == 1:
                added, last = added + 1, cur.lastrowid
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return added, last
