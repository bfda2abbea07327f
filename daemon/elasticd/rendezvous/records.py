"""The rendezvous' records in etcd: a job's round state and a node's join, typed and checked.

Each is built from a decoded value in one place (``from_doc``: every field
typed and bounded, ``ValueError`` naming the first that is not) and
serialised in one place (``to_json``). Whether the value may be read at all
(sealed with the cluster key, not replayed) is decided before, where it
enters the daemon (rendezvous/view.py through trust/sealed.py); ``from_json``
is for plain JSON (tests, the torchrun adapter's own prefix) and goes through
the same decoder.

Fields an older writer left out take their defaults, and fields a newer one
added are ignored; a round state without ``cause`` is read from its reason
as the releases that kept none wrote it.
"""
from __future__ import annotations

import enum
import json
import dataclasses
from dataclasses import asdict, dataclass

from .. import fields as f
from ..values import decode

OPEN, CLOSED = "open", "closed"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
_STATUSES = frozenset({OPEN, CLOSED}) | FINAL

MAX_TIMES = 10_001          # restart times a round state may carry (control's limit + 1)
MAX_MEMBERS = 1 << 20       # control.max_nodes' own upper bound
MAX_NPROC = 1 << 20         # control.max_nproc_per_node's
MAX_ROUND = 1 << 48
MAX_REASON = 16 * 1024      # characters of a round's reason (cut when written)
_MAX_TIME = 1e11            # seconds since the epoch: year 5138
_MAX_BYTES = 1 << 20        # plain JSON read by from_json


class RoundCause(str, enum.Enum):
    """Why a round opened after the last: what the nodes that rejoin it recover from.
    Kept in the round state (``cause``), so no node reads it out of the reason text."""
    FAULT = "fault"                # a worker fault on some node (or its workers restart)
    NODE_LOST = "node_lost"        # a member node's lease expired
    NODE_WAITING = "node_waiting"  # a node waits to join the running job (scale-up)

    @property
    def membership(self) -> bool:
        """A change of the round's nodes, not a fault of its workers."""
        return self is not RoundCause.FAULT

    @classmethod
    def of_legacy_reason(cls, reason: str) -> "RoundCause":
        """The cause of a round state written by a release that kept none: its
        reasons said ``node(s) X lost`` and ``node(s) X waiting to join``."""
        if " lost" in reason:
            return cls.NODE_LOST
        if "waiting to join" in reason:
            return cls.NODE_WAITING
        return cls.FAULT


def _port(doc: dict, name: str, lo: int = 1, default: int | None = None) -> int:
    return f.whole(doc, name, lo, 65535, default)


@dataclass(frozen=True)
class Member:
    node_id: str
    address: str
    nproc: int
    port: int                      # a free port on that node, for MASTER_PORT if rank 0
    store_port: int = 0            # its job store for in-process restart (0: none)
    hosted: bool = False           # ``port`` is a round store that listens already
                                   # (jobstore/round_host.py): every rank a client

    @classmethod
    def from_doc(cls, doc) -> "Member":
        if not isinstance(doc, dict):
            raise ValueError("member: not an object")
        return cls(f.ident(doc, "node_id"), f.host(doc, "address"),
                   f.whole(doc, "nproc", 1, MAX_NPROC), _port(doc, "port"),
                   _port(doc, "store_port", 0, 0), doc.get("hosted") is True)


@dataclass(frozen=True)
class RoundState:
    round: int = 1
    status: str = OPEN
    members: tuple = ()            # Member, in group-rank order (closed rounds)
    restarts: int = 0              # faults counted against max_restarts, cluster-wide
    # unix times of the counted restarts inside the job's restart window, oldest
    # first, at most its budget + 1 (restartpolicy.RestartWindow), cluster-wide
    restart_times: tuple = ()
    expected: tuple = ()           # node ids an open round waits for before closing at once
    reason: str = ""
    opened_at: float = 0.0
    closed_at: float = 0.0
    cause: RoundCause = RoundCause.FAULT   # why this round (and the rounds it became) opened
    # Of ``expected``: the last round's members still alive when this round opened.
    # Alive, they rejoin within a fraction of a second (they see the round open, stop
    # their ranks, join); one whose last-round join key is gone since (its lease
    # expired) is lost and no longer waited for; see protocol.decide_open_round.
    rejoining: tuple = ()
    # Of ``expected``: the spare nodes that stood by beside the last round's members
    # (joined it without ranks: rendezvous/round.py); one of them takes the place of a
    # member lost meanwhile, at the same world size. Lost like a member when its join
    # key of the last round is gone.
    spares: tuple = ()
    # The members' node ids alone, in the job list's copy of a state (``listed``):
    # every daemon watches that copy, the job's own nodes read the members' addresses
    # and ports from the job's rounds (a closed state of 1,000 members is ~108 KB; its
    # ids ~10 KB). Empty in a state with its members.
    listed_ids: tuple = ()

    def to_json(self) -> str:
        data = asdict(self)
        data["cause"] = self.cause.value
        data["reason"] = self.reason[:MAX_REASON]
        data["members"] = [asdict(m) for m in self.members]
        data["restart_times"] = list(self.restart_times[-MAX_TIMES:])
        data["rejoining"] = list(self.rejoining)
        data["spares"] = list(self.spares)
        del data["listed_ids"]
        if self.listed_ids:
            data["member_ids"] = list(self.listed_ids)
        return json.dumps(data, sort_keys=True)

    def listed(self) -> "RoundState":
        """This state as the job list keeps it: its members by id alone."""
        return dataclasses.replace(self, members=(), listed_ids=tuple(self.member_ids()))

    @classmethod
    def from_doc(cls, doc: dict) -> "RoundState":
        """The round state in a decoded value; ValueError names a bad field."""
        status = doc.get("status")
        if status not in _STATUSES:
            raise ValueError("status: not a round status")
        members = tuple(map(Member.from_doc, f.items(doc, "members", MAX_MEMBERS)))
        if len({m.node_id for m in members}) != len(members):
            raise ValueError("members: a node twice")
        listed = f.idents(doc, "member_ids", MAX_MEMBERS)
        if listed and (members or len(set(listed)) != len(listed)):
            raise ValueError("member_ids: beside the members, or a node twice")
        times = f.items(doc, "restart_times", MAX_TIMES)
        if not all(f.is_real(t, 0.0, _MAX_TIME) for t in times):
            raise ValueError("restart_times: not times")
        return cls(round=f.whole(doc, "round", 0, MAX_ROUND), status=status, members=members,
                   restarts=f.whole(doc, "restarts", 0, MAX_ROUND, 0),
                   restart_times=tuple(float(t) for t in times),
                   expected=f.idents(doc, "expected", MAX_MEMBERS),
                   reason=f.text(doc, "reason", MAX_REASON, ""),
                   opened_at=f.real(doc, "opened_at", 0.0, _MAX_TIME, 0.0),
                   closed_at=f.real(doc, "closed_at", 0.0, _MAX_TIME, 0.0),
                   cause=_cause(doc), rejoining=f.idents(doc, "rejoining", MAX_MEMBERS),
                   spares=f.idents(doc, "spares", MAX_MEMBERS), listed_ids=listed)

    @classmethod
    def from_json(cls, text: str) -> "RoundState":
        """From plain JSON (no seal): BadValue or ValueError if it is not one."""
        return cls.from_doc(decode(text, max_bytes=_MAX_BYTES))

    @property
    def final(self) -> bool:
        return self.status in FINAL

    @property
    def order(self) -> tuple[int, int]:
        """Where this state lies in its job's history: every move a daemon makes goes
        up (open -> closed -> next round's open; any -> final in the same round)."""
        return self.round, (0 if self.status == OPEN else 1 if self.status == CLOSED else 2)

    def member_ids(self) -> list[str]:
        return [m.node_id for m in self.members] or list(self.listed_ids)


def _cause(doc: dict) -> RoundCause:
    if "cause" not in doc:
        return RoundCause.of_legacy_reason(str(doc.get("reason", "")))
    try:
        return RoundCause(doc["cause"])
    except (ValueError, TypeError):
        return RoundCause.FAULT   # a cause a newer release added: a fault, as before


@dataclass(frozen=True)
class Join:
    node_id: str
    address: str
    nproc: int
    port: int
    prev_rank: int = -1            # group rank in the last round this node was in
    time: float = 0.0
    store_port: int = 0            # its job store for in-process restart (0: none)
    hosted: bool = False           # ``port`` is a round store listening already

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_doc(cls, doc: dict) -> "Join":
        """The join in a decoded value; ValueError names a bad field."""
        return cls(node_id=f.ident(doc, "node_id"), address=f.host(doc, "address"),
                   nproc=f.whole(doc, "nproc", 1, MAX_NPROC), port=_port(doc, "port"),
                   prev_rank=f.whole(doc, "prev_rank", -1, MAX_MEMBERS, -1),
                   time=f.real(doc, "time", 0.0, _MAX_TIME, 0.0),
                   store_port=_port(doc, "store_port", 0, 0), hosted=doc.get("hosted") is True)

    @classmethod
    def from_json(cls, text: str) -> "Join":
        return cls.from_doc(decode(text, max_bytes=_MAX_BYTES))

    def member(self) -> Member:
        return Member(self.node_id, self.address, self.nproc, self.port, self.store_port,
                      self.hosted)
