"""Each node's view of one job's ranks, shared with the job's other nodes through the store.

A job across nodes has ranks that wait, in a collective, for a rank on another
node: when that rank is in a checkpoint or a section, their silence is
explained by a phase no daemon on their node sees. So each node of a round
publishes one small record per job (``NodePhases``), which only the round's
first member watches (rendezvous/phase_watch.py; it folds them into the
digest the job's other nodes watch, hangs/phase_digest.py)::

    /v1/phases/<job>/<node>     this node's ranks: phase, for how long, step
                                statistics; and the gaps learned per phase
                                (under the node's lease; deleted at the job's
                                end on that node)

Built in one place (``ProgressTracker.snapshot``), serialised in one place
(``NodePhases.to_json``), read in one place (``NodePhases.from_doc``, called
where the key enters the daemon: the phase watch, once trust/sealed.py verified
the node's seal and decoded the value). A peer's record is etcd input:
anything malformed, naming another node or out of range is refused there
(ValueError), and the watch ignores and counts it.

``PhasePublisher`` is the one writer: a thread per job with a stop event. It
writes what the peers decide on when it changes: at once when a rank's phase
or the round changes (a peer sees a checkpoint begin within a tick), within
``agent.phase_publish_interval`` when a rank's time per step moved by a fifth
or more, or what was learned grew (``NodePhases.moved_from``); otherwise only every
``agent.phase_refresh_interval``, which keeps the record fresh for
``agent.phase_stale_after`` (a write that fails is tried again each publish
interval). A steady record costs etcd one write per refresh, delivered to one
node (the round's first member), and nothing to the cluster's other nodes.
One key per node per job: the write load grows with the nodes, not the ranks
or the steps.

``JobPeers`` is what the tracker (hangs/detector.py) decides on: the other nodes'
records of the round (or the first member's digest of them), and whether every
other member's is fresh. Only then
does a job across nodes get learned timeouts; otherwise the fixed bounds.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .timeouts import MAX_PHASES, PhaseRecord, others_wait_for
from ..logsetup import ctx
from ..fields import is_real, is_whole
from ..values import decode
from ..workers.contract import beats

log = logging.getLogger("elasticd.phases")

RECORD_MAX = 32 * 1024     # bytes of one node's record, as written and as accepted
MAX_RANKS = 512            # ranks one node's record may list
VERSION = 1


@dataclass(frozen=True)
class RankPhase:
    """One rank as its node's daemon saw it at publish time."""
    rank: int                      # global rank
    phase: str                     # the worker contract's phase name
    for_s: float                   # seconds it had been in that phase
    steps: int                     # its step counter
    step_seconds: float | None     # busy seconds per step over the straggler window


@dataclass(frozen=True)
class NodePhases:
    node_id: str
    round: int
    ranks: tuple = ()              # RankPhase
    learned: tuple = ()            # PhaseRecord: the gaps this node learned per phase

    def to_json(self) -> str:
        """The record as stored; the learned phases are cut to keep it under RECORD_MAX."""
        ranks = [[r.rank, r.phase, round(r.for_s, 3), r.steps,
                  None if r.step_seconds is None else round(r.step_seconds, 6)]
                 for r in self.ranks[:MAX_RANKS]]
        learned = [[p.phase, p.gaps, round(p.longest, 3)] for p in self.learned[:MAX_PHASES]]
        while True:
            text = json.dumps({"v": VERSION, "node": self.node_id, "round": self.round,
                               "ranks": ranks, "learned": learned}, separators=(",", ":"))
            if len(text) <= RECORD_MAX or not (learned or ranks):
                return text
            if learned:
                learned.pop()
            else:
                ranks.pop()

    def shape(self) -> tuple:
        """What wakes the writer at once when it changes: each rank's phase, the round."""
        return tuple((r.rank, r.phase) for r in self.ranks) + (self.round,)

    def moved_from(self, before: "NodePhases | None") -> bool:
        """Whether this record says something the other nodes decide on that ``before``
        (the record last written) does not: the round or a rank's phase; a rank's time
        per step by a fifth (stragglers); a learned phase, its longest gap by a tenth or
        its count of gaps past a power of two (the learned limits). Not the step counts
        nor how long a phase has lasted. Measured from what was written, so a value
        that wavers about one point is not written again and again."""
        if before is None or self.round != before.round or len(self.ranks) != len(before.ranks):
            return True
        for now, then in zip(self.ranks, before.ranks):
            if (now.rank, now.phase) != (then.rank, then.phase) \
                    or apart(now.step_seconds, then.step_seconds, 1.2):
                return True
        return learned_moved(self.learned, before.learned)

    @classmethod
    def from_doc(cls, doc: dict, node_id: str) -> "NodePhases":
        """A peer's record, decoded; ValueError for anything not exactly right."""
        if not isinstance(doc, dict) or doc.get("v") != VERSION:
            raise ValueError("phase record of an unknown version")
        if doc.get("node") != node_id:
            raise ValueError("phase record names another node")
        rnd = doc.get("round")
        ranks, learned = doc.get("ranks"), doc.get("learned")
        if not is_whole(rnd, 0, 1 << 48) or not isinstance(ranks, list) \
                or not isinstance(learned, list) or len(ranks) > MAX_RANKS \
                or len(learned) > MAX_PHASES:
            raise ValueError("phase record fields out of range")
        return cls(node_id, rnd, tuple(_rank(r) for r in ranks),
                   tuple(learned_entry(p) for p in learned))

    @classmethod
    def from_json(cls, text: str | None, node_id: str) -> "NodePhases":
        """From plain JSON (no seal): at most RECORD_MAX bytes, then ``from_doc``."""
        return cls.from_doc(decode(text, max_bytes=RECORD_MAX), node_id)


def apart(a: float | None, b: float | None, ratio: float) -> bool:
    """Whether ``a`` and ``b`` differ by ``ratio`` or more (or one of them is None or 0)."""
    if a is None or b is None or a <= 0 or b <= 0:
        return (a is None) != (b is None) or (a is not None and b is not None and a != b)
    return max(a, b) >= ratio * min(a, b)


def _rank(item) -> RankPhase:
    if not isinstance(item, list) or len(item) != 5:
        raise ValueError("rank entry is not [rank, phase, for_s, steps, step_seconds]")
    rank, phase, for_s, steps, step_s = item
    if not is_whole(rank, 0, 1 << 24) or not isinstance(phase, str) \
            or not beats.valid_phase(phase) or not is_real(for_s, 0, 1e8) \
            or not is_whole(steps, 0, 1 << 62) or not (step_s is None or is_real(step_s, 0, 1e7)):
        raise ValueError("rank entry out of range")
    return RankPhase(rank, phase, float(for_s), steps,
                     None if step_s is None else float(step_s))


def learned_moved(now: tuple, then: tuple) -> bool:
    """Whether the learned phases ``now`` differ from ``then`` enough to tell the other
    nodes: a phase more or less, its longest gap by a tenth, its count of gaps past a
    power of two."""
    if len(now) != len(then):
        return True
    return any(a.phase != b.phase or apart(a.longest, b.longest, 1.1)
               or a.gaps.bit_length() != b.gaps.bit_length() for a, b in zip(now, then))


def learned_entry(item) -> PhaseRecord:
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("learned entry is not [phase, gaps, longest]")
    phase, gaps, longest = item
    if not isinstance(phase, str) or not beats.valid_phase(phase) \
            or not is_whole(gaps, 0, 1 << 62) or not is_real(longest, 0, 1e7):
        raise ValueError("learned entry out of range")
    return PhaseRecord(phase, gaps, float(longest))


@dataclass(frozen=True)
class PeerPhases:
    """Another node's record and how old it is here (seconds since this daemon got it)."""
    record: NodePhases
    age: float


@dataclass(frozen=True)
class JobPeers:
    """The round's other nodes as the tracker sees them: their records, where this node is
    the round's first member and watches them; else the digest that member folds them
    into (hangs/phase_digest.py)."""
    records: tuple = ()       # PeerPhases of the round's other members
    complete: bool = True     # every other member of the round has a fresh record
    digest: object = None     # phase_digest.PhaseDigest, read in place of ``records``

    def learned(self):
        """What the other nodes learned, one tuple of PhaseRecord per source."""
        if self.digest is not None:
            return [self.digest.learned]
        return [peer.record.learned for peer in self.records]

    def waiting_phases(self, node_id: str) -> list[str]:
        """The phases ranks on other nodes are in that make this node's ranks wait."""
        if self.digest is not None:
            return self.digest.waiting_phases(node_id)
        return [rp.phase for peer in self.records for rp in peer.record.ranks
                if others_wait_for(rp.phase)]

    @classmethod
    def of(cls, received: dict, members: list[str], node_id: str, rnd: int,
           stale_after: float, now: float) -> "JobPeers":
        """From the view's ``{node: (NodePhases, received_at)}`` for round ``rnd``."""
        records, complete = [], True
        for node in members:
            if node == node_id:
                continue
            got = received.get(node)
            if fresh_record(got, rnd, stale_after, now) is None:
                complete = False
                continue
            records.append(PeerPhases(got[0], max(0.0, now - got[1])))
        return cls(tuple(records), complete)


def fresh_record(got: tuple | None, rnd: int, stale_after: float,
                 now: float) -> NodePhases | None:
    """The record of ``got`` ((NodePhases, time got), or None) if it is of round ``rnd``
    and no older than ``stale_after`` at ``now``; else None."""
    if got is None or got[0].round != rnd or now - got[1] > stale_after:
        return None
    return got[0]


def merge_learned(mine: dict, theirs, limit: int = MAX_PHASES) -> bool:
    """Fold a peer's learned phases into ``mine`` ({phase: PhaseRecord}) as the max of
    gaps and of the longest gap per phase; True if anything grew."""
    grew = False
    for p in theirs:
        cur = mine.get(p.phase)
        if cur is None:
            if len(mine) >= limit:
                continue
            mine[p.phase], grew = p, True
        elif p.gaps > cur.gaps or p.longest > cur.longest:
            mine[p.phase] = PhaseRecord(p.phase, max(p.gaps, cur.gaps),
                                        max(p.longest, cur.longest))
            grew = True
    return grew


class PhasePublisher:
    """Writes one job's ``NodePhases`` (or ``PhaseDigest``: anything with ``shape``,
    ``moved_from`` and ``to_json``) for this node: one owner thread, a stop event.
    ``interval``: the soonest a changed record is written again (a change of phase
    wakes it at once); ``refresh``: how often an unchanged one is (at least
    ``interval``; None: every ``interval``)."""

    def __init__(self, job_id: str, node_id: str, interval: float,
                 put: Callable[[str], None], delete: Callable[[], None],
                 refresh: float | None = None, clock=time.monotonic, name: str = "phases"):
        self.job_id, self.node_id, self.interval = job_id, node_id, interval
        self.refresh = interval if refresh is None else max(refresh, interval)
        self._put, self._delete, self._clock = put, delete, clock
        self._lock = threading.Lock()
        self._latest: NodePhases | None = None
        self._shape: tuple = ()       # (rank, phase) pairs last offered: a change wakes the loop
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-{job_id}", daemon=True)
        self.writes = 0

    @classmethod
    def for_agent(cls, job_id: str, node_id: str, settings, put: Callable[[str], None],
                  delete: Callable[[], None], name: str = "phases") -> "PhasePublisher":
        """The publisher of one job's record (or digest) on this node, at the agent's
        settings."""
        return cls(job_id, node_id, settings.phase_publish_interval, put, delete,
                   refresh=settings.phase_refresh_interval, name=name)

    def start(self) -> None:
        self._thread.start()

    def offer(self, record: NodePhases) -> None:
        shape = record.shape()
        with self._lock:
            self._latest = record
            changed, self._shape = shape != self._shape, shape
        if changed:
            self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop writing and delete this node's key (best effort: its lease ends it too)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            self._delete()
        except Exception as exc:  # etcd away: the node's lease removes the key
            log.debug("%s: phase record not deleted: %s", ctx(job=self.job_id), exc)

    def _run(self) -> None:
        written, due = None, 0.0    # the record last written, and when a refresh is due
        while not self._stop.is_set():
            self._wake.wait(self.interval if written is None
                            else min(self.interval, max(0.0, due - self._clock())))
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                record = self._latest
            if record is None:
                continue
            if not record.moved_from(written) and self._clock() < due:
                continue
            try:
                self._put(record.to_json())
                self.writes += 1
                written, due = record, self._clock() + self.refresh
            except Exception as exc:  # etcd away: try again next interval
                written, due = None, self._clock() + self.interval
                log.debug("%s: phase record not written: %s",
                          ctx(job=self.job_id, node=self.node_id), exc)
            # At most one write per tenth of the interval, however often phases change.
            self._stop.wait(self.interval / 10)
