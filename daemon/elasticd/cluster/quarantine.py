"""This node's memory of its faults in etcd, and its quarantine.

``FaultMemory`` listens to this node's job events (a failed GPU health
check, a worker killed by a signal that points at the machine: the faults
the node owns, faults.node_owned; a job's own failures never count) and to
its lease keeper (a lease that expired under it), and keeps them in the node's sealed fault
record (faults.py: ``/v1/faults/<node>``, under no lease, so a restart of the
daemon or a lost lease forgets nothing). It alone writes that record, from
its one loop: the registry listener only queues (it runs under the
registry's lock).

When a new fault takes the node over ``cluster.quarantine_faults`` within
``cluster.quarantine_window`` (faults.judge), the node quarantines itself: a
drain mark that names the reasons (cluster/node.py: the dispatcher adopts no
job on a draining node, `elasticctl nodes` shows it quarantined with them),
and the record says so, so the quarantine outlives the daemon. An operator's
`elasticctl uncordon NODE` deletes the mark; this loop sees the mark gone
(now, or at its next start if the node was down) and records the release:
faults before it count no more. With ``cluster.quarantine_health_release``, a
node with GPUs that pass the health check (gpus/health.py ``probe``) lifts
its own mark the same way. Each decision is logged once and written as
a ``quarantine`` event of the jobs whose faults counted.
"""
from __future__ import annotations

import logging
import threading
import time

from ..jobs.jobevent import JobEvent
from ..logsetup import ctx
from ..store import StoreError
from ..trust.sealed import MAX_BODY, Kind, Reason, Refused
from .faults import (EVENT_FAULTS, Fault, FaultBook, FaultKind, Verdict, fault_key, judge,
                     node_owned, reasons)

log = logging.getLogger("elasticd.cluster.quarantine")

MAX_PENDING = 1000      # faults queued between two ticks; more are dropped (counted in a log)


class FaultMemory:
    def __init__(self, cfg, store, records, cluster, registry, refusals, health=None,
                 interval: float = 0.5, clock=time.time):
        self._cfg = cfg
        self._me = cfg.daemon.node_id
        self._store = store
        self._records = records
        self._refusals = refusals     # trust/refusals.py: a record refused, counted, logged
        self._health = health         # gpus/health.HealthGate, or None: its probe() frees
        self._probed = 0.0            # when it last ran
        self._cluster = cluster
        self._registry = registry
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: list[Fault] = []
        self._dropped = 0
        self._book: FaultBook | None = None      # None until read from etcd
        self._seen: set = set()                   # (kind, job, attempt) already counted
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what feeds it (no I/O) ------------------------------------------------
    def on_event(self, ev: JobEvent) -> None:
        """A registry listener: this node's faulty job events, queued."""
        kind = EVENT_FAULTS.get(ev.kind)
        if kind is None or ev.node_id != self._me or not node_owned(kind, ev.signal):
            return   # not this node's fault: its job's (faults.node_owned)
        self._queue(Fault(float(ev.time), kind, ev.job_id, ev.reason[:200], ev.restart))

    def lease_lost(self) -> None:
        """The lease keeper found this node's lease expired under it."""
        self._queue(Fault(self._clock(), FaultKind.LEASE_LOST, "",
                          "the node's lease expired (etcd unreachable from it too long)"))

    def _queue(self, fault: Fault) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._dropped += 1
                return
            self._pending.append(fault)
        self._wake.set()

    # -- what it tells -----------------------------------------------------------
    def verdict(self) -> Verdict:
        """The faults that count now (and whether they would quarantine the node)."""
        with self._lock:
            book = self._book or FaultBook()
        c = self._cfg.cluster
        return judge(book.faults, self._clock(), c.quarantine_window, c.quarantine_faults,
                     book.released_at)

    def causes(self) -> dict:
        """Faults that count now by cause (every cause, 0 where none)."""
        counted = self.verdict().causes()
        return {k.value: counted.get(k.value, 0) for k in FaultKind}

    def quarantined(self) -> tuple:
        """This node's quarantine reasons; () when it is not quarantined."""
        with self._lock:
            book = self._book
        return book.reasons if book is not None and book.quarantined else ()

    # -- the loop ----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fault-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._store.timeout + self._interval + 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except StoreError as exc:
                log.debug("%s: fault record: etcd unavailable: %s", ctx(node=self._me), exc)
            except Exception:
                log.exception("%s: fault memory failed", ctx(node=self._me))
            self._wake.wait(self._interval)
            self._wake.clear()

    def tick(self) -> None:
        """Read the record once, take in queued faults, decide, write what changed."""
        if self._book is None:
            book = self._read()
            with self._lock:
                self._book = book
                self._seen = {f.key() for f in book.faults}
        with self._lock:
            pending, self._pending = self._pending, []
            dropped, self._dropped = self._dropped, 0
            book = self._book
        if dropped:
            log.warning("%s: %d faults came faster than they could be recorded: not counted",
                        ctx(node=self._me), dropped)
        try:
            self._decide(book, pending)
        except BaseException:
            with self._lock:    # nothing was recorded: the next tick tries them again
                self._pending[:0] = pending
                self._seen -= {f.key() for f in pending}
            raise

    def _decide(self, book: FaultBook, pending: list) -> None:
        c, now = self._cfg.cluster, self._clock()
        changed = False
        told = []       # what to log and tell the jobs once the record holds it
        for fault in pending:
            if fault.key() in self._seen:   # one fault per kind per job attempt
                continue
            self._seen.add(fault.key())
            book = book.add(fault, now, c.quarantine_window)
            changed = True
        marks = self._cluster.drain_states().get(self._me)
        if book.quarantined and not (marks and marks.get("reasons")) and self._mark_read():
            book = FaultBook(book.faults, False, now, ())
            changed = True
            told.append((self._released, "uncordoned"))
        elif book.quarantined and self._healthy(now):
            self._cluster.set_drain(self._me, False, "elasticd: GPU health check passed")
            book = FaultBook(book.faults, False, now, ())
            changed = True
            told.append((self._released, "its GPU health check passed"))
        if pending and not book.quarantined:
            verdict = judge(book.faults, now, c.quarantine_window, c.quarantine_faults,
                            book.released_at)
            if verdict.quarantine:
                said = reasons(verdict)
                self._cluster.set_drain(self._me, True, "elasticd: quarantined", said)
                book = FaultBook(book.faults, True, book.released_at, said)
                changed = True
                told.append((self._quarantined, verdict))
        if changed:
            self._write(book)
            with self._lock:
                self._book = book
                if len(self._seen) > 4 * MAX_PENDING:
                    self._seen = {f.key() for f in book.faults}
        for tell, what in told:
            tell(what)

    def _healthy(self, now: float) -> bool:
        """Whether this node's GPUs passed a check now (cluster.quarantine_health_release,
        one check every cluster.quarantine_recheck seconds)."""
        c = self._cfg.cluster
        if not c.quarantine_health_release or self._health is None or not self._health.active \
                or now - self._probed < c.quarantine_recheck:
            return False
        self._probed = now
        return self._health.probe().ok

    def _mark_read(self) -> bool:
        """Whether the drain watch has read etcd's marks at least once (before that, no
        mark does not mean an operator released the node)."""
        return self._cluster.drains_loaded()

    def _read(self) -> FaultBook:
        key = fault_key(self._me)
        kv = self._store.get(key)
        if kv is None:
            return FaultBook()
        try:
            doc = self._records.open(Kind.FAULTS, key, kv.value).doc
            try:
                return FaultBook.from_doc(doc)
            except ValueError as exc:
                raise Refused(Reason.INVALID, str(exc)) from None
        except Refused as exc:   # counted and logged; a new record replaces it
            self._refusals.refused(Kind.FAULTS, key, exc.reason, exc.detail)
            return FaultBook()

    def _write(self, book: FaultBook) -> None:
        key = fault_key(self._me)
        self._store.put(key, self._records.seal(Kind.FAULTS, key,
                                                book.to_json(MAX_BODY[Kind.FAULTS])))

    def _quarantined(self, verdict: Verdict) -> None:
        log.error("%s: quarantined: %s; it takes no new rounds until `elasticctl uncordon "
                  "%s`", ctx(node=self._me), verdict.reason, self._me)
        self._tell_jobs(verdict.faults, f"node {self._me} quarantined: {verdict.reason}")

    def _released(self, why: str) -> None:
        log.warning("%s: quarantine lifted (%s); only faults from now on count",
                    ctx(node=self._me), why)
        with self._lock:
            faults = self._book.faults if self._book is not None else ()
        self._tell_jobs(faults, f"node {self._me} released from quarantine ({why})")

    def _tell_jobs(self, faults, reason: str) -> None:
        """A ``quarantine`` event of each job (known here) whose faults counted."""
        jobs = []
        for f in reversed(faults):
            if f.job_id and f.job_id not in jobs:
                jobs.append(f.job_id)
        for job_id in jobs[:5]:
            try:
                self._registry.event(job_id, "quarantine", reason)
            except Exception:   # the job is gone from this node: the log line stays
                continue
