"""The cluster rendezvous protocol: its keys and its decisions, no I/O.

Keys of one job (under the store prefix; ``R`` is a round number). The job
list, which every daemon watches (rendezvous/view.py)::

    /v1/jobs/<job>/spec              what to run (written once, at submit)
    /v1/jobs/<job>/state             a copy of the round state, its members by id
                                     alone (RoundState.listed), written after each
                                     change of it (never older than what it holds):
                                     what other nodes adopt by and answer status from

The job's rounds, which only the nodes that run it watch::

    /v1/rounds/<job>/state           the round state: one JSON record, changed only
                                     by compare-and-swap
    /v1/rounds/<job>/decider/<R>     the node that decides open round R: created by
                                     the first joined node to claim it (its lease)
    /v1/phases/<job>/<node>          its ranks' phases (hangs/phase_board.py; lease),
                                     watched only by the job's nodes (phase_watch.py)

The job's worker rows, which no node watches (read when status asks)::

    /v1/workers/<job>/rows/<node>    a node's worker rows and recovery summary
                                     (lease), rewritten after each start

The job's joins and done marks, which the node deciding its open round and its
closed round's first member watch whole, and the job's other nodes only for the
deletes of their round's joins::

    /v1/joins/<job>/round/<R>/<node> a node's wish to be in round R (its node lease)
    /v1/joins/<job>/done/<R>/<node>  a node's workers finished round R well (lease):
                                     the first member ends the job once every
                                     member's mark is there; the others end it
                                     when its state turns final

So a node's rows reach no node (N nodes publish N rows a round: watched, that
was N x N deliveries), and a join or a done mark one or two of them (N joins a
round reach O(1) nodes, not N: a node needs of the others' joins only the
closed round's first member's, read once, and their deletes, a node lost);
every node gets a job's spec once and its state copy
once per change of round.
The records (rendezvous/records.py) are sealed with the cluster key, bound
to their key (trust/sealed.py); the spec by trust/specs.py. A closed round
names its members, but the address and ports its ranks connect to come
only from its first member's own join of that round (``master_problem``).
Each node writes only its own join/done/workers keys, so the writes of a
round grow linearly with the number of nodes. The state moves

    open(R) --decider closes--> closed(R) --fault, node loss, scale-up--> open(R+1)
    any --> succeeded | failed | cancelled

The decider of an open round is the first joined node to create its
``decider/<R>`` key (under its node lease, so a dead decider hands over by
itself; a node that leaves the job deletes it). It watches every join; the
others wait for the state to close. It closes the round once max nodes joined, or min nodes joined and
``last_call`` seconds passed since; a round after a fault or a membership
change closes as soon as every node it expects joined, not waiting for a
member of the last round whose lease expired, nor, past ``rejoin_timeout``,
for one that has not rejoined. Members keep their group ranks across rounds;
newcomers take the places of members lost (a spare node takes a lost
node's ranks) and the rest come after them.

Spare nodes: a node that runs a job but is not in its closed round, which
already has its max nodes, stands by: it joins that round without ranks
(``round.py``), its worker template warm. A round opened after a fault or a
loss expects it (``RoundState.spares``), so one with a member lost closes
at once at the same world size; live members rejoining go first (a spare
takes a place only once they rejoined or ``rejoin_timeout`` passed), and
the nodes beyond max stand by again.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..jobs.restartpolicy import RestartWindow
from ..jobs.states import JobState
from ..workers.round_place import RoundPlace
from .records import (CANCELLED, CLOSED, FAILED, FINAL, OPEN, SUCCEEDED, Join, Member,
                      RoundCause, RoundState)

__all__ = ["CANCELLED", "CLOSED", "FAILED", "FINAL", "OPEN", "SUCCEEDED", "Join", "Member",
           "RoundCause", "RoundState", "JobLimits", "RoundClock", "Result", "final_job_state",
           "job_prefix", "rounds_prefix", "joins_prefix", "workers_prefix", "order_members",
           "lost_rejoiners",
           "decide_open_round",
           "reopen", "result_for", "master_problem"]

_JOB_STATE_OF_FINAL = {SUCCEEDED: JobState.SUCCEEDED, CANCELLED: JobState.CANCELLED}


def final_job_state(status: str) -> JobState:
    """The job state a final round status ends the job in on every node: succeeded
    and cancelled one to one; failed, and anything else, FAILED."""
    return _JOB_STATE_OF_FINAL.get(status, JobState.FAILED)


def job_prefix(job_id: str) -> str:
    """The job's keys in the job list (its spec, its state's copy)."""
    return f"/v1/jobs/{job_id}"


def rounds_prefix(job_id: str) -> str:
    """The job's rounds: its state and deciders."""
    return f"/v1/rounds/{job_id}"


def joins_prefix(job_id: str) -> str:
    """The job's joins and done marks: watched whole only by the node that decides its
    open round and by its closed round's first member; the others watch the deletes of
    their round's joins."""
    return f"/v1/joins/{job_id}"


def workers_prefix(job_id: str) -> str:
    """The job's worker rows: watched by no node, listed when status asks."""
    return f"/v1/workers/{job_id}"


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
    """This node's place in a closed round, and what else the round's members share."""
    place: RoundPlace       # what the workers' env is made from (workers/spec.py GroupSpec)
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


def order_members(joins: list[Join], max_nodes: int | None = None) -> tuple[Member, ...]:
    """Old members keep their order (group ranks stay stable); newcomers, by id, first
    fill the places of members gone (a spare takes a lost node's group rank, so the
    others keep theirs), then follow. With ``max_nodes``, only as many newcomers take
    places as there is room for beside the old members: an old member is never put
    behind a newcomer the round then leaves out."""
    old = sorted((j for j in joins if j.prev_rank >= 0), key=lambda j: (j.prev_rank, j.node_id))
    new = sorted((j for j in joins if j.prev_rank < 0), key=lambda j: j.node_id)
    room = len(new) if max_nodes is None else max(0, max_nodes - len(old))
    filling, rest = new[:room], new[room:]
    ordered: list[Join] = []
    while old or filling:
        # the next place goes to the next old member unless a member before it is gone
        if old and (not filling or old[0].prev_rank <= len(ordered)):
            ordered.append(old.pop(0))
        else:
            ordered.append(filling.pop(0))
    return tuple(Member(j.node_id, j.address, j.nproc, j.port, j.store_port, j.hosted)
                 for j in ordered + rest)


def lost_rejoiners(state: RoundState, joined: set, last_round: set) -> set:
    """The last round's members (and spares) this open round waits for that are gone:
    neither joined it nor hold their join key of the last round any more (it lived on
    their node lease: the lease expired, or was revoked)."""
    return {n for n in (*state.rejoining, *state.spares)
            if n not in joined and n not in last_round}


def decide_open_round(state: RoundState, joins: list[Join], limits: JobLimits,
                      clock: RoundClock, now: float,
                      last_round: set | None = None) -> tuple[RoundState | None, str]:
    """What the decider does with an open round: (new state or None, why).

    It closes once max nodes joined (but while a live member of the last round has
    not rejoined, a spare does not take its place before ``rejoin_timeout``); or
    once min joined and: every expected node still alive joined (``last_round``:
    the nodes whose join key of the last round is still there; a rejoining member
    or a spare without one is lost), or only members or spares of the last round
    are missing and ``rejoin_timeout`` passed (alive, they would have rejoined by
    now), or ``last_call`` passed."""
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
    late = bool(missing) and missing <= set(state.rejoining) | set(state.spares) \
        and waited >= limits.rejoin_timeout
    # More joined than max: members still to rejoin go before the spares that came first.
    members_due = set(state.rejoining) - lost - joined
    full = n >= limits.max_nodes and (
        not members_due or now - clock.opened_seen >= limits.rejoin_timeout)
    if full or (n >= limits.min_nodes and (everyone or late or waited >= limits.last_call)):
        members = order_members(joins, limits.max_nodes)[:limits.max_nodes]
        gone = f"; lost: {', '.join(sorted(lost))}" if lost else ""
        why = (f"round {state.round} closed with {len(members)} node(s)"
               + (" (max reached)" if n >= limits.max_nodes else
                  f" (every expected node joined{gone})" if everyone else
                  f" ({', '.join(sorted(missing))} of the last round did not rejoin within "
                  f"{limits.rejoin_timeout:g}s{gone})" if late else
                  f" after a last call of {limits.last_call:g}s"))
        took = [m.node_id for m in members if m.node_id in state.spares]
        if took:
            gone_members = sorted(set(state.rejoining) - joined)
            why += (f"; spare node(s) {', '.join(took)} in place of "
                    f"{', '.join(gone_members) or 'the members gone'}")
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
           rejoining: tuple = (), spares: tuple = ()) -> tuple[RoundState, str]:
    """The state after a fault or a membership change (``cause``) in ``state``'s round.

    ``expected``: the nodes the new round can close as soon as they joined
    (the old members still alive, plus any waiting to join, plus the spares);
    ``rejoining``: of them, the old members; ``spares``: the spare nodes that
    stood by in ``state``'s round."""
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
                      rejoining=tuple(sorted(set(rejoining) & set(expected))),
                      spares=tuple(sorted(set(spares) & set(expected) - set(rejoining)))), why


def master_problem(state: RoundState, joins: dict) -> tuple[RoundCause | None, str]:
    """Why the closed round ``state`` cannot be run on what this node sees: (the
    cause of the round to open instead, why), or (None, "") if it can. The address
    and ports its ranks connect to (MASTER_ADDR and MASTER_PORT, the job store) are
    its first member's, and they come only from that member's own join of the round
    (``joins``: {node: Join} of that round, each verified where it entered the
    daemon), which the round's copy must match. A round whose first member holds no
    join of it any more lost that node."""
    if not state.members:
        return RoundCause.FAULT, f"round {state.round} has no members"
    master = state.members[0]
    join = joins.get(master.node_id)
    if join is None:
        return RoundCause.NODE_LOST, (f"its first node {master.node_id} holds no join of "
                                      f"round {state.round}: lost")
    if join.member() != master:
        return RoundCause.FAULT, (f"its first node {master.node_id} joined round "
                                  f"{state.round} with another address or port than the "
                                  "round names")
    return None, ""


def result_for(state: RoundState, node_id: str, joins: dict) -> Result | None:
    """This node's ranks in a closed round, or None if it is not a member or the
    round cannot run (``master_problem``)."""
    ids = state.member_ids()
    if state.status != CLOSED or node_id not in ids or master_problem(state, joins)[0]:
        return None
    index = ids.index(node_id)
    master = joins[state.members[0].node_id]
    place = RoundPlace(round=state.round, group_rank=index, group_world_size=len(ids),
                       world_size=sum(m.nproc for m in state.members),
                       rank_offset=sum(m.nproc for m in state.members[:index]),
                       master_addr=master.address, master_port=master.port)
    return Result(place=place, members=tuple(ids),
                  store_addr=master.address if master.store_port else "",
                  store_port=master.store_port, state=state, master_hosted=master.hosted)
