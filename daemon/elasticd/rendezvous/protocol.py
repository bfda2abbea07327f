"""The cluster rendezvous protocol: its records and its decisions, no I/O.

Keys of one job (under the store prefix; ``R`` is a round number)::

    /v1/jobs/<job>/spec              what to run (written once, at submit)
    /v1/jobs/<job>/state             the round state: one JSON record, changed only
                                     by compare-and-swap
    /v1/jobs/<job>/join/<R>/<node>   a node's wish to be in round R (its node lease)
    /v1/jobs/<job>/done/<R>/<node>   a node's workers finished round R well (lease)
    /v1/jobs/<job>/workers/<node>    a node's worker rows and recovery summary, for
                                     status on any node (lease)

Each node writes only its own join/done/workers keys, so the writes of a
round grow linearly with the number of nodes. The state moves

    open(R) --decider closes--> closed(R) --fault, node loss, scale-up--> open(R+1)
    any --> succeeded | failed | cancelled

The decider of an open round is the joined node with the smallest id (its
join key lives only while its lease does, so a dead decider hands over by
itself). It closes the round once max nodes joined, or min nodes joined and
``last_call`` seconds passed since; a round after a fault or a membership
change closes as soon as every node it expects joined, not waiting for a
member of the last round whose lease expired, nor, past ``rejoin_timeout``,
for one that has not rejoined. Members keep their group ranks across rounds
and newcomers come after them.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields, replace

from ..agent.restartpolicy import RestartWindow
from ..jobs.states import JobState

OPEN, CLOSED = "open", "closed"
SUCCEEDED, FAILED, CANCELLED = "succeeded", "failed", "cancelled"
FINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
_JOB_STATE_OF_FINAL = {SUCCEEDED: JobState.SUCCEEDED, CANCELLED: JobState.CANCELLED}
_MAX_TIMES = 10_001    # restart times a round state may carry (control's limit + 1)


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


def final_job_state(status: str) -> JobState:
    """The job state a final round status ends the job in on every node: succeeded
    and cancelled one to one; failed, and anything else, FAILED."""
    return _JOB_STATE_OF_FINAL.get(status, JobState.FAILED)


def job_prefix(job_id: str) -> str:
    return f"/v1/jobs/{job_id}"


@dataclass(frozen=True)
class Member:
    node_id: str
    address: str
    nproc: int
    port: int                      # a free port on that node, for MASTER_PORT if rank 0
    store_port: int = 0            # its job store for in-process restart (0: none)
    hosted: bool = False           # ``port`` is a round store that listens already
                                   # (jobstore/round_host.py): every rank a client


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
    # expired) is lost and no longer waited for; see decide_open_round.
    rejoining: tuple = ()

    def to_json(self) -> str:
        data = asdict(self)
        data["cause"] = self.cause.value
        data["members"] = [asdict(m) for m in self.members]
        data["restart_times"] = list(self.restart_times)
        data["rejoining"] = list(self.rejoining)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RoundState":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("round state is not an object")
        # Fields a newer release added are left out (a rolling upgrade mixes them).
        members = tuple(Member(**{**{k: v for k, v in m.items() if k in _MEMBER_FIELDS},
                                  "hosted": m.get("hosted") is True})
                        for m in data.get("members", ()))
        state = cls(round=int(data["round"]), status=str(data["status"]), members=members,
                    restarts=int(data.get("restarts", 0)),
                    restart_times=tuple(float(t) for t in
                                        (data.get("restart_times") or ())[:_MAX_TIMES]),
                    expected=tuple(str(n) for n in data.get("expected", ())),
                    reason=str(data.get("reason", "")),
                    opened_at=float(data.get("opened_at", 0.0)),
                    closed_at=float(data.get("closed_at", 0.0)),
                    cause=_cause(data),
                    rejoining=tuple(str(n) for n in data.get("rejoining", ())))
        if state.status not in (OPEN, CLOSED) and state.status not in FINAL:
            raise ValueError(f"unknown round status {state.status!r}")
        return state

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def member_ids(self) -> list[str]:
        return [m.node_id for m in self.members]


_MEMBER_FIELDS = frozenset(f.name for f in fields(Member))


def _cause(data: dict) -> RoundCause:
    if "cause" not in data:
        return RoundCause.of_legacy_reason(str(data.get("reason", "")))
    try:
        return RoundCause(data["cause"])
    except ValueError:
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
    def from_json(cls, text: str) -> "Join":
        data = json.loads(text)
        return cls(node_id=str(data["node_id"]), address=str(data["address"]),
                   nproc=int(data["nproc"]), port=int(data["port"]),
                   prev_rank=int(data.get("prev_rank", -1)), time=float(data.get("time", 0.0)),
                   store_port=int(data.get("store_port", 0)),
                   hosted=data.get("hosted") is True)


@dataclass(frozen=True)
class JobLimits:
    min_nodes: int
    max_nodes: int
    max_restarts: int
    last_call: float               # seconds to wait for more nodes once min joined
    join_timeout: float            # seconds an open round may stay below min
    max_restarts_in_window: int = -1   # restarts within restart_window (-1: no such budget)
    restart_window: float = 3600.0
    # seconds, once min joined, an open round waits for the last round's members that
    # have not rejoined (RoundState.rejoining); inf: last_call alone
    rejoin_timeout: float = float("inf")

    @property
    def window(self) -> RestartWindow:
        return RestartWindow(self.max_restarts_in_window, self.restart_window)


@dataclass
class RoundClock:
    """What the decider saw of an open round, on its own clock."""
    round: int = 0
    opened_seen: float = 0.0
    min_reached: float = 0.0


@dataclass(frozen=True)
class Result:
    """This node's place in a closed round: plain data for the worker env."""
    round: int
    group_rank: int
    group_world_size: int
    world_size: int
    rank_offset: int
    master_addr: str
    master_port: int
    members: tuple = field(default=())
    # The job store every rank of the round shares for in-process restart: the
    # first member's (it hosts rank 0's MASTER_PORT too); empty if it has none.
    store_addr: str = ""
    store_port: int = 0
    # The closed round's state this result was read from (restarts, restart times).
    state: "RoundState | None" = field(default=None, compare=False, repr=False)
    # master_port is the first member's round store, listening before any rank
    # started (jobstore/round_host.py): every rank connects to it as a client.
    master_hosted: bool = False


def order_members(joins: list[Join]) -> tuple[Member, ...]:
    """Old members keep their order (group ranks stay stable); newcomers follow by id."""
    old = sorted((j for j in joins if j.prev_rank >= 0), key=lambda j: (j.prev_rank, j.node_id))
    new = sorted((j for j in joins if j.prev_rank < 0), key=lambda j: j.node_id)
    return tuple(Member(j.node_id, j.address, j.nproc, j.port, j.store_port, j.hosted)
                 for j in old + new)


def decider(joins: list[Join]) -> str | None:
    return min((j.node_id for j in joins), default=None)


def lost_rejoiners(state: RoundState, joined: set, last_round: set) -> set:
    """The last round's members this open round waits for that are gone: neither
    joined it nor hold their join key of the last round any more (it lived on their
    node lease: the lease expired, or was revoked)."""
    return {n for n in state.rejoining if n not in joined and n not in last_round}


def decide_open_round(state: RoundState, joins: list[Join], limits: JobLimits,
                      clock: RoundClock, now: float,
                      last_round: set | None = None) -> tuple[RoundState | None, str]:
    """What the decider does with an open round: (new state or None, why).

    It closes once max nodes joined; or once min joined and: every expected node
    still alive joined (``last_round``: the nodes whose join key of the last round
    is still there; a rejoining member without one is lost), or only members of
    the last round are missing and ``rejoin_timeout`` passed (alive, they would
    have rejoined by now), or ``last_call`` passed."""
    if clock.round != state.round:
        clock.round, clock.opened_seen, clock.min_reached = state.round, now, 0.0
    n = len(joins)
    if n >= limits.min_nodes and not clock.min_reached:
        clock.min_reached = now
    joined = {j.node_id for j in joins}
    lost = lost_rejoiners(state, joined, last_round) if last_round is not None else set()
    missing = set(state.expected) - lost - joined
    everyone = bool(state.expected) and not missing
    waited = now - clock.min_reached
    late = bool(missing) and missing <= set(state.rejoining) \
        and waited >= limits.rejoin_timeout
    if n >= limits.max_nodes or (n >= limits.min_nodes and (
            everyone or late or waited >= limits.last_call)):
        members = order_members(joins)[:limits.max_nodes]
        gone = f"; lost: {', '.join(sorted(lost))}" if lost else ""
        why = (f"round {state.round} closed with {len(members)} node(s)"
               + (" (max reached)" if n >= limits.max_nodes else
                  f" (every expected node joined{gone})" if everyone else
                  f" ({', '.join(sorted(missing))} of the last round did not rejoin within "
                  f"{limits.rejoin_timeout:g}s{gone})" if late else
                  f" after a last call of {limits.last_call:g}s"))
        return replace(state, status=CLOSED, members=members, closed_at=now, reason=why), why
    if n < limits.min_nodes and now - clock.opened_seen >= limits.join_timeout:
        joined = sorted(j.node_id for j in joins)
        missing = sorted(set(state.expected) - set(joined))
        why = (f"only {n} of the {limits.min_nodes} nodes the job needs joined round "
               f"{state.round} within {limits.join_timeout:g}s (joined: "
               f"{', '.join(joined) or 'none'}"
               + (f"; missing: {', '.join(missing)}" if missing else "") + ")")
        return replace(state, status=FAILED, reason=why), why
    return None, f"round {state.round}: {n} node(s) joined, waiting"


def reopen(state: RoundState, reason: str, count_restart: bool, limits: JobLimits,
           now: float, expected: tuple = (),
           cause: RoundCause = RoundCause.FAULT,
           rejoining: tuple = ()) -> tuple[RoundState, str]:
    """The state after a fault or a membership change (``cause``) in ``state``'s round.

    ``expected``: the nodes the new round can close as soon as they joined
    (the old members still alive, plus any waiting to join); ``rejoining``: of
    them, the old members."""
    restarts = state.restarts + (1 if count_restart else 0)
    times = limits.window.recent(state.restart_times, now)
    if count_restart and 0 <= limits.max_restarts < restarts:
        why = f"{reason}; no restarts left ({state.restarts} of {limits.max_restarts} used)"
        return replace(state, status=FAILED, reason=why), why
    if count_restart:
        fits, times = limits.window.admit(times, now)
        if not fits:
            why = (f"{reason}; no restarts left in the window "
                   f"({limits.window.describe(len(times) - 1)})")
            return replace(state, status=FAILED, reason=why), why
    allowed = "unlimited" if limits.max_restarts < 0 else str(limits.max_restarts)
    why = (f"{reason}; round {state.round + 1} opened"
           + (f" (restart {restarts} of {allowed}; {limits.window.describe(len(times))})"
              if count_restart else ""))
    return RoundState(round=state.round + 1, status=OPEN, restarts=restarts, reason=why,
                      expected=tuple(sorted(expected)), opened_at=now,
                      restart_times=times, cause=cause,
                      rejoining=tuple(sorted(set(rejoining) & set(expected)))), why


def result_for(state: RoundState, node_id: str) -> Result | None:
    """This node's ranks in a closed round, or None if it is not a member."""
    ids = state.member_ids()
    if state.status != CLOSED or node_id not in ids:
        return None
    index = ids.index(node_id)
    master = state.members[0]
    return Result(round=state.round, group_rank=index, group_world_size=len(ids),
                  world_size=sum(m.nproc for m in state.members),
                  rank_offset=sum(m.nproc for m in state.members[:index]),
                  master_addr=master.address, master_port=master.port,
                  members=tuple(ids), store_addr=master.address if master.store_port else "",
                  store_port=master.store_port, state=state, master_hosted=master.hosted)
