"""One job's phase records folded into one digest by the round's first member.

Every node of a job across nodes writes its phase record (hangs/phase_board.py).
If every node watched every other's, a record would reach N nodes: N x N
deliveries per refresh for an N-node job, a million for 1,000 nodes. So only
the round's first member watches the job's records (rendezvous/phase_watch.py)
and folds them into a ``PhaseDigest``, which it writes under its own key and
every other member watches::

    /v1/phasedigests/<job>/<node>    the digest written by <node> while it is the
                                     round's first member (under its lease; deleted
                                     when it stops being one or the job ends there)

A record reaches one node and a digest N - 1: 2N deliveries per refresh.

The digest keeps what the tracker (hangs/detector.py) decides on, bounded
whatever N is: the phases that make the job's other ranks wait (a checkpoint,
a section) and which nodes hold them (two names and a count: enough for a
node to tell whether a node other than itself does); the learned gaps, merged
as the max per phase; the job's straggler (the slowest rank's busy time per
step against the median of every rank reported); and which members' records
were missing, stale or of another round there (``stale``; beyond ``MAX_STALE``
names only the count). A node's peers are complete, as with the records
themselves, only when the digest is fresh, of its round, written by the
round's first member, and names no node but itself as stale.

Built in one place (``PhaseDigest.fold``), serialised in one place
(``to_json``), read in one place (``from_doc``: where the key enters the
daemon, after trust/sealed.py verified its writer's seal); anything
malformed, naming another writer or out of range is refused there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..fields import is_ident, is_real, is_whole
from ..workers.contract import beats
from . import stragglers
from .phase_board import (
    JobPeers, apart, fresh_record, learned_entry, learned_moved, merge_learned)
from .timeouts import MAX_PHASES, others_wait_for

VERSION = 1
DIGEST_MAX = 32 * 1024      # bytes of one digest, as written and as accepted
MAX_STALE = 64              # member names a digest lists as stale (then only the count)
HOLDERS_KEPT = 2            # node names kept per waiting phase: enough to tell "not only me"
MAX_MEMBERS = 1 << 20


@dataclass(frozen=True)
class WaitingPhase:
    """A phase some ranks of the job are in that makes the others wait for them."""
    phase: str
    nodes: int                   # how many nodes have a rank in it
    holders: tuple = ()          # the first HOLDERS_KEPT of those nodes, sorted

    def held_elsewhere(self, node_id: str) -> bool:
        """Whether a node other than ``node_id`` has a rank in this phase."""
        return self.nodes > 1 or (self.nodes == 1 and self.holders != (node_id,))


@dataclass(frozen=True)
class PhaseDigest:
    node_id: str                 # the writer: the round's first member
    round: int
    members: int                 # members of the round when it was folded
    stale: tuple = ()            # member ids without a fresh record of the round (sorted)
    stale_count: int = 0         # all of them (``stale`` lists at most MAX_STALE)
    waiting: tuple = ()          # WaitingPhase, by phase
    learned: tuple = ()          # PhaseRecord, merged over the members' records
    straggler: stragglers.Straggler | None = None

    # -- built in one place ------------------------------------------------------
    @classmethod
    def fold(cls, received: dict, members: list[str], node_id: str, rnd: int,
             stale_after: float, now: float) -> "PhaseDigest":
        """The digest of ``received`` ({node: (NodePhases, time got)}, the records this
        node holds, its own among them) for round ``rnd`` of ``members``."""
        stale, fresh = [], []
        for node in members:
            rec = fresh_record(received.get(node), rnd, stale_after, now)
            if rec is None:
                stale.append(node)
            else:
                fresh.append(rec)
        holders: dict[str, list[str]] = {}
        learned: dict = {}
        times, where = {}, {}
        for rec in fresh:
            merge_learned(learned, rec.learned)
            for rp in rec.ranks:
                if others_wait_for(rp.phase):
                    nodes = holders.setdefault(rp.phase, [])
                    if not nodes or nodes[-1] != rec.node_id:
                        nodes.append(rec.node_id)
                if rp.rank not in times:
                    times[rp.rank], where[rp.rank] = rp.step_seconds, rec.node_id
        waiting = tuple(WaitingPhase(p, len(n), tuple(sorted(n)[:HOLDERS_KEPT]))
                        for p, n in sorted(holders.items())[:MAX_PHASES])
        stale.sort()
        return cls(node_id, rnd, len(members), tuple(stale[:MAX_STALE]), len(stale), waiting,
                   tuple(learned[p] for p in sorted(learned)),
                   stragglers.find_straggler(times, where))

    # -- what a member decides on --------------------------------------------------
    def peers(self, members: list[str], node_id: str, rnd: int, age: float,
              stale_after: float) -> JobPeers:
        """What node ``node_id`` of round ``rnd`` of ``members`` decides on, this digest
        being ``age`` seconds old here."""
        if self.round != rnd or age > stale_after:
            return JobPeers(complete=False)
        complete = (bool(members) and self.node_id == members[0]
                    and self.members == len(members) and self.stale_count == len(self.stale)
                    and all(node == node_id for node in self.stale))
        return JobPeers(complete=complete, digest=self)

    def waiting_phases(self, node_id: str) -> list[str]:
        return [w.phase for w in self.waiting if w.held_elsewhere(node_id)]

    # -- when to write it again --------------------------------------------------------
    def shape(self) -> tuple:
        """What wakes the writer at once when it changes."""
        return (self.round, self.members, self.stale, self.stale_count,
                tuple((w.phase, w.nodes > 1, w.holders) for w in self.waiting),
                None if self.straggler is None else self.straggler.rank)

    def moved_from(self, before: "PhaseDigest | None") -> bool:
        """Whether this digest says something the members decide on that ``before`` (the
        digest last written) does not: its shape; a learned phase as
        ``NodePhases.moved_from`` counts it; the straggler's ratio by a fifth."""
        if before is None or self.shape() != before.shape() \
                or learned_moved(self.learned, before.learned):
            return True
        if self.straggler is not None and before.straggler is not None:
            return apart(self.straggler.ratio, before.straggler.ratio, 1.2)
        return False

    # -- serialised in one place -----------------------------------------------------
    def to_json(self) -> str:
        s = self.straggler
        doc = {"v": VERSION, "node": self.node_id, "round": self.round,
               "members": self.members, "stale": list(self.stale),
               "stale_count": self.stale_count,
               "waiting": [[w.phase, w.nodes, list(w.holders)] for w in self.waiting],
               "learned": [[p.phase, p.gaps, round(p.longest, 3)] for p in self.learned],
               "straggler": None if s is None else
               [s.rank, round(s.ratio, 3), round(s.step_seconds, 6),
                round(s.median_step_seconds, 6), s.ranks, s.nodes, s.rank_node]}
        text = json.dumps(doc, separators=(",", ":"))
        if len(text) > DIGEST_MAX:   # not reachable within the bounds above; never silent
            raise ValueError(f"a phase digest holds at most {DIGEST_MAX} bytes")
        return text

    # -- read in one place ---------------------------------------------------------------
    @classmethod
    def from_doc(cls, doc: dict, node_id: str) -> "PhaseDigest":
        """A digest written by ``node_id``, decoded; ValueError for anything not exactly right."""
        if not isinstance(doc, dict) or doc.get("v") != VERSION:
            raise ValueError("phase digest of an unknown version")
        if doc.get("node") != node_id:
            raise ValueError("phase digest names another writer")
        rnd, members, stale = doc.get("round"), doc.get("members"), doc.get("stale")
        count, waiting, learned = doc.get("stale_count"), doc.get("waiting"), doc.get("learned")
        if not is_whole(rnd, 0, 1 << 48) or not is_whole(members, 1, MAX_MEMBERS) \
                or not isinstance(stale, list) or len(stale) > MAX_STALE \
                or not all(is_ident(n) for n in stale) or not is_whole(count, len(stale), members) \
                or not isinstance(waiting, list) or len(waiting) > MAX_PHASES \
                or not isinstance(learned, list) or len(learned) > MAX_PHASES:
            raise ValueError("phase digest fields out of range")
        return cls(node_id, rnd, members, tuple(stale), count,
                   tuple(_waiting(w, members) for w in waiting),
                   tuple(learned_entry(p) for p in learned), _straggler(doc.get("straggler")))


def _waiting(item, members: int) -> WaitingPhase:
    if not isinstance(item, list) or len(item) != 3:
        raise ValueError("waiting entry is not [phase, nodes, holders]")
    phase, nodes, holders = item
    if not isinstance(phase, str) or not beats.valid_phase(phase) \
            or not others_wait_for(phase) or not is_whole(nodes, 1, members) \
            or not isinstance(holders, list) or not 0 < len(holders) <= min(nodes, HOLDERS_KEPT) \
            or not all(is_ident(n) for n in holders):
        raise ValueError("waiting entry out of range")
    return WaitingPhase(phase, nodes, tuple(holders))


def _straggler(item) -> stragglers.Straggler | None:
    if item is None:
        return None
    if not isinstance(item, list) or len(item) != 7:
        raise ValueError("straggler is not [rank, ratio, step_s, median_s, ranks, nodes, node]")
    rank, ratio, step_s, median_s, ranks, nodes, node = item
    if not is_whole(rank, 0, 1 << 24) or not is_real(ratio, 0, 1e6) \
            or not is_real(step_s, 0, 1e7) or not is_real(median_s, 0, 1e7) \
            or not is_whole(ranks, 2, 1 << 30) or not is_whole(nodes, 1, MAX_MEMBERS) \
            or not (node == "" or is_ident(node)):
        raise ValueError("straggler out of range")
    return stragglers.Straggler(rank, float(ratio), float(step_s), float(median_s), ranks,
                                nodes, node)


def holds_records(members, node_id: str) -> bool:
    """Whether ``node_id`` is the member that watches the round's records and writes its
    digest (the round's first member); the others watch that digest only."""
    return bool(members) and members[0] == node_id

