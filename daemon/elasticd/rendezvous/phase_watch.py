"""The phase records of the jobs this node runs: a scoped watch per job, read on demand for others.

Each node of a job across nodes writes one record of its ranks' phases
(hangs/phase_board.py) under a prefix of their own, outside the job keys every
daemon watches (rendezvous/view.py)::

    /v1/phases/<job>/<node>     sealed with the cluster key (trust/sealed.py: bound to
                                this key name), under the writer's lease; deleted when
                                the job ends on that node

A node watches one job's records only while it runs the job
(``follow``/``unfollow``: the agent's attempt, agent/attempt.py), one watch
(store/follow.py's ``Follower``) per job it runs; so a record reaches the
job's own nodes and no other: what etcd sends a node for phase records grows
with the jobs it runs, never with the cluster. ``phases`` of a job this node
does not follow lists the job's records once, for whoever asks about a job
that runs elsewhere.

Every value is taken as the jobs view takes its records (rendezvous/opening.py):
verified, its writer's count above the last one taken of its key (the counts
are kept for ``MARKS_KEPT`` jobs after they are unfollowed), then
``NodePhases.from_doc``; or refused (kind ``phases``), counted and logged once
(trust/refusals.py), and the key keeps its last verified value. A key that
is no ``<job>/<node>`` of the followed job is refused as a bad key.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ..fields import is_ident
from ..hangs.phase_board import NodePhases
from ..store import EVENT_PUT, Lease, Store
from ..store.follow import Follower, Held
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused
from .opening import newer, refusing, typed

PHASES = "/v1/phases"
MARKS_KEPT = 10_000           # jobs whose writers' counts outlive their watch here


@dataclass
class _Records:
    """One job's records as this node holds them: {node: (NodePhases, monotonic time got)}."""
    prefix: str
    seqs: dict                                     # key -> writer's count of the newest taken
    got: dict = field(default_factory=dict)
    once: bool = False        # one read of the store: a count equal to the last is that record

    def fold(self, records, refusals: Refusals, key: str, value: str | None,
             relisted: bool = False) -> None:
        """One key's new value (None: deleted). Never raises."""
        with refusing(refusals, Kind.PHASES, key):
            node = key[len(self.prefix):] if key.startswith(self.prefix) else ""
            if not is_ident(node):
                if value is not None:
                    raise Refused(Reason.BAD_KEY, "no daemon writes such a key")
                return
            if value is None:
                self.got.pop(node, None)
                return
            opened, same = newer(records, Kind.PHASES, key, value, self.seqs,
                                 self.once or node in self.got, relisted or self.once)
            if same and not self.once:
                return            # the record held, listed again
            record = typed(lambda doc: NodePhases.from_doc(doc, node), opened.doc)
            self.got[node] = (record, time.monotonic())
            if opened.seq:
                self.seqs[key] = opened.seq


class _Followed:
    """One followed job: its records and the watch that keeps them."""

    def __init__(self, watch: "PhaseWatch", job_id: str, records: _Records):
        self._watch, self._records = watch, records
        self.follower = Follower(watch.store, records.prefix, f"phases-watch-{job_id}",
                                 watch.retry, self._reset, self._event)

    def snapshot(self) -> dict:
        with self._watch.lock:
            return dict(self._records.got)

    def _reset(self, kvs: list, revision: int) -> None:
        with self._watch.lock:
            listed = {kv.key for kv in kvs}
            for node in [n for n in self._records.got if self._records.prefix + n not in listed]:
                del self._records.got[node]
            for kv in kvs:
                self._watch.take(self._records, kv.key, kv.value, relisted=True)

    def _event(self, ev) -> None:
        with self._watch.lock:
            self._watch.take(self._records, ev.key, ev.value if ev.type == EVENT_PUT else None)


class PhaseWatch:
    """This node's phase records: written (``publish``/``delete``), followed per job it
    runs, read (``phases``). One owner (the daemon), ``stop`` ends every watch."""

    def __init__(self, store: Store, *, records, retry: float = 1.0, prefix: str = PHASES,
                 refusals: Refusals | None = None):
        self.store = store
        self.records = records        # seals what this node writes, opens what it reads
        self.retry = retry
        self.refusals = refusals or Refusals("phase watch")
        self._prefix = prefix
        self.lock = threading.Lock()
        self._followed = Held()     # job id -> _Followed
        self._seqs: OrderedDict[str, dict] = OrderedDict()   # job -> its writers' counts

    def key(self, job_id: str, node_id: str) -> str:
        return f"{self._prefix}/{job_id}/{node_id}"

    # -- this node's record ----------------------------------------------------
    def publish(self, job_id: str, node_id: str, text: str, lease: Lease | None) -> None:
        """This node's record for the job, under its lease (gone with the node)."""
        key = self.key(job_id, node_id)
        self.store.put(key, self.records.seal(Kind.PHASES, key, text), lease=lease)

    def delete(self, job_id: str, node_id: str) -> None:
        self.store.delete(self.key(job_id, node_id))

    # -- following the jobs this node runs ---------------------------------------
    def follow(self, job_id: str) -> None:
        """Watch the job's records from now until as many ``unfollow``s."""
        with self.lock:
            followed, new = self._followed.take(
                job_id, lambda: _Followed(self, job_id, self._records(job_id)))
        if new:
            followed.follower.start()

    def unfollow(self, job_id: str) -> None:
        """The job's watch ends once its last follower let go (waits up to retry + 2 s)."""
        with self.lock:
            followed = self._followed.let_go(job_id)
        if followed is not None:
            followed.follower.stop()

    def following(self) -> list[str]:
        with self.lock:
            return sorted(self._followed.keys())

    def phases(self, job_id: str) -> dict:
        """{node: (NodePhases, monotonic time this daemon got it)} of the job: as its watch
        holds them where this node follows it, else read from the store now."""
        with self.lock:
            followed = self._followed.get(job_id)
        if followed is not None:
            return followed.snapshot()
        kvs, _ = self.store.list(self._job_prefix(job_id))
        with self.lock:
            known = self._seqs.get(job_id, {})
            records = _Records(self._job_prefix(job_id), dict(known), once=True)
            for kv in kvs:
                self.take(records, kv.key, kv.value)
            return dict(records.got)

    def stop(self) -> None:
        """End every watch (each within the store's watch poll)."""
        with self.lock:
            followed = self._followed.clear()
        for f in followed:
            f.follower.request_stop()
        for f in followed:
            f.follower.stop()

    # -- taking records (the caller holds the lock) ----------------------------------
    def take(self, records: _Records, key: str, value: str | None,
             relisted: bool = False) -> None:
        records.fold(self.records, self.refusals, key, value, relisted)

    def _job_prefix(self, job_id: str) -> str:
        return f"{self._prefix}/{job_id}/"

    def _records(self, job_id: str) -> _Records:
        """A fresh table of the job's records, with the writers' counts taken before."""
        seqs = self._seqs.get(job_id)
        if seqs is None:
            seqs = self._seqs[job_id] = {}
            while len(self._seqs) > MARKS_KEPT:
                self._seqs.popitem(last=False)
        self._seqs.move_to_end(job_id)
        return _Records(self._job_prefix(job_id), seqs)

    def for_job(self, job_id: str, node_id: str,
                lease: Callable[[], Lease | None]) -> "JobPhases":
        """What the job's agent on this node uses: its record under ``lease()``, its peers'."""
        return JobPhases(self, job_id, node_id, lease)


@dataclass(frozen=True)
class JobPhases:
    """One job's phase records as this node's agent of it uses them (agent/attempt.py)."""
    watch: PhaseWatch
    job_id: str
    node_id: str
    lease: Callable[[], Lease | None]

    def follow(self) -> None:
        self.watch.follow(self.job_id)

    def unfollow(self) -> None:
        self.watch.unfollow(self.job_id)

    def publish(self, text: str) -> None:
        self.watch.publish(self.job_id, self.node_id, text, self.lease())

    def delete(self) -> None:
        self.watch.delete(self.job_id, self.node_id)

    def peers(self) -> dict:
        """{node: (NodePhases, monotonic time got)} of the job (this node's own too)."""
        return self.watch.phases(self.job_id)
