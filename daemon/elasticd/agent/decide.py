"""What a job's agent does next, from one look at its workers and its round.

``decide()`` is a pure function of a ``Snapshot`` (the local workers' exit
codes, the restart budget used, whether the round still stands, whether the
other nodes finished) to a ``Decision``: an ``Action`` and why, and for a new
round another node opened, the restart layer that recovers it
(``round_layer``). The agent (agent/loop.py) takes the look and carries the
decision out.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from ..jobs.ladder import Layer
from ..rendezvous.protocol import RoundCause
from ..rendezvous.status import CURRENT, RoundStatus, StatusKind


class Action(enum.Enum):
    CONTINUE = "continue"    # workers running (or done, waiting for the other nodes)
    SUCCEED = "succeed"      # every worker on every node exited 0
    REPLACE = "replace"      # a rank died; the in-process layer starts a new one in its place
    RESTART = "restart"      # a local worker failed and restarts are left
    FAIL = "fail"            # a local worker failed and no restarts are left
    CANCEL = "cancel"        # the user cancelled the job
    SUSPEND = "suspend"      # the daemon is stopping; resume at next start
    REJOIN = "rejoin"        # another node opened a new round: stop and rejoin
    NODE_LOST = "node_lost"  # a member node's lease expired: stop and open a new round
    SCALE_UP = "scale_up"    # nodes wait to join: the round leader opens a new round
    FINAL = "final"          # the job ended cluster-wide (on another node's word)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    layer: Layer | None = None   # REJOIN, NODE_LOST: the restart layer that recovers it


@dataclass(frozen=True)
class Snapshot:
    """One look at the job's workers and its round: all that ``decide()`` reads.

    ``returncodes``: each local worker's exit code, None while it runs.
    ``restarts``/``max_restarts``: restarts used (cluster-wide) and allowed
    over the job's life (-1: no lifetime limit). ``round_status``:
    ClusterRendezvous.status(), whether the round stands. ``peers_done``:
    every member node has finished this round well (only asked once the
    local workers all did). ``inprocess_left``: ranks the in-process layer may
    still replace (0 for a job without in-process restart, or once it gave
    up). ``gave_up``: a rank reported that in-process restart gave up; it is
    about to exit non-zero. ``remote_ranks``: other nodes of the round run
    ranks too, still training as far as this node knows.
    """
    returncodes: tuple[int | None, ...]
    restarts: int = 0
    max_restarts: int = 3
    cancel_requested: bool = False
    shutting_down: bool = False
    round_status: RoundStatus = CURRENT
    peers_done: bool = True
    inprocess_left: int = 0
    gave_up: bool = False
    remote_ranks: bool = False


def round_layer(cause: RoundCause) -> Layer:
    """The layer of a new round another node opened, from the round's cause:
    a change of nodes (one lost, one waiting to join) is a new rendezvous; a
    worker fault somewhere restarts every node's processes."""
    return Layer.RENDEZVOUS if cause.membership else Layer.PROCESS


def decide(look: Snapshot) -> Decision:
    """What the agent does next, from one look at its workers and its round (no I/O).

    Dead ranks are replaced in-process only while the others still run the
    training function: once any rank finished, nobody is left to meet the
    newcomer. After ``gave_up`` the group restarts without waiting for the
    rank to exit.
    """
    returncodes, restarts, max_restarts = look.returncodes, look.restarts, look.max_restarts
    gave_up = look.gave_up
    if look.cancel_requested:
        return Decision(Action.CANCEL, "cancelled by user")
    if look.shutting_down:
        return Decision(Action.SUSPEND, "daemon stopping; the job resumes when it starts again")
    round_status = look.round_status
    kind, round_reason = round_status.kind, round_status.why
    if kind is StatusKind.FINAL:
        return Decision(Action.FINAL, round_reason)
    if kind is StatusKind.LOST:
        return Decision(Action.NODE_LOST, round_reason, Layer.RENDEZVOUS)
    if kind is StatusKind.SUPERSEDED:
        return Decision(Action.REJOIN, round_reason, round_layer(round_status.cause))
    failed = [rc for rc in returncodes if rc is not None and rc != 0]
    if failed or gave_up:
        running = look.remote_ranks or any(rc is None for rc in returncodes)
        finished = any(rc == 0 for rc in returncodes)
        if not gave_up and running and not finished and len(failed) <= look.inprocess_left:
            return Decision(Action.REPLACE, f"{len(failed)} rank(s) replaced in-process")
        if max_restarts < 0:  # no lifetime limit: the budget over a window decides (reopen)
            return Decision(Action.RESTART, f"restart {restarts + 1} (no lifetime limit)")
        if restarts < max_restarts:
            return Decision(Action.RESTART, f"restart {restarts + 1} of {max_restarts}")
        return Decision(Action.FAIL, f"no restarts left ({restarts} of {max_restarts} used)")
    if returncodes and all(rc == 0 for rc in returncodes):
        if look.peers_done:
            return Decision(Action.SUCCEED, "every worker exited 0")
        return Decision(Action.CONTINUE, "workers done; waiting for the other nodes")
    if kind is StatusKind.WAITING:
        return Decision(Action.SCALE_UP, round_reason)
    return Decision(Action.CONTINUE, "workers running")
