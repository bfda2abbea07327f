"""One node's part in the rounds of one job (see protocol.py for the keys).

``ClusterRendezvous`` is used by the job's agent thread: ``next_round``
blocks until a round that includes this node is closed (joining, and
closing it when this node is the decider); ``reopen`` asks for a new round
after a fault; ``status`` tells the agent, each monitor tick, whether its
round still stands. Every write is this node's own key, or a
compare-and-swap of the state, sealed as the view reads it (``view.records``:
trust/sealed.py, bound to the key name), then the job list's copy of the state
(``_list_copy``: what other nodes adopt by and answer status from). It follows
the job's rounds in the view from its making until ``close``. A closed round runs only if its
first member's own join of it vouches for the address and ports its ranks
connect to (``protocol.master_problem``); otherwise this node asks for the
next round instead.

It sets how the view watches the job's joins (``_joins_wanted``): all of them
while this node decides the open round (it claimed ``decider/<R>``, ``_decides``)
or is the closed round's first member (which sees a newcomer wait: scale-up);
otherwise the deletes of the round's joins only (a member lost), the first
member's join read once a round (``_round_joins``), and every join read at a
fault before it opens the next round (``_reopen_round``: who stands, stands by
and waits).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Callable

from ..logsetup import ctx
from ..jobs.records import WorkerRow
from ..jobs.summary import RecoverySummary
from ..store import CompareFailed, KeyExists, Lease, Store, StoreError, StoreUnavailable
from ..trust.sealed import Kind
from .ports import free_port
from .protocol import (
    CLOSED, FINAL, OPEN, Join, JobLimits, Result, RoundCause, RoundClock, RoundState,
    decide_open_round, job_prefix, joins_prefix, master_problem, reopen, result_for,
    rounds_prefix, workers_prefix)
from .status import CURRENT, RoundStatus, StatusKind
from .view import JobsView

log = logging.getLogger("elasticd.rendezvous")


class RoundFinal(Exception):
    """The job is over cluster-wide (succeeded, failed or cancelled)."""

    def __init__(self, state: RoundState):
        super().__init__(state.reason or state.status)
        self.state = state


class RendezvousStopped(Exception):
    """The caller asked to stop waiting (cancel, daemon shutdown)."""


class ClusterRendezvous:
    def __init__(self, store: Store, view: JobsView, job_id: str, node_id: str, address: str,
                 nproc: int, lease: Callable[[], Lease | None], limits: JobLimits,
                 scale_up: str = "immediate", poll: float = 0.5, clock=time.time,
                 port: Callable[[], int] = free_port, probe=None, sync_timeout: float = 10.0,
                 joins_everywhere: bool = False, done_recheck: float = 5.0,
                 ran_before: int = 0):
        """``ran_before``: the last round this node ran the job's ranks in under an
        earlier rendezvous (a daemon before a restart: the job record's round; 0:
        none), never returned again."""
        self._store = store
        self._view = view
        self._records = view.records    # seals what we write as the view opens it
        self.job_id = job_id
        self.node_id = node_id
        self._address = address
        self._nproc = nproc
        self._lease = lease
        self.limits = limits
        self._scale_up = scale_up
        self._poll = poll
        self._sync_timeout = sync_timeout    # for the view's first list of the job's rounds
        self._clock = clock
        self._port = port
        self._prefix = rounds_prefix(job_id)
        self._joins = joins_prefix(job_id)
        self._rows_key = f"{workers_prefix(job_id)}/rows/{node_id}"
        # Watch every join of the job whatever this node's part (the torchrun adapter:
        # torch asks every agent how many nodes wait); else only where the part needs.
        self._joins_everywhere = joins_everywhere
        self._copy_key = f"{job_prefix(job_id)}/state"
        # A member that watches no done mark reads them after this long at the barrier.
        self._done_recheck = done_recheck
        self._done_since: tuple[int, float] = (0, 0.0)   # (round, when we marked it done)
        self._round_clock = RoundClock()
        # Whether a late member's daemon is gone though its lease lives (the decider
        # asks; cluster/daemon_probe.py's DaemonProbe, or None: never asked).
        self._probe = probe
        self._probed: tuple[int, set] = (0, set())   # (round, the nodes said gone in it)
        self._joined: dict[int, tuple] = {}   # round -> (revision, lease id) of our join put
        self._claimed: dict[int, int] = {}    # round -> revision of our claim to decide it
        self._denied: dict[int, int] = {}     # round -> revision of another's claim, found
        self._master: tuple = (0, None)       # (round, its first member's Join as read)
        self._written = 0                    # revision of our last state write
        self.prev_rank = -1
        # The last round next_round returned, and a new round we asked for that
        # may not have reached etcd: a round is never run twice (see next_round).
        self._ran: Result | None = None
        self._ran_before = ran_before
        # reopen's (reason, count_restart, cause)
        self._wanted: tuple[str, bool, RoundCause] | None = None
        # This node's job store for in-process restart (the agent starts it before
        # joining; 0: none), as next_round was last given it. The round's first
        # member's is the one its ranks share.
        self._store_port = 0
        # Asked, while this node is not in the job's running round, before it says it
        # waits to join (which makes every member restart to let it in), or joins a
        # round opened after a fault that does not expect it: True once it can start
        # its ranks warm (the agent's newcomer warm-up). Called on the agent's thread,
        # from next_round.
        self.ready_to_join: Callable[[RoundState], bool] = lambda state: True
        # A new round store's port on this node (jobstore/round_host.py), asked at each
        # join: offered as MASTER_PORT, listening before any rank starts; 0: none, a
        # plain free port is offered (rank 0 hosts the store). On the agent's thread.
        self.hosted_port: Callable[[], int] = lambda: 0
        # Asked before this node stands by as a spare of a closed round at its max nodes
        # (False: a quarantined or draining node, which takes no ranks: it withdraws);
        # told once per round it stands by in (the agent's event, its metrics). Both
        # on the agent's thread, from next_round.
        self.may_stand_by: Callable[[], bool] = lambda: True
        self.on_standby: Callable[[RoundState], None] = lambda state: None
        self.standing_by = 0                 # the round this node stands by in (0: none)
        self.was_spare = False               # the last round next_round returned took it
                                             # from standing by
        self._listening: list = []
        self._copy_checked: tuple = ()       # the state whose copy status() looked at
        view.follow(job_id)                  # the job's rounds, until close()

    def close(self) -> None:
        """No more of this job here: stop listening and following its rounds, and give up
        a claim to decide a round (another node takes it)."""
        for fn in self._listening:
            self._view.unlisten(self.job_id, fn)
        self._listening = []
        self._release_claims(None)
        self._view.let_go_joins(self.job_id, self)
        self._view.unfollow(self.job_id)

    @property
    def address(self) -> str:
        """The address peers reach this node's workers (and job store) at."""
        return self._address

    # -- keys --------------------------------------------------------------------
    def _key(self, *parts) -> str:
        return "/".join((self._prefix, *map(str, parts)))

    def _join_key(self, rnd: int, node: str | None = None) -> str:
        return f"{self._joins}/round/{rnd}/{node or self.node_id}"

    def _where(self, rnd: int | None = None) -> str:
        return ctx(job=self.job_id, node=self.node_id, round=rnd)

    def _put(self, kind: Kind, key: str, body: str, lease: Lease | None) -> int:
        return self._store.put(key, self._records.seal(kind, key, body), lease=lease)

    def _cas_state(self, new: RoundState, revision: int) -> bool:
        key = self._key("state")
        try:
            self._written = max(self._written, self._store.compare_and_swap(
                key, self._records.seal(Kind.STATE, key, new.to_json()), revision))
        except CompareFailed:
            return False
        self._list_copy(new)
        return True

    def _list_copy(self, state: RoundState) -> None:
        """The job list's copy of ``state`` (``/v1/jobs/<job>/state``), unless the copy
        there is as new; best effort: a first member whose view shows an older copy
        writes it again (``status``)."""
        key = self._copy_key
        sealed = self._records.seal(Kind.STATE, key, state.listed().to_json())
        try:
            for _ in range(3):
                kv = self._store.get(key)
                if kv is None:
                    try:
                        self._store.create(key, sealed)
                        return
                    except KeyExists:
                        continue
                try:
                    held = RoundState.from_doc(self._records.open(Kind.STATE, key,
                                                                  kv.value).doc)
                    if held.order >= state.order:
                        return
                except Exception:     # not a verified state: ours replaces it
                    pass
                try:
                    self._store.compare_and_swap(key, sealed, kv.revision)
                    return
                except CompareFailed:
                    continue
        except StoreError as exc:
            log.debug("%s: the job list's copy of round %d %s not written: %s",
                      self._where(state.round), state.round, state.status, exc)

    def _rounds_read(self) -> None:
        """Wait, up to ``sync_timeout``, for the view to list the job's rounds (a node
        that does not run the job has just begun to follow them); StoreUnavailable if
        it has not by then."""
        deadline = time.monotonic() + self._sync_timeout
        while True:
            seen = self._view.revision
            if self._view.caught_up(self.job_id, 0):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreUnavailable(f"the rounds of job {self.job_id} were not read from "
                                       f"etcd within {self._sync_timeout:g}s")
            self._view.wait(min(left, self._poll), seen)

    def _view_behind(self) -> bool:
        """Our last write is not in the view yet: deciding now would act on old news."""
        return not self._view.caught_up(self.job_id, self._written)

    def final_state(self) -> RoundState | None:
        """The job's round state if it ended (as the view last saw it), else None."""
        keys = self._view.job(self.job_id)
        state = keys.state if keys else None
        return state if state is not None and state.final else None

    def peers(self) -> frozenset:
        """The job's other nodes, as the view last saw them: its round's members, the
        nodes the round waits for and those that joined it."""
        # Fresh: the joins are read now where this node watches their deletes only (a
        # quarantined node asks, before a round; no I/O where it watches them all).
        keys = self._view.job(self.job_id, fresh=True)
        state = keys.state if keys else None
        if state is None:
            return frozenset()
        nodes = set(state.member_ids()) | set(state.expected) | set(keys.joins.get(state.round, {}))
        return frozenset(nodes - {self.node_id})

    def on_change(self, fn, listen: bool = True) -> None:
        """Call ``fn()`` (a wake-up, nothing more) whenever the job's keys change; with
        ``listen`` False, no more."""
        if listen:
            self._listening.append(fn)
            self._view.listen(self.job_id, fn)
        else:
            if fn in self._listening:
                self._listening.remove(fn)
            self._view.unlisten(self.job_id, fn)

    # -- joining -----------------------------------------------------------------
    def next_round(self, stop: threading.Event, store_port: int = 0) -> Result:
        """Join rounds until one that includes this node closes; its result.
        ``store_port``: this node's job store for in-process restart (0: none),
        offered in its joins."""
        self._store_port = store_port
        while True:
            if stop.is_set():
                raise RendezvousStopped()
            seen = self._view.revision
            keys = self._view.job(self.job_id)
            state = keys.state if keys else None
            if state is None:
                if keys is not None and (keys.state_revision or self._state_missing(keys)):
                    self._replace_unreadable_state(keys.state_revision)
                self._view.wait(self._poll, seen)
                continue
            if state.final:
                raise RoundFinal(state)
            if state.status == OPEN:
                if state.expected and self.node_id not in state.expected \
                        and not self.ready_to_join(state):
                    # A round after a fault that does not wait for us (we were not in
                    # the last one): joining it cold would stall its members.
                    self._view.wait(self._poll, seen)
                    continue
                self._join(state.round)
                self._view.watch_joins(self.job_id, self._joins_wanted(state, keys), self)
                if self._decides(state, keys) and keys.joins_all and not self._view_behind() \
                        and self._view.joins_caught_up(self.job_id,
                                                       self._joined[state.round][0]):
                    joins = list(keys.joins.get(state.round, {}).values())
                    last = set(keys.joins.get(state.round - 1, {}))
                    last -= self._gone(state, keys, {j.node_id for j in joins}, last)
                    new, why = decide_open_round(state, joins, self.limits, self._round_clock,
                                                 self._clock(), last)
                    if new is not None and self._cas_state(new, keys.state_revision):
                        log.info("%s: %s", self._where(state.round), why)
                    elif new is None and self._probe is not None and self._probe.pending():
                        self._view.wait(self._probe.look, seen)   # its answer, soon
                        continue
            elif state.status == CLOSED:
                self._view.watch_joins(self.job_id, self._joins_wanted(state, keys), self)
                if not self._view.joins_caught_up(self.job_id):
                    self._view.wait(self._poll, seen)   # its first list, or its start
                    continue
                joins = self._round_joins(state, keys)
                cause, problem = master_problem(state, joins) \
                    if self.node_id in state.member_ids() else (None, "")
                if cause is not None and (self._ran is None
                                          or state.round > self._ran.place.round):
                    # Never connect where no member's own join vouches for: the round
                    # cannot run, and the next one forms from the joins there are.
                    self._reopen_round(state.round, f"round {state.round} cannot run: "
                                       f"{problem}", False, cause)
                    self._view.wait(self._poll, seen)
                    continue
                result = result_for(state, self.node_id, joins)
                if result is not None and state.round <= self._last_ran():
                    # The view still shows a round we already ran: our ask for the next
                    # one has not got through (etcd unreachable) or the view lags it; or
                    # this daemon restarted within its old lease, whose join still
                    # vouches for the round its ranks died in until the members see it
                    # lost. Running it again would start a stale rank beside the round
                    # the others may have formed meanwhile: ask again, then wait.
                    if self._wanted is not None and self._ran is not None:
                        self.reopen(self._ran, *self._wanted)
                    self._view.wait(self._poll, seen)
                    continue
                if result is not None:
                    if self._probe is not None:
                        self._probe.forget()        # nothing left open while it runs
                    self._ran, self._wanted = result, None
                    self.prev_rank = result.place.group_rank
                    self._forget_old_joins(state.round)
                    self.was_spare, self.standing_by = bool(self.standing_by), 0
                    return result
                if self.node_id not in state.member_ids():
                    self._not_a_member(state)
                elif len(state.members) < self.limits.max_nodes \
                        and self.ready_to_join(state):
                    self._join(state.round + 1)
            self._view.wait(self._poll, seen)

    def _last_ran(self) -> int:
        """The last round this node ran (here, or before the daemon restarted); 0: none."""
        return max(self._ran.place.round if self._ran is not None else 0, self._ran_before)

    def _gone(self, state: RoundState, keys, joined: set, last: set) -> set:
        """The nodes the open round waits for whose daemon is gone, though their lease
        (and their join of the last round under it) lives: their host refused a
        connection to the daemon's port (cluster/daemon_probe.py). The round then waits
        for them no more than for a node whose lease expired."""
        if self._probe is None:
            return set()
        if self._probed[0] != state.round:
            self._probe.forget()
            self._probed = (state.round, set())
        before = keys.joins.get(state.round - 1, {})
        gone = {n for n in (*state.rejoining, *state.spares)
                if n in last and n not in joined and n in before
                and self._probe.gone(n, before[n].address)}
        said = self._probed[1]
        for node in sorted(gone - said):
            log.info("%s: node %s's daemon is gone (its host refused a connection to the "
                     "daemon's port; its lease has not expired yet): not waiting for it to "
                     "rejoin", self._where(state.round), node)
        said |= gone
        return gone

    def _not_a_member(self, state: RoundState) -> None:
        """This node runs the job but is not in its closed round: below max nodes it asks
        to join (once warm: the members restart to let it in); at max it stands by as a
        spare, its join of that round holding no ranks (see protocol.py)."""
        self.prev_rank = -1   # its old group rank belongs to others now
        if len(state.members) < self.limits.max_nodes:
            if self.ready_to_join(state):
                self._join(state.round + 1)     # waiting: the members see us
            return
        self.ready_to_join(state)               # warms its ranks-to-be meanwhile
        if not self.may_stand_by():
            self._withdraw(state.round)
            return
        self._join(state.round)
        self._forget_old_joins(state.round)
        if self.standing_by != state.round:
            self.standing_by = state.round
            self.on_standby(state)

    def _withdraw(self, rnd: int) -> None:
        if self.standing_by == rnd or rnd in self._joined:
            try:
                self._store.delete(self._join_key(rnd))
            except Exception as exc:  # the lease removes it anyway
                log.debug("could not withdraw a spare's join: %s", exc)
            self._joined.pop(rnd, None)
            self.standing_by = 0

    def _state_missing(self, keys) -> bool:
        """The job is listed with a state (its copy, verified or not) but its rounds,
        listed here, hold none: an older elasticd kept the state in the job list. (A job
        being made has no copy yet: create_job writes it after the rounds' state.)"""
        return keys.spec is not None and self._view.caught_up(self.job_id, 0) \
            and self._view.listed_state(self.job_id)[1] > 0

    def _replace_unreadable_state(self, revision: int) -> None:
        """The job's state key holds a value this daemon refused and it holds no verified
        state (an older elasticd's unsigned one after an upgrade, or garbage met by a
        daemon that just started), or (``revision`` 0) the job is listed but its rounds
        hold no state (an older elasticd kept it in the job list): open a new round over
        it, sealed, so the job goes on; unless the list's copy says the job ended.
        Daemons that hold a later verified round ignore this one; they then see this
        node lost from their round and open the next, which every node takes."""
        listed, _ = self._view.listed_state(self.job_id)
        if not revision and listed is not None and listed.final:
            raise RoundFinal(listed)
        rnd = max(self._ran.place.round if self._ran is not None else 0,
                  listed.round if listed is not None else 0) + 1
        new = RoundState(round=rnd, status=OPEN, opened_at=self._clock(),
                         reason=f"round {rnd} opened: the job's round state in etcd did "
                                "not verify (written by an older elasticd, or by someone "
                                "without the cluster key)")
        if self._cas_state(new, revision):
            log.warning("%s: %s", self._where(rnd), new.reason)

    def _join(self, rnd: int) -> None:
        """Write our join key for a round once; again only if it vanished (lease lapsed)."""
        lease = self._lease()
        lease_id = lease.id if lease is not None else 0
        if rnd in self._joined:
            revision, held_by = self._joined[rnd]
            keys = self._view.job(self.job_id)
            if keys is None:
                return
            if keys.joins_all:
                if not self._view.joins_caught_up(self.job_id, revision):
                    return  # the view has not caught up with our own put yet
                if self.node_id in keys.joins.get(rnd, {}):
                    return
            elif lease is None or (held_by == lease_id and
                                   keys.gone.get(rnd, {}).get(self.node_id, 0) <= revision):
                return      # written under the lease we hold, not seen deleted since (or
                            # no lease now: the keeper is registering again)
        hosted = self.hosted_port()
        join = Join(node_id=self.node_id, address=self._address, nproc=self._nproc,
                    port=hosted or self._port(), prev_rank=self.prev_rank, time=self._clock(),
                    store_port=self._store_port, hosted=bool(hosted))
        self._joined[rnd] = (self._put(Kind.JOIN, self._join_key(rnd), join.to_json(), lease),
                             lease_id)

    def _forget_old_joins(self, current: int) -> None:
        """Our joins of the rounds before ``current``, and our claims to decide rounds up
        to it (closed: nothing left to decide)."""
        for rnd in sorted(r for r in self._joined if r < current):
            try:
                self._store.delete(self._join_key(rnd))
            except Exception as exc:  # best effort: the lease removes them anyway
                log.debug("could not delete old join key: %s", exc)
            self._joined.pop(rnd, None)
        self._release_claims(current)
        self._denied = {r: v for r, v in self._denied.items() if r > current}

    # -- who watches the joins, who decides ----------------------------------------
    def _joins_wanted(self, state: RoundState, keys) -> int:
        """How this node watches the job's joins (JobsView.watch_joins): 0, all of them,
        where its part needs them (it decides the open round; it is the closed round's
        first member, which sees a newcomer wait to join; the torchrun adapter's); else
        the deletes of the state's round's joins (a member lost). So a round's N joins
        reach one or two nodes, not N."""
        if self._joins_everywhere:
            return 0
        if state.status == OPEN and keys.deciders.get(state.round) == self.node_id:
            return 0
        if state.status == CLOSED and state.members \
                and state.members[0].node_id == self.node_id:
            return 0
        return state.round

    def _decides(self, state: RoundState, keys) -> bool:
        """Whether this node decides the open round: it claimed the round first of the
        nodes that joined it (a create of ``decider/<R>`` under its node lease, so a
        lost decider hands over by itself; a node that leaves the job gives it up)."""
        rnd = state.round
        holder = keys.deciders.get(rnd)
        mine = self._claimed.get(rnd)
        if holder is None and mine is not None and self._view.caught_up(self.job_id, mine):
            self._claimed.pop(rnd)     # our claim went (our lease lapsed): again
            mine = None
        if holder is None and rnd in self._denied:
            if not self._view.caught_up(self.job_id, self._denied[rnd]):
                return False    # another node's claim, not in our view yet: no new try
            del self._denied[rnd]   # it went since (its node lost, or it left the job)
        if holder is None and mine is None:
            key = self._key("decider", rnd)
            body = json.dumps({"node": self.node_id})
            try:
                mine = self._store.create(key, self._records.seal(Kind.DECIDER, key, body),
                                          lease=self._lease())
            except KeyExists:
                # Another node's (a failed create costs etcd a write: try again only once
                # the view has shown it and then its delete).
                held = self._store.get(key)
                if held is not None:
                    self._denied[rnd] = held.revision
                return False
            self._claimed[rnd] = mine
            self._written = max(self._written, mine)
            log.info("%s: this node decides round %d", self._where(rnd), rnd)
        return holder == self.node_id or (holder is None and mine is not None)

    def _release_claims(self, upto: int | None) -> None:
        """Give up our claims to decide rounds up to ``upto`` (None: every round), each
        only if it is still ours."""
        for rnd in sorted(r for r in self._claimed if upto is None or r <= upto):
            try:
                self._store.delete(self._key("decider", rnd), prev_revision=self._claimed[rnd])
            except Exception as exc:   # best effort: the lease removes it anyway
                log.debug("could not give up the claim to decide round %d: %s", rnd, exc)
            self._claimed.pop(rnd, None)

    def _round_joins(self, state: RoundState, keys) -> dict:
        """The joins of the closed round this node goes by ({node: Join}): all of them
        where it watches every join; else its first member's alone, read once a round
        (none if it was deleted since this node began to watch the round's deletes)."""
        if keys.joins_all:
            return keys.joins.get(state.round, {})
        first = state.members[0].node_id if state.members else None
        if first is None or first in keys.gone.get(state.round, {}):
            return {}
        if self._master[0] != state.round:
            kv = self._store.get(self._join_key(state.round, first))
            self._master = (state.round,
                            self._view.read_join(kv.key, kv.value) if kv is not None else None)
        join = self._master[1]
        return {first: join} if join is not None else {}

    # -- while running -------------------------------------------------------------
    def status(self, result: Result) -> RoundStatus:
        """Whether ``result``'s round still stands, and if not, why (with the round
        state the answer was read from)."""
        keys = self._view.job(self.job_id)
        state = keys.state if keys else None
        if state is None:
            return RoundStatus(StatusKind.SUPERSEDED, "the job's round state is gone")
        self._view.watch_joins(self.job_id, self._joins_wanted(state, keys), self)
        if state.members and state.members[0].node_id == self.node_id \
                and self._copy_checked != state.order:
            self._copy_checked = state.order   # once a round: no I/O on every tick
            listed, _ = self._view.listed_state(self.job_id)
            if listed is None or listed.order < state.order:
                self._list_copy(state)     # its writer could not: the list shows older
        return dataclasses.replace(self._judge(result, keys, state), state=state)

    def _judge(self, result: Result, keys, state: RoundState) -> RoundStatus:
        if state.final:
            return RoundStatus(StatusKind.FINAL, state.reason or state.status)
        if state.round != result.place.round or state.status != CLOSED:
            return RoundStatus(StatusKind.SUPERSEDED, state.reason or f"round {state.round} opened",
                               cause=state.cause)
        if not self._view.joins_caught_up(self.job_id):
            return CURRENT      # the joins watch (re)starting: nothing known against it
        # Never ourselves: if our own lease lapsed (a stalled daemon), the peers
        # see us lost and open a new round; alone, there is nobody to tell.
        if keys.joins_all:
            joined = keys.joins.get(state.round, {})
            lost = [n for n in state.member_ids() if n not in joined and n != self.node_id]
        else:
            gone = keys.gone.get(state.round, {})
            lost = [n for n in state.member_ids() if n in gone and n != self.node_id]
        if lost:
            return RoundStatus(StatusKind.LOST, f"node(s) {', '.join(lost)} lost",
                               nodes=tuple(lost), cause=RoundCause.NODE_LOST)
        waiting = [n for n in keys.joins.get(state.round + 1, {}) if n not in state.member_ids()]
        if waiting and self._scale_up == "immediate":
            waiting.sort()
            return RoundStatus(StatusKind.WAITING,
                               f"node(s) {', '.join(waiting)} waiting to join",
                               nodes=tuple(waiting), cause=RoundCause.NODE_WAITING)
        return CURRENT

    def reopen(self, result: Result, reason: str, count_restart: bool,
               cause: RoundCause = RoundCause.FAULT) -> RoundState:
        """Open the next round (once, cluster-wide) for ``cause``; returns the state
        that then holds. A StoreError leaves the ask pending: next_round makes it again."""
        self._wanted = (reason, count_restart, cause)
        return self._reopen_round(result.place.round, reason, count_restart, cause)

    def _reopen_round(self, rnd: int, reason: str, count_restart: bool,
                      cause: RoundCause) -> RoundState | None:
        deadline = time.monotonic() + self._sync_timeout
        while True:
            seen = self._view.revision
            keys = self._view.job(self.job_id)
            state = keys.state if keys else None
            if state is None or state.final or state.round != rnd \
                    or state.status != CLOSED:
                self._wanted = None
                return state
            if not keys.joins_all or not self._view.joins_caught_up(self.job_id):
                # Who stands, stands by and waits: every join, read for this once.
                self._view.watch_joins(self.job_id, 0, self)
                if time.monotonic() >= deadline:
                    raise StoreUnavailable(f"the joins of job {self.job_id} were not read "
                                           f"from etcd within {self._sync_timeout:g}s")
                self._view.wait(self._poll, seen)
                continue
            standing = keys.joins.get(state.round, {})
            alive = [n for n in state.member_ids() if n in standing]
            spares = [n for n in standing if n not in state.member_ids()]
            waiting = list(keys.joins.get(state.round + 1, {}))
            new, why = reopen(state, reason, count_restart, self.limits, self._clock(),
                              expected=tuple(set(alive) | set(waiting) | set(spares)),
                              cause=cause, rejoining=tuple(alive), spares=tuple(spares))
            if self._cas_state(new, keys.state_revision):
                log.info("%s: %s", self._where(state.round), why)
                self._wanted = None
                return new
            self._view.wait(self._poll, seen)  # someone else moved it; look again

    def finish(self, status: str, reason: str) -> None:
        """Move the job to a final state (first writer wins)."""
        assert status in FINAL
        self._rounds_read()
        while True:
            seen = self._view.revision
            keys = self._view.job(self.job_id)
            state = keys.state if keys else None
            if state is None or state.final:
                return
            new = RoundState(round=state.round, status=status, members=state.members,
                             restarts=state.restarts, restart_times=state.restart_times,
                             reason=reason, opened_at=state.opened_at,
                             closed_at=self._clock())
            if self._cas_state(new, keys.state_revision):
                log.info("%s: job %s: %s", self._where(state.round), status, reason)
                return
            self._view.wait(self._poll, seen)

    # -- exit barrier ----------------------------------------------------------------
    def mark_done(self, rnd: int) -> None:
        """This node's workers of round ``rnd`` all exited 0 (a mark under its lease)."""
        self._put(Kind.DONE, f"{self._joins}/done/{rnd}/{self.node_id}", "{}", self._lease())
        self._done_since = (rnd, time.monotonic())

    def all_done(self, result: Result) -> bool:
        """Whether every member of ``result``'s round marked its workers done. Watched
        only where this node watches every join and mark of the job (the round's first
        member, which then ends the job): the others end the job when its state turns
        final, so N marks reach one node, not N. One of them still waiting
        ``done_recheck`` after its own mark reads the marks once each period (the first
        member's end did not reach etcd, or its daemon stopped first)."""
        keys = self._view.job(self.job_id)
        rnd = result.place.round
        if keys is not None and not keys.joins_all:
            marked, since = self._done_since
            if marked != rnd or time.monotonic() - since < self._done_recheck:
                return False
            self._done_since = (rnd, time.monotonic())
            keys = self._view.job(self.job_id, fresh=True)   # the joins and marks, read
        return keys is not None and set(result.members) <= keys.done.get(rnd, set())

    def publish_workers(self, rows: list[WorkerRow],
                        summary: RecoverySummary | None = None) -> None:
        """This node's worker rows and its recovery summary, for status on any node."""
        rows_only = {"rows": [r.to_dict() for r in rows], "summary": {}}
        full = {**rows_only, "summary": summary.to_dict() if summary else {}}
        for value in (full, rows_only):
            try:
                self._put(Kind.WORKERS, self._rows_key, json.dumps(value), self._lease())
                return
            except ValueError as exc:   # over what a reader takes: the summary first
                why = str(exc)
        log.warning("%s: worker rows not published: %s", self._where(), why)


def create_job(store: Store, job_id: str, spec: dict, now: float, round: int = 1,
               restarts: int = 0, restart_times: tuple = (), *, records,
               expected: tuple = ()) -> None:
    """Write a new job's spec (sealed already, or plain for the torchrun adapter) and
    its first, open round (its state and the job list's copy), sealed with ``records`` (trust/sealed.py); ``expected``:
    the nodes the job names (the round closes once all of them joined)."""
    prefix = job_prefix(job_id)
    try:
        store.create(f"{prefix}/spec", json.dumps(spec, sort_keys=True))
    except KeyExists:
        raise ValueError(f"job id {job_id} already exists in the cluster") from None
    first = RoundState(round=round, status=OPEN, opened_at=now, restarts=restarts,
                       restart_times=tuple(restart_times),
                       expected=tuple(sorted(expected)),
                       reason="submitted")
    # The round state first: a node that adopts the job by the list's copy finds it.
    # Put, not created: the job id is ours now, whatever an older job of it left.
    key = f"{rounds_prefix(job_id)}/state"
    store.put(key, records.seal(Kind.STATE, key, first.to_json()))
    key = f"{prefix}/state"
    store.put(key, records.seal(Kind.STATE, key, first.listed().to_json()))


def forget_job(store: Store, job_id: str) -> None:
    """Remove every key of the job: its rounds, joins and rows, then its place in the job
    list."""
    store.delete_prefix(rounds_prefix(job_id) + "/")
    store.delete_prefix(joins_prefix(job_id) + "/")
    store.delete_prefix(workers_prefix(job_id) + "/")
    store.delete_prefix(job_prefix(job_id) + "/")
