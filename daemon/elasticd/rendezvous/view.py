"""The jobs as this daemon sees them: the job list everywhere, a job's rounds where it runs.

Its key spaces (rendezvous/protocol.py lists the keys):

* the job list, ``/v1/jobs/<job>/{spec,state}``: each job's spec (written once)
  and a copy of its round state, its members by id alone (written after each
  change of it; the members' addresses and ports are the rounds' business). Every
  daemon watches it with one watch (``start``/``stop``): what a node may adopt,
  and what it answers about a job that runs elsewhere. Only spec-level changes
  reach every node: a submission, and a job's round opening, closing or ending.
* a job's rounds, ``/v1/rounds/<job>/...``: its round state (the one a round's
  compare-and-swap moves) and who decides its open round. Only the nodes that
  run the job watch them (``follow``/``unfollow``: one watch per job, from the job's
  ``ClusterRendezvous``): what etcd sends a node grows with the jobs it runs,
  not with the cluster. ``job(id, fresh=True)`` of a job this node does not
  follow lists its rounds and joins once, for whoever asks about a job that
  runs elsewhere.
* a job's joins, ``/v1/joins/<job>/round/<R>/<node>``, and its done marks,
  ``/v1/joins/<job>/done/<R>/<node>``: a followed job's joins watch
  (``watch_joins``), as its rendezvous asks: every join and mark (the node that
  decides the open round, the closed round's first member, which ends the job
  once every member marked its workers done), or only the deletes of one
  round's joins (``JobKeys.gone``: a member lost), so a round's N joins and N
  marks reach one or two nodes, not N.
* a job's worker rows, ``/v1/workers/<job>/rows/<node>``: watched by no node (each
  node rewrites its rows after each start: N rows a round, which reached every
  node of the job while they lay under its rounds); ``job(id, rows=True)`` lists
  them once, for status.

``job(id)`` merges them: the spec from the list; for a followed job, its
rounds as its watch holds them (the state None until the watch has listed
them: a round is never decided on the list's copy); otherwise the list's copy
of the state, without joins or done marks (``JobKeys.detailed`` False); worker
rows only where asked for. The jobs'
phase records are in neither (rendezvous/phase_watch.py); the keys an older
elasticd wrote below ``/v1/jobs/<job>/`` (join, done, workers, phases) are not
read as anything.

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
refusal of that key, never an exception out of a watch.

A spec goes through ``open_spec(job_id, text)``. The daemon's verifies,
decrypts and checks it (trust/specs.SpecCodec.open); a spec it refuses is
kept as ``JobKeys.rejection`` (``spec`` stays None) unless a verified spec
is held, so nothing reads it as a job and the dispatcher can report it.
The torchrun adapter's specs are plain JSON (``plain_spec``).

``revision`` counts the changes the view took (any watch); ``wait`` wakes on
the next one. ``caught_up(job, r)`` says whether the job's rounds watch has
reached etcd revision ``r`` (a write of this node's own is in the view).
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
from ..store import EVENT_PUT, Store, StoreError
from ..store.follow import Follower, Held
from .opening import newer, refusing, typed
from .records import Join, RoundState

log = logging.getLogger("elasticd.rendezvous")

JOBS = "/v1/jobs"             # the job list: spec and a copy of the round state
ROUNDS = "/v1/rounds"         # a job's rounds: watched by its own nodes
JOINS = "/v1/joins"           # a job's joins: watched whole by its decider and first member
WORKERS = "/v1/workers"       # a job's worker rows: watched by no node, read for status
SPEC_MAX_BYTES = 1 << 20      # a plain spec (the torchrun adapter's)
MARKS_KEPT = 10_000           # jobs whose high-water marks outlive their keys
_LIST_KINDS = {("spec", 2): Kind.SPEC, ("state", 2): Kind.STATE}
_ROUND_KINDS = {("state", 2): Kind.STATE, ("decider", 3): Kind.DECIDER}
_JOIN_KINDS = {("round", 4): Kind.JOIN, ("done", 4): Kind.DONE}
_ROW_KINDS = {("rows", 3): Kind.WORKERS}
# Below /v1/rounds/<job>/, where an older elasticd kept the joins, done marks and worker
# rows: not read as anything.
_OLD_ROUNDS = frozenset({("join", 4), ("done", 4), ("workers", 3)})
# Below /v1/jobs/<job>/, where an older elasticd kept a job's joins, done marks, worker
# rows and phase records: not read as anything (their writers' leases end them).
_OLD = frozenset({("join", 4), ("done", 4), ("workers", 3), ("phases", 3)})


def _is_round(text: str) -> bool:
    """A round number as a key names it: decimal digits, bounded."""
    return text.isascii() and text.isdigit() and len(text) <= 15


def _join_named(doc: dict, node: str) -> Join:
    """The join a record's body holds, if it names the node its key names (Refused if not)."""
    join = typed(Join.from_doc, doc)
    if join.node_id != node:
        raise Refused(Reason.INVALID, "the join names another node than its key")
    return join


def _parts(prefix: str, key: str) -> list:
    """The key's names below ``prefix``: [job, kind, ...]; [] if not below it."""
    return key[len(prefix) + 1:].split("/") if key.startswith(prefix + "/") else []


@dataclass
class JobKeys:
    spec: object = None   # a JobSpec (SpecCodec.open); the torchrun adapter's: a dict
    state: RoundState | None = None
    state_revision: int = 0
    joins: dict = field(default_factory=dict)     # round -> {node: Join}
    deciders: dict = field(default_factory=dict)  # round -> the node that decides it
    done: dict = field(default_factory=dict)      # round -> set(node)
    workers: dict = field(default_factory=dict)   # node -> its WorkerRows (those that parse)
    summaries: dict = field(default_factory=dict)  # node -> its RecoverySummary, if it parsed
    rejection: Rejection | None = None             # the spec was refused (spec is None)
    # False: the job list's copy only (state, no joins, done marks or rows): a job
    # this node does not follow, not read fresh (JobsView.job)
    detailed: bool = True
    # False: this node watches the deletes of one round's joins only (``joins`` holds
    # none; ``gone``: round -> {node: the revision its join of it was deleted at})
    joins_all: bool = True
    gone: dict = field(default_factory=dict)

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
            and not any(self.done.values()) and not self.deciders

    def copy(self) -> "JobKeys":
        return JobKeys(spec=self.spec, state=self.state, state_revision=self.state_revision,
                       joins={r: dict(v) for r, v in self.joins.items()},
                       deciders=dict(self.deciders),
                       done={r: set(v) for r, v in self.done.items()},
                       workers=dict(self.workers), summaries=dict(self.summaries),
                       rejection=self.rejection, detailed=self.detailed,
                       joins_all=self.joins_all, gone={r: dict(v) for r, v in self.gone.items()})


@dataclass
class _Marks:
    """The newest of each key of one job the view accepted: what a replay is older than."""
    order: tuple = ()                             # RoundState.order of the newest state
    seqs: dict = field(default_factory=dict)      # key -> writer's count of its newest record


class _Space:
    """One key space folded into JobKeys per job, and the marks of what it took.
    ``once``: one read of the store (a record whose count equals the mark is taken)."""

    def __init__(self, root: str, kinds: dict, old: frozenset = frozenset(),
                 once: bool = False):
        self.root, self.kinds, self.old, self.once = root, kinds, old, once
        self.jobs: dict[str, JobKeys] = {}
        self.present: set[str] = set()     # keys whose value the space holds
        self.marks: OrderedDict[str, _Marks] = OrderedDict()

    def marks_of(self, job_id: str) -> _Marks:
        marks = self.marks.get(job_id)
        if marks is None:
            marks = self.marks[job_id] = _Marks()
            while len(self.marks) > MARKS_KEPT:
                oldest = next(iter(self.marks))
                if oldest in self.jobs:      # held: keep it, look no further
                    self.marks.move_to_end(oldest)
                    break
                del self.marks[oldest]
        return marks

    def reading(self, job_id: str) -> "_Space":
        """An empty space of the same keys for one read of the store (``once``), starting
        from this space's marks of the job: a record older than one taken here is a
        replay there too. The caller holds the view's condition."""
        once = _Space(self.root, self.kinds, self.old, once=True)
        marks = self.marks.get(job_id)
        if marks is not None:
            once.marks[job_id] = _Marks(marks.order, dict(marks.seqs))
        return once

    def forget(self, job_id: str) -> None:
        """Drop what the space holds of the job (its marks stay)."""
        self.jobs.pop(job_id, None)
        below = f"{self.root}/{job_id}/"
        self.present = {k for k in self.present if not k.startswith(below)}


class _Followed:
    """One followed job's rounds watch: how far it got, and how many follow it; and its
    joins watch (``JobsView.watch_joins``): of every join, or of one round's deletes."""

    def __init__(self, view: "JobsView", job_id: str):
        self.revision = 0          # the etcd revision the watch reached
        self.synced = False        # it listed the job's rounds
        self.follower = Follower(view.store, f"{view.rounds_root}/{job_id}/",
                                 f"rounds-watch-{job_id}", view.retry,
                                 lambda kvs, rev: view._reset_job(self, job_id, kvs, rev),
                                 lambda ev: view._job_event(self, job_id, ev))
        self.joins: Follower | None = None
        self.joins_round = None    # 0: every join watched (and listed); R: R's deletes
        self.joins_revision = 0    # the etcd revision the joins watch reached
        self.joins_synced = False
        self.gone: dict[int, dict] = {}  # round -> {node: revision its join was deleted at}
        self.wants: dict = {}            # asker -> the joins watch it wants (watch_joins)

    def followers(self) -> list:
        return [self.follower] + ([self.joins] if self.joins is not None else [])


def plain_spec(job_id: str, text: str) -> dict:
    """A spec as plain JSON, unchecked beyond the decoder (the torchrun adapter's prefix)."""
    return decode(text, max_bytes=SPEC_MAX_BYTES)


class JobsView:
    def __init__(self, store: Store, *, records, retry: float = 1.0, prefix: str = JOBS,
                 rounds: str = ROUNDS, joins: str = JOINS, workers: str = WORKERS,
                 open_spec=plain_spec,
                 refusals: Refusals | None = None):
        self.store = store
        self.retry = retry
        self.records = records       # how every record of the job keys is sealed and opened
        self.rounds_root = rounds
        self.joins_root = joins
        self.workers_root = workers
        self._open_spec = open_spec
        self.refusals = refusals or Refusals("jobs view")
        self._list = _Space(prefix, _LIST_KINDS, _OLD)
        self._rounds = _Space(rounds, _ROUND_KINDS, _OLD_ROUNDS)
        self._joins = _Space(joins, _JOIN_KINDS)
        self._rows = _Space(workers, _ROW_KINDS)    # its marks only: rows are read, not held
        self._followed = Held()     # job id -> _Followed
        self._also: list = []        # other watches of a job that live as long as its rounds'
        self.changed = threading.Condition()
        self.revision = 0            # changes taken, by any watch (what ``wait`` waits past)
        self._list_revision = 0      # the etcd revision the job list's watch reached
        self._listeners: dict[str, list] = {}   # job id -> what to call on a change of it
        self._follower = Follower(store, prefix, "jobs-watch", retry, self._reset, self._event)
        self.synced = self._follower.synced

    # -- reading -------------------------------------------------------------
    def job(self, job_id: str, fresh: bool = False, rows: bool = False) -> JobKeys | None:
        """The job's keys as this view holds them (see the module's words); with
        ``fresh``, a job this node does not follow has its rounds and joins listed from
        the store now (the list's copy alone if the store does not answer), and a job it
        follows whose joins watch is of one round's deletes, or has not listed them yet
        (it just switched to every join), has its joins listed; with
        ``rows``, its worker rows are listed now (none if the store does not answer)."""
        got = self._job(job_id, fresh)
        if rows and got is not None and is_ident(job_id):
            self._read_rows(job_id, got)
        return got

    def _read_rows(self, job_id: str, keys: JobKeys) -> None:
        """The job's worker rows and recovery summaries, listed now into ``keys`` (a copy
        of the view's), taken as a watch takes records: a row older than one read before
        is a replay."""
        try:
            kvs, _ = self.store.list(f"{self.workers_root}/{job_id}/")
        except StoreError as exc:
            log.debug("job %s: its worker rows not read: %s", job_id[:80], exc)
            return
        with self.changed:
            once = self._rows.reading(job_id)
            self._relist(once, kvs, 0)
            taken = once.marks.get(job_id)
            if taken is not None and taken.seqs:
                self._rows.marks_of(job_id).seqs.update(taken.seqs)
        read = once.jobs.get(job_id)
        keys.workers = read.workers if read is not None else {}
        keys.summaries = read.summaries if read is not None else {}

    def _job(self, job_id: str, fresh: bool) -> JobKeys | None:
        with self.changed:
            got = self._merged(job_id)
            followed = self._followed.get(job_id)
            if not fresh or not is_ident(job_id) or (
                    followed is not None and followed.synced and got is not None
                    and got.joins_all and followed.joins_synced):
                return got      # every join watched and listed: what the view holds
            rounds_too = followed is None or not followed.synced
        try:
            kvs = self.store.list(f"{self.rounds_root}/{job_id}/")[0] if rounds_too else []
            joins, _ = self.store.list(f"{self.joins_root}/{job_id}/")
        except StoreError as exc:
            log.debug("job %s: its rounds not read: %s", job_id[:80], exc)
            return got
        with self.changed:
            once, once_joins = self._rounds.reading(job_id), self._joins.reading(job_id)
            self._relist(once, kvs, 0)
            self._relist(once_joins, joins, 0)
            got = self._merged(job_id)
        joined = once_joins.jobs.get(job_id)
        read_joins = joined.joins if joined is not None else {}
        read_done = joined.done if joined is not None else {}
        if not rounds_too:
            if got is not None:
                got.joins, got.done, got.joins_all = read_joins, read_done, True
            return got
        read = once.jobs.get(job_id)
        if read is None and not read_joins and not read_done:
            return got
        read = read.copy() if read is not None else JobKeys()
        read.joins, read.done = read_joins, read_done
        if got is not None:
            read.spec, read.rejection = got.spec, got.rejection
            if read.state is None:
                read.state = got.state
        return read

    def _merged(self, job_id: str) -> JobKeys | None:
        """The caller holds the condition."""
        listed = self._list.jobs.get(job_id)
        followed = self._followed.get(job_id)
        if followed is None:
            if listed is None:
                return None
            got = JobKeys(spec=listed.spec, state=listed.state, rejection=listed.rejection,
                          detailed=False)
            return got
        rounds = self._rounds.jobs.get(job_id)
        got = rounds.copy() if rounds is not None else JobKeys()
        if not followed.synced:
            got.state, got.state_revision = None, 0
        joins = self._joins.jobs.get(job_id)
        got.joins_all = followed.joins_round == 0
        got.joins = {r: dict(v) for r, v in joins.joins.items()} \
            if joins is not None and got.joins_all else {}
        got.done = {r: set(v) for r, v in joins.done.items()} \
            if joins is not None and got.joins_all else {}
        got.gone = {r: dict(v) for r, v in followed.gone.items()}
        if listed is not None:
            got.spec, got.rejection = listed.spec, listed.rejection
        elif got.empty():
            return None
        return got

    def listed_state(self, job_id: str) -> tuple[RoundState | None, int]:
        """The job list's copy of the job's round state, and its key's revision."""
        with self.changed:
            listed = self._list.jobs.get(job_id)
            return (listed.state, listed.state_revision) if listed else (None, 0)

    def job_ids(self) -> list[str]:
        with self.changed:
            return list(dict.fromkeys([*self._list.jobs, *self._followed.keys()]))

    def wait(self, timeout: float, seen: int | None = None,
             stop: threading.Event | None = None) -> None:
        """Wait for a change after ``seen`` (``revision`` read before looking; now, if
        None), timeout, or ``stop`` set (whoever sets it then calls ``wake_waiters``).

        Pass the revision read before looking at the view: a change applied
        between that look and this call then returns at once instead of
        being slept through.
        """
        with self.changed:
            after = self.revision if seen is None else seen
            self.changed.wait_for(
                lambda: self.revision > after or (stop is not None and stop.is_set()), timeout)

    def reached(self, key: str, revision: int) -> bool:
        """Whether the watch that covers ``key`` (the job list's, or its job's rounds or
        joins watch here) got as far as etcd revision ``revision``; a worker row is
        watched by none (read when asked for): always."""
        if _parts(self.workers_root, key):
            return True
        parts = _parts(self.rounds_root, key)
        if parts:
            return self.caught_up(parts[0], revision)
        parts = _parts(self.joins_root, key)
        if parts:
            return self.joins_caught_up(parts[0], revision)
        with self.changed:
            return self._list_revision >= revision

    def caught_up(self, job_id: str, revision: int) -> bool:
        """Whether the job's rounds watch listed them and reached etcd revision
        ``revision`` (a write of this node's there is in the view)."""
        with self.changed:
            followed = self._followed.get(job_id)
            return followed is not None and followed.synced and followed.revision >= revision

    def listen(self, job_id: str, fn) -> None:
        """Call ``fn()`` on each change of the job's keys (its phase records aside), on
        a watch's thread with the view locked: it must only wake someone."""
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

    # -- following a job's rounds ------------------------------------------------
    def also_follow(self, other) -> None:
        """``other.follow(job)`` / ``other.unfollow(job)`` whenever this view starts or
        ends a job's rounds watch (cluster/eventlog.py: the job's events)."""
        self._also.append(other)

    def follow(self, job_id: str) -> None:
        """Watch the job's rounds from now until as many ``unfollow``s."""
        with self.changed:
            followed, new = self._followed.take(job_id, lambda: _Followed(self, job_id))
        if not new:
            return
        followed.follower.start()
        for other in self._also:
            other.follow(job_id)

    def unfollow(self, job_id: str) -> None:
        """The job's rounds watch ends once its last follower let go (the watch's
        thread sees it within the store's watch poll; nothing waits for it here)."""
        with self.changed:
            followed = self._followed.let_go(job_id)
            if followed is None:
                return
            self._rounds.forget(job_id)
            self._joins.forget(job_id)
            self.revision += 1
            self.changed.notify_all()
        followed.follower.request_stop()
        if followed.joins is not None:
            followed.joins.request_stop()
        for other in self._also:
            other.unfollow(job_id)

    def following(self) -> list[str]:
        with self.changed:
            return sorted(self._followed.keys())

    def watch_joins(self, job_id: str, rnd: int = 0, asker: object = None) -> None:
        """Watch the followed job's joins as ``asker`` wants them: every join of every
        round (``rnd`` 0: listed first, then each put and delete, as its decider and first
        member need), or only the deletes of round ``rnd``'s joins from now (a node lost:
        what every other node needs; no join reaches it). Of several askers (a view
        shared in tests), one that wants all, or two that want other rounds, get all.
        Nothing if the job's joins are watched so already."""
        with self.changed:
            followed = self._followed.get(job_id)
            if followed is None:
                return
            followed.wants[asker] = rnd
            wanted = set(followed.wants.values())
            rnd = wanted.pop() if len(wanted) == 1 else 0
            if followed.joins is not None and followed.joins_round == rnd:
                return
            # The joins held stay, unused while only deletes are watched: a list when all
            # are watched again takes the same records again (not as replays) and drops
            # the keys deleted meanwhile, as after a compaction.
            old = followed.joins
            followed.joins_round, followed.joins_synced = rnd, False
            followed.joins_revision, followed.gone = 0, {}
            below = f"{self.joins_root}/{job_id}/" + (f"round/{rnd}/" if rnd else "")
            new = followed.joins = Follower(
                self.store, below, f"joins-watch-{job_id}", self.retry,
                lambda kvs, rev: self._reset_joins(followed, new, job_id, kvs, rev),
                lambda ev: self._joins_event(followed, new, job_id, ev),
                deletes_only=bool(rnd))
            self.revision += 1
            self.changed.notify_all()
        if old is not None:
            old.request_stop()
        new.start()

    def let_go_joins(self, job_id: str, asker: object) -> None:
        """``asker`` wants the job's joins watched no more (its next asker sets the way)."""
        with self.changed:
            followed = self._followed.get(job_id)
            if followed is not None:
                followed.wants.pop(asker, None)

    def read_join(self, key: str, value: str) -> Join | None:
        """A join read by its key (a closed round's first member's, by a node that watches
        the round's join deletes only), taken as the joins watch takes one: sealed, bound
        to its key, naming the node its key names; else None, the refusal counted."""
        parts = _parts(self.joins_root, key)
        with refusing(self.refusals, Kind.JOIN, key):
            if len(parts) != 4 or (parts[1], len(parts)) not in _JOIN_KINDS \
                    or not _is_round(parts[2]) or not is_ident(parts[3]):
                raise Refused(Reason.BAD_KEY, "no daemon writes such a key")
            return _join_named(self.records.open(Kind.JOIN, key, value).doc, parts[3])
        return None

    def joins_caught_up(self, job_id: str, revision: int = 0) -> bool:
        """Whether the followed job's joins watch is running and reached etcd revision
        ``revision`` (a join of this node's is in the view, if every join is watched)."""
        with self.changed:
            followed = self._followed.get(job_id)
            return followed is not None and followed.joins_synced \
                and followed.joins_revision >= revision

    # -- the loops -------------------------------------------------------------
    def start(self) -> None:
        self._follower.start()

    def request_stop(self) -> None:
        self._follower.request_stop()
        with self.changed:
            followed = self._followed.things()
        for f in followed:
            for follower in f.followers():
                follower.request_stop()

    def stop(self) -> None:
        with self.changed:
            followed = self._followed.clear()
        self._follower.request_stop()
        for f in followed:
            for follower in f.followers():
                follower.request_stop()
        self._follower.stop()
        for f in followed:
            for follower in f.followers():
                follower.stop()

    def _changed(self, job_id: str) -> None:
        """One more change taken: wake the waiters and the job's listeners (the caller
        holds the condition)."""
        self.revision += 1
        self.changed.notify_all()
        for fn in self._listeners.get(job_id, ()):
            fn()

    def _reset(self, kvs: list, revision: int) -> None:
        """A fresh list: keys gone since are deleted, the others read again (a value
        that does not verify now keeps what the view held)."""
        with self.changed:
            self._relist(self._list, kvs, revision)
            self._list_revision = max(self._list_revision, revision)
            self.revision += 1
            self.changed.notify_all()

    def _event(self, ev) -> None:
        with self.changed:
            parts = _parts(self._list.root, ev.key)
            self._list_revision = max(self._list_revision, ev.revision)
            if len(parts) >= 2 and (parts[1], len(parts)) in _OLD:
                return           # nobody wakes for those
            self._apply(self._list, ev.key, ev.value if ev.type == EVENT_PUT else None,
                        ev.revision)
            self._changed(parts[0] if parts else "")

    def _reset_job(self, followed: _Followed, job_id: str, kvs: list, revision: int) -> None:
        with self.changed:
            if self._followed.get(job_id) is not followed:
                return           # unfollowed meanwhile
            self._relist(self._rounds, kvs, revision, f"{self._rounds.root}/{job_id}/")
            followed.revision, followed.synced = max(followed.revision, revision), True
            self._changed(job_id)

    def _job_event(self, followed: _Followed, job_id: str, ev) -> None:
        with self.changed:
            if self._followed.get(job_id) is not followed:
                return
            parts = _parts(self._rounds.root, ev.key)
            if parts and parts[0] == job_id:
                self._apply(self._rounds, ev.key, ev.value if ev.type == EVENT_PUT else None,
                            ev.revision)
            followed.revision = max(followed.revision, ev.revision)
            self._changed(job_id)

    def _reset_joins(self, followed: _Followed, follower: Follower, job_id: str, kvs: list,
                     revision: int) -> None:
        with self.changed:
            if self._followed.get(job_id) is not followed or followed.joins is not follower:
                return           # unfollowed, or watched another way, meanwhile
            if not followed.joins_round:
                self._relist(self._joins, kvs, revision, f"{self._joins.root}/{job_id}/")
            followed.joins_revision = max(followed.joins_revision, revision)
            followed.joins_synced = True
            self._changed(job_id)

    def _joins_event(self, followed: _Followed, follower: Follower, job_id: str, ev) -> None:
        with self.changed:
            if self._followed.get(job_id) is not followed or followed.joins is not follower:
                return
            parts = _parts(self._joins.root, ev.key)
            if followed.joins_round:
                # A delete of one of the round's joins (all this watch is sent).
                if ev.type != EVENT_PUT and len(parts) == 4 and parts[0] == job_id \
                        and parts[2] == str(followed.joins_round) and is_ident(parts[3]):
                    followed.gone.setdefault(followed.joins_round, {})[parts[3]] = ev.revision
            elif parts and parts[0] == job_id:
                self._apply(self._joins, ev.key, ev.value if ev.type == EVENT_PUT else None,
                            ev.revision)
            followed.joins_revision = max(followed.joins_revision, ev.revision)
            self._changed(job_id)

    def _relist(self, space: _Space, kvs: list, revision: int, below: str = "") -> None:
        """A fresh list of ``space`` (of its keys under ``below``): keys gone since are
        deleted, the others read again (a value that does not verify now keeps what the
        view held). The caller holds the condition."""
        listed = {kv.key for kv in kvs}
        for key in sorted(k for k in space.present - listed if k.startswith(below)):
            self._apply(space, key, None, revision)
        for kv in kvs:
            self._apply(space, kv.key, kv.value, kv.revision, relisted=True)

    def _apply(self, space: _Space, key: str, value: str | None, revision: int,
               relisted: bool = False) -> None:
        """Fold one key into ``space``; the caller holds the condition. Never raises."""
        parts = _parts(space.root, key)
        if len(parts) >= 2 and (parts[1], len(parts)) in space.old:
            return
        kind = space.kinds.get((parts[1], len(parts)), Kind.KEY) if len(parts) >= 2 \
            else Kind.KEY
        with refusing(self.refusals, kind, key):
            # A spec under any printable id reaches the spec codec, which refuses an id
            # that is no job id with the same words as a submission (and reports it).
            named = is_ident(parts[0]) if kind is not Kind.SPEC else \
                0 < len(parts[0]) <= 253 and parts[0].isprintable()
            rnd = parts[2] if len(parts) == 4 or kind is Kind.DECIDER else None
            if kind is Kind.KEY or not named or (
                    len(parts) >= 3 and not is_ident(parts[-1])) or (
                    rnd is not None and not _is_round(rnd)):
                if value is not None:
                    raise Refused(Reason.BAD_KEY, "no daemon writes such a key")
                return
            job_id = parts[0]
            keys = space.jobs.setdefault(job_id, JobKeys())
            try:
                if value is None:
                    self._delete(keys, kind, parts)
                    space.present.discard(key)
                elif self._put(space, keys, kind, key, parts, value, revision, relisted):
                    space.present.add(key)
            finally:
                if keys.empty():
                    space.jobs.pop(job_id, None)
                    if job_id in space.marks:
                        space.marks.move_to_end(job_id)

    def _delete(self, keys: JobKeys, kind: Kind, parts: list) -> None:
        if kind is Kind.SPEC:
            keys.spec, keys.rejection = None, None
        elif kind is Kind.STATE:
            keys.state, keys.state_revision = None, 0
        elif kind is Kind.DECIDER:
            keys.deciders.pop(int(parts[2]), None)
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

    def _put(self, space: _Space, keys: JobKeys, kind: Kind, key: str, parts: list,
             value: str, revision: int, relisted: bool) -> bool:
        """Take a new value of ``key``; True if the view now holds it (Refused if not)."""
        job_id = parts[0]
        if kind is Kind.SPEC:
            return self._put_spec(space, keys, key, job_id, value)
        if kind is Kind.STATE:
            keys.state_revision = revision   # a CAS from the view's revision replaces it
            state = typed(RoundState.from_doc, self.records.open(kind, key, value).doc)
            marks = space.marks_of(job_id)
            if state.order < marks.order:
                raise Refused(Reason.REPLAYED, f"round {state.round} {state.status} lies before "
                              f"the round {marks.order[0]} this daemon holds")
            keys.state, marks.order = state, max(marks.order, state.order)
            return True
        if kind is Kind.DECIDER:
            # Claimed by one node, deleted, claimed by another: writers' counts of other
            # nodes do not order (clocks differ), so no claim is refused as older.
            claim = self.records.open(kind, key, value).doc.get("node")
            if not is_ident(claim):
                raise Refused(Reason.INVALID, "a decider's claim names no node")
            keys.deciders[int(parts[2])] = claim
            return True
        seqs = space.marks_of(job_id).seqs
        opened, same = newer(self.records, kind, key, value, seqs,
                             space.once or key in space.present, relisted)
        if same and not space.once:
            return True        # the record the view holds, listed again
        node = parts[-1]
        if kind is Kind.JOIN:
            keys.joins.setdefault(int(parts[2]), {})[node] = _join_named(opened.doc, node)
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

    def _put_spec(self, space: _Space, keys: JobKeys, key: str, job_id: str,
                  value: str) -> bool:
        try:
            spec = self._open_spec(job_id, value)
        except SpecRejected as exc:
            if keys.spec is None:    # kept for the dispatcher to report, and for status
                keys.rejection = exc.rejection
                space.present.add(key)
            raise Refused(_SPEC_REASONS.get(exc.rejection.reason.value, Reason.INVALID),
                          exc.rejection.detail) from None
        except BadValue as bad:
            raise Refused(Reason.of(bad), bad.detail) from None
        keys.spec, keys.rejection = spec, None
        return True


# A refused spec's reason (trust/rejections.RejectReason) as a record refusal's.
_SPEC_REASONS = {"unsigned": Reason.UNSIGNED, "bad_signature": Reason.BAD_MAC,
                 "id_mismatch": Reason.BAD_MAC, "undecryptable": Reason.BAD_MAC}
