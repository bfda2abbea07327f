"""One watch over every job's keys, kept as an in-memory view.

The daemon runs one ``JobsView`` (one watch stream, however many jobs);
rendezvous participants and the job dispatcher read it and wait on its
condition instead of polling etcd. The jobs' phase records are not among
these keys: they live under their own prefix, which only a job's own nodes
watch (rendezvous/phase_watch.py); ``/v1/jobs/<job>/phases/<node>``, where
an older elasticd wrote them, is not read as anything here.

Every value enters through ``records`` (trust/sealed.py: the daemon's
verifies the cluster key's MAC bound to the key name; the torchrun
adapter's is plain) and becomes a typed record (rendezvous/records.py,
jobs/records.py) or is refused: not sealed, moved from another key,
malformed, out of range, or older than what the view holds for that key
(a round state whose round and status lie before the view's, a node's
record whose writer's count is not above the last one's). A refused value
is counted and logged once (trust/refusals.py) and changes nothing: the
key keeps its last verified value in the view (a round state's revision
does move on, so the next compare-and-swap replaces the bad value). A
deleted key is gone from the view. Whatever goes wrong with one key is a
refusal of that key, never an exception out of the watch.

A spec goes through ``open_spec(job_id, text)``. The daemon's verifies,
decrypts and checks it (trust/specs.SpecCodec.open); a spec it refuses is
kept as ``JobKeys.rejection`` (``spec`` stays None) unless a verified spec
is held, so nothing reads it as a job and the dispatcher can report it.
The torchrun adapter's specs are plain JSON (``plain_spec``).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ..jobs.records import WorkerRow
from ..jobs.summary import RecoverySummary
from ..fields import is_ident
from ..trust.refusals import Refusals
from ..trust.rejections import Rejection, SpecRejected
from ..trust.sealed import Kind, Reason, Refused
from ..values import BadValue, decode
from ..store import EVENT_PUT, Store
from ..store.follow import Follower
from .opening import newer, refusing, typed
from .records import Join, RoundState

log = logging.getLogger("elasticd.rendezvous")

JOBS = "/v1/jobs"
SPEC_MAX_BYTES = 1 << 20      # a plain spec (the torchrun adapter's)
MARKS_KEPT = 10_000           # jobs whose high-water marks outlive their keys
_KINDS = {("spec", 2): Kind.SPEC, ("state", 2): Kind.STATE, ("join", 4): Kind.JOIN,
          ("done", 4): Kind.DONE, ("workers", 3): Kind.WORKERS}
# /v1/jobs/<job>/phases/<node>: where an older elasticd wrote its phase records. Not
# read as anything (they live under their own prefix now: rendezvous/phase_watch.py,
# watched only by the job's nodes); its lease ends each one.
def _old_phases(parts: list) -> bool:
    return len(parts) == 3 and parts[1] == "phases"


def _parts(prefix: str, key: str) -> list:
    """The key's names below ``prefix``: [job, kind, ...]; [] if not below it."""
    return key[len(prefix) + 1:].split("/") if key.startswith(prefix + "/") else []


@dataclass
class JobKeys:
    spec: object = None   # a JobSpec (SpecCodec.open); the torchrun adapter's: a dict
    state: RoundState | None = None
    state_revision: int = 0
    joins: dict = field(default_factory=dict)     # round -> {node: Join}
    done: dict = field(default_factory=dict)      # round -> set(node)
    workers: dict = field(default_factory=dict)   # node -> its WorkerRows (those that parse)
    summaries: dict = field(default_factory=dict)  # node -> its RecoverySummary, if it parsed
    rejection: Rejection | None = None             # the spec was refused (spec is None)

    def put_workers(self, node: str, rows: list, summary: dict) -> None:
        """What ``node`` published of its workers, typed where it enters: the rows
        that parse, its recovery summary if it parses (a bad one is skipped,
        never the rows with it)."""
        self.workers[node] = WorkerRow.published(rows, node)
        try:
            self.summaries[node] = RecoverySummary.from_dict(summary, node)
        except (AttributeError, TypeError, ValueError, OverflowError):
            self.summaries.pop(node, None)

    def empty(self) -> bool:
        return self.spec is None and self.state is None and self.rejection is None \
            and not any(self.joins.values()) and not self.workers \
            and not any(self.done.values())


@dataclass
class _Marks:
    """The newest of each key of one job the view accepted: what a replay is older than."""
    order: tuple = ()                             # RoundState.order of the newest state
    seqs: dict = field(default_factory=dict)      # key -> writer's count of its newest record


def plain_spec(job_id: str, text: str) -> dict:
    """A spec as plain JSON, unchecked beyond the decoder (the torchrun adapter's prefix)."""
    return decode(text, max_bytes=SPEC_MAX_BYTES)


class JobsView:
    def __init__(self, store: Store, *, records, retry: float = 1.0, prefix: str = JOBS,
                 open_spec=plain_spec, refusals: Refusals | None = None):
        self._prefix = prefix
        self.records = records       # how every record of the job keys is sealed and opened
        self._open_spec = open_spec
        self.refusals = refusals or Refusals("jobs view")
        self._jobs: dict[str, JobKeys] = {}
        self._present: set[str] = set()     # keys whose value the view holds
        self._marks: OrderedDict[str, _Marks] = OrderedDict()
        self.changed = threading.Condition()
        self.revision = 0
        self._listeners: dict[str, list] = {}   # job id -> what to call on a change of it
        self._follower = Follower(store, prefix, "jobs-watch", retry, self._reset, self._event)
        self.synced = self._follower.synced

    # -- reading -------------------------------------------------------------
    def job(self, job_id: str) -> JobKeys | None:
        with self.changed:
            keys = self._jobs.get(job_id)
            if keys is None:
                return None
            return JobKeys(spec=keys.spec, state=keys.state, state_revision=keys.state_revision,
                           joins={r: dict(v) for r, v in keys.joins.items()},
                           done={r: set(v) for r, v in keys.done.items()},
                           workers=dict(keys.workers), summaries=dict(keys.summaries),
                           rejection=keys.rejection)

    def job_ids(self) -> list[str]:
        with self.changed:
            return list(self._jobs)

    def wait(self, timeout: float, seen: int | None = None,
             stop: threading.Event | None = None) -> None:
        """Wait for a change after revision ``seen`` (now, if None), timeout,
        or ``stop`` set (whoever sets it then calls ``wake_waiters``).

        Pass the revision read before looking at the view: a change applied
        between that look and this call then returns at once instead of
        being slept through.
        """
        with self.changed:
            after = self.revision if seen is None else seen
            self.changed.wait_for(
                lambda: self.revision > after or (stop is not None and stop.is_set()), timeout)

    def listen(self, job_id: str, fn) -> None:
        """Call ``fn()`` on each change of the job's keys (its phase records aside), on
        the watch's thread with the view locked: it must only wake someone."""
        with self.changed:
            self._listeners.setdefault(job_id, []).append(fn)

    def unlisten(self, job_id: str, fn) -> None:
        with self.changed:
            fns = self._listeners.get(job_id, [])
            if fn in fns:
                fns.remove(fn)
            if not fns:
                self._listeners.pop(job_id, None)

    def wake_waiters(self) -> None:
        """Wake every ``wait`` to look at its ``stop`` event again."""
        with self.changed:
            self.changed.notify_all()

    # -- the loop --------------------------------------------------------------
    def start(self) -> None:
        self._follower.start()

    def request_stop(self) -> None:
        self._follower.request_stop()

    def stop(self) -> None:
        self._follower.stop()

    def _reset(self, kvs: list, revision: int) -> None:
        """A fresh list: keys gone since are deleted, the others read again (a value
        that does not verify now keeps what the view held)."""
        with self.changed:
            listed = {kv.key for kv in kvs}
            for key in sorted(self._present - listed):
                self._apply(key, None, revision)
            for kv in kvs:
                self._apply(kv.key, kv.value, kv.revision, relisted=True)
            self.revision = revision
            self.changed.notify_all()

    def _event(self, ev) -> None:
        with self.changed:
            self._apply(ev.key, ev.value if ev.type == EVENT_PUT else None, ev.revision)
            self.revision = ev.revision
            parts = _parts(self._prefix, ev.key)
            if not _old_phases(parts):   # nobody wakes for those
                self.changed.notify_all()
                for fn in self._listeners.get(parts[0] if parts else "", ()):
                    fn()

    def _apply(self, key: str, value: str | None, revision: int,
               relisted: bool = False) -> None:
        """Fold one key into the view; the caller holds the condition. Never raises."""
        parts = _parts(self._prefix, key)
        if _old_phases(parts):
            return
        kind = _KINDS.get((parts[1], len(parts)), Kind.KEY) if len(parts) >= 2 else Kind.KEY
        with refusing(self.refusals, kind, key):
            # A spec under any printable id reaches the spec codec, which refuses an id
            # that is no job id with the same words as a submission (and reports it).
            named = is_ident(parts[0]) if kind is not Kind.SPEC else \
                0 < len(parts[0]) <= 253 and parts[0].isprintable()
            if kind is Kind.KEY or not named or (
                    len(parts) >= 3 and not is_ident(parts[-1])) or (
                    len(parts) == 4 and not (parts[2].isascii() and parts[2].isdigit()
                                             and len(parts[2]) <= 15)):
                if value is not None:
                    raise Refused(Reason.BAD_KEY, "no daemon writes such a key")
                return
            job_id = parts[0]
            keys = self._jobs.setdefault(job_id, JobKeys())
            try:
                if value is None:
                    self._delete(keys, kind, parts)
                    self._present.discard(key)
                elif self._put(keys, kind, key, parts, value, revision, relisted):
                    self._present.add(key)
            finally:
                if keys.empty():
                    self._jobs.pop(job_id, None)
                    if job_id in self._marks:
                        self._marks.move_to_end(job_id)

    def _delete(self, keys: JobKeys, kind: Kind, parts: list) -> None:
        if kind is Kind.SPEC:
            keys.spec, keys.rejection = None, None
        elif kind is Kind.STATE:
            keys.state, keys.state_revision = None, 0
        elif kind in (Kind.JOIN, Kind.DONE):
            table = keys.joins if kind is Kind.JOIN else keys.done
            rnd = int(parts[2])
            got = table.get(rnd)
            if got is not None:
                got.pop(parts[3], None) if kind is Kind.JOIN else got.discard(parts[3])
                if not got:
                    del table[rnd]
        else:
            keys.workers.pop(parts[2], None)
            keys.summaries.pop(parts[2], None)

    def _put(self, keys: JobKeys, kind: Kind, key: str, parts: list, value: str,
             revision: int, relisted: bool) -> bool:
        """Take a new value of ``key``; True if the view now holds it (Refused if not)."""
        job_id = parts[0]
        if kind is Kind.SPEC:
            return self._put_spec(keys, key, job_id, value)
        if kind is Kind.STATE:
            keys.state_revision = revision   # a CAS from the view's revision replaces it
            state = typed(RoundState.from_doc, self.records.open(kind, key, value).doc)
            marks = self._marks_of(job_id)
            if state.order < marks.order:
                raise Refused(Reason.REPLAYED, f"round {state.round} {state.status} lies before "
                              f"the round {marks.order[0]} this daemon holds")
            keys.state, marks.order = state, max(marks.order, state.order)
            return True
        seqs = self._marks_of(job_id).seqs
        opened, same = newer(self.records, kind, key, value, seqs, key in self._present,
                             relisted)
        if same:
            return True        # the record the view holds, listed again
        node = parts[-1]
        if kind is Kind.JOIN:
            join = typed(Join.from_doc, opened.doc)
            if join.node_id != node:
                raise Refused(Reason.INVALID, "the join names another node than its key")
            keys.joins.setdefault(int(parts[2]), {})[node] = join
        elif kind is Kind.DONE:
            keys.done.setdefault(int(parts[2]), set()).add(node)
        else:
            rows, summary = opened.doc.get("rows"), opened.doc.get("summary", {})
            if not isinstance(rows, list) or not isinstance(summary, dict):
                raise Refused(Reason.INVALID, "worker rows are not a list with a summary")
            keys.put_workers(node, rows, summary)
        if opened.seq:
            seqs[key] = opened.seq
        return True

    def _put_spec(self, keys: JobKeys, key: str, job_id: str, value: str) -> bool:
        try:
            spec = self._open_spec(job_id, value)
        except SpecRejected as exc:
            if keys.spec is None:    # kept for the dispatcher to report, and for status
                keys.rejection = exc.rejection
                self._present.add(key)
            raise Refused(_SPEC_REASONS.get(exc.rejection.reason.value, Reason.INVALID),
                          exc.rejection.detail) from None
        except BadValue as bad:
            raise Refused(Reason.of(bad), bad.detail) from None
        keys.spec, keys.rejection = spec, None
        return True

    def _marks_of(self, job_id: str) -> _Marks:
        marks = self._marks.get(job_id)
        if marks is None:
            marks = self._marks[job_id] = _Marks()
            while len(self._marks) > MARKS_KEPT:
                oldest = next(iter(self._marks))
                if oldest in self._jobs:      # held: keep it, look no further
                    self._marks.move_to_end(oldest)
                    break
                del self._marks[oldest]
        return marks


# A refused spec's reason (trust/rejections.RejectReason) as a record refusal's.
_SPEC_REASONS = {"unsigned": Reason.UNSIGNED, "bad_signature": Reason.BAD_MAC,
                 "id_mismatch": Reason.BAD_MAC, "undecryptable": Reason.BAD_MAC}
