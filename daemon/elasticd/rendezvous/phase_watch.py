"""The phase records of the jobs this node runs, and their digests: scoped watches per job.

Each node of a job across nodes writes one record of its ranks' phases
(hangs/phase_board.py), and the round's first member folds the records into a
digest (hangs/phase_digest.py), each under a prefix of their own, outside the
job keys every daemon watches (rendezvous/view.py)::

    /v1/phases/<job>/<node>          sealed with the cluster key (trust/sealed.py:
    /v1/phasedigests/<job>/<node>    bound to this key name), under the writer's
                                     lease; deleted when the job ends on that node
                                     (a digest: also when its writer stops being
                                     the round's first member)

While a node runs a job it watches either the job's records (``follow``: it is
the round's first member) or the job's digests (``follow_digests``: every other
member), one watch (store/follow.py's ``Follower``) per job and kind, switched
by the job's PeerReader (agent/phase_peers.py) as the first member changes. So a
record reaches one node and a digest the job's other nodes: what etcd sends a
node for phases grows with the jobs it runs, never with the cluster nor with
the nodes of its jobs. ``phases`` of a job this node does not follow lists the
job's records once, for whoever asks about a job that runs elsewhere.

Every value is taken as the jobs view takes its records (rendezvous/opening.py):
verified, its writer's count above the last one taken of its key (the counts
are kept for ``MARKS_KEPT`` jobs after they are unfollowed), then
``NodePhases.from_doc`` or ``PhaseDigest.from_doc``; or refused (kind
``phases``, both), counted and logged once (trust/refusals.py), and the key
keeps its last verified value. A key that is no ``<job>/<node>`` of the
followed job is refused as a bad key.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from ..fields import is_ident
from ..hangs.phase_board import NodePhases
from ..hangs.phase_digest import PhaseDigest
from ..store import EVENT_PUT, Lease, Store
from ..store.follow import Follower, Held
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused
from .opening import newer, refusing, typed

PHASES = "/v1/phases"
DIGESTS = "/v1/phasedigests"
MARKS_KEPT = 10_000           # jobs whose writers' counts outlive their watch here


@dataclass
class _Records:
    """One job's records (or digests) as this node holds them: {node: (NodePhases or
    PhaseDigest, monotonic time got)}."""
    prefix: str
    seqs: dict                                     # key -> writer's count of the newest taken
    got: dict = field(default_factory=dict)
    once: bool = False        # one read of the store: a count equal to the last is that record
    build: Callable = NodePhases.from_doc          # (doc, writer's node id) -> the record

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
            record = typed(lambda doc: self.build(doc, node), opened.doc)
            self.got[node] = (record, time.monotonic())
            if opened.seq:
                self.seqs[key] = opened.seq


class _Followed:
    """One followed job: its records (or digests) and the watch that keeps them."""

    def __init__(self, watch: "PhaseWatch", name: str, records: _Records):
        self._watch, self._records = watch, records
        self.follower = Follower(watch.store, records.prefix, name,
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
                 digests: str = DIGESTS, refusals: Refusals | None = None):
        self.store = store
        self.records = records        # seals what this node writes, opens what it reads
        self.retry = retry
        self.refusals = refusals or Refusals("phase watch")
        self._prefix = prefix
        self._digests = digests
        self.lock = threading.Lock()
        self._followed = Held()     # job id -> _Followed, its records
        self._followed_digests = Held()     # job id -> _Followed, its digests
        # (prefix, job) -> its writers' counts
        self._seqs: OrderedDict[tuple, dict] = OrderedDict()

    def key(self, job_id: str, node_id: str) -> str:
        return f"{self._prefix}/{job_id}/{node_id}"

    def digest_key(self, job_id: str, node_id: str) -> str:
        return f"{self._digests}/{job_id}/{node_id}"

    # -- this node's record ----------------------------------------------------
    def publish(self, job_id: str, node_id: str, text: str, lease: Lease | None) -> None:
        """This node's record for the job, under its lease (gone with the node)."""
        key = self.key(job_id, node_id)
        self.store.put(key, self.records.seal(Kind.PHASES, key, text), lease=lease)

    def delete(self, job_id: str, node_id: str) -> None:
        self.store.delete(self.key(job_id, node_id))

    def publish_digest(self, job_id: str, node_id: str, text: str, lease: Lease | None) -> None:
        """This node's digest of the job's records, under its lease."""
        key = self.digest_key(job_id, node_id)
        self.store.put(key, self.records.seal(Kind.PHASES, key, text), lease=lease)

    def delete_digest(self, job_id: str, node_id: str) -> None:
        self.store.delete(self.digest_key(job_id, node_id))

    # -- following the jobs this node runs ---------------------------------------
    def follow(self, job_id: str) -> None:
        """Watch the job's records from now until as many ``unfollow``s."""
        self._take(self._followed, job_id, self._prefix, NodePhases.from_doc, "phases")

    def unfollow(self, job_id: str) -> None:
        """The job's watch ends once its last follower let go (waits up to retry + 2 s)."""
        self._let_go(self._followed, job_id)

    def follow_digests(self, job_id: str) -> None:
        """Watch the job's digests from now until as many ``unfollow_digests``."""
        self._take(self._followed_digests, job_id, self._digests, PhaseDigest.from_doc,
                   "phasedigests")

    def unfollow_digests(self, job_id: str) -> None:
        self._let_go(self._followed_digests, job_id)

    def following(self) -> list[str]:
        """The jobs whose records or digests this node watches."""
        with self.lock:
            return sorted(set(self._followed.keys()) | set(self._followed_digests.keys()))

    def digest(self, job_id: str, node_id: str):
        """(PhaseDigest, monotonic time got) that ``node_id`` wrote for the job, as this
        node's watch of the job's digests holds it; None if none (or not followed)."""
        with self.lock:
            followed = self._followed_digests.get(job_id)
        return followed.snapshot().get(node_id) if followed is not None else None

    def _take(self, held: Held, job_id: str, prefix: str, build, name: str) -> None:
        with self.lock:
            followed, new = held.take(
                job_id, lambda: _Followed(self, f"{name}-watch-{job_id}",
                                          self._records(job_id, prefix, build)))
        if new:
            followed.follower.start()

    def _let_go(self, held: Held, job_id: str) -> None:
        with self.lock:
            followed = held.let_go(job_id)
        if followed is not None:
            followed.follower.stop()

    def phases(self, job_id: str) -> dict:
        """{node: (NodePhases, monotonic time this daemon got it)} of the job: as its watch
        holds them where this node follows it, else read from the store now."""
        with self.lock:
            followed = self._followed.get(job_id)
        if followed is not None:
            return followed.snapshot()
        kvs, _ = self.store.list(self._job_prefix(job_id))
        with self.lock:
            known = self._seqs.get((self._prefix, job_id), {})
            records = _Records(self._job_prefix(job_id), dict(known), once=True)
            for kv in kvs:
                self.take(records, kv.key, kv.value)
            return dict(records.got)

    def stop(self) -> None:
        """End every watch (each within the store's watch poll)."""
        with self.lock:
            followed = self._followed.clear() + self._followed_digests.clear()
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

    def _records(self, job_id: str, prefix: str, build) -> _Records:
        """A fresh table of the job's records (or digests: ``prefix``), with the writers'
        counts taken before."""
        mark = (prefix, job_id)
        seqs = self._seqs.get(mark)
        if seqs is None:
            seqs = self._seqs[mark] = {}
            while len(self._seqs) > MARKS_KEPT:
                self._seqs.popitem(last=False)
        self._seqs.move_to_end(mark)
        return _Records(f"{prefix}/{job_id}/", seqs, build=build)

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

    def follow_digests(self) -> None:
        self.watch.follow_digests(self.job_id)

    def unfollow_digests(self) -> None:
        self.watch.unfollow_digests(self.job_id)

    def publish_digest(self, text: str) -> None:
        self.watch.publish_digest(self.job_id, self.node_id, text, self.lease())

    def delete_digest(self) -> None:
        self.watch.delete_digest(self.job_id, self.node_id)

    def digest(self, writer: str):
        """(PhaseDigest, monotonic time got) of the job written by ``writer``, or None."""
        return self.watch.digest(self.job_id, writer)
