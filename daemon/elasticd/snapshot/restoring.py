"""restore(): the newest snapshot every rank of the current round holds, as (step, state).

Each rank looks at its four slots (a slot whose header, meta or size do not agree
counts as absent) and at the replicas of them the daemon received from a peer
node (``replicas/<node>/rank{r}.{slot}``): a rank that moved here from a lost node
finds its snapshot there, and ``timings().restore_source`` says "peer". Its own
slot wins for a step both hold. With torch.distributed initialized and more than one rank,
the ranks agree on the newest step all of them hold (ranks.agree) and all
return it, or all return None. Where some rank holds no snapshot at all while
another holds one (it took over a lost node's ranks, and the daemon is forwarding
it the replica), or where no step is common while some rank holds replicas only
(the forwarded files arrive one at a time, and the step in common may be the one
still on its way), all of them look again every WAIT_POLL_S, for at most
$ELASTICD_SNAPSHOT_RESTORE_WAIT (the fewest polls any rank's setting allows),
and agree again. After a restore of step s each rank marks its own slots of steps
after s not complete, so a step of the abandoned run never passes for one of the
run that goes on. A slot file that is not the caller's own
(NotOwned), or any other error while looking, is raised on that rank after the
agreement, so the others are never left waiting; they return None.
"""
from __future__ import annotations

import math
import os
import time

from . import costs, slots
from .errors import SnapshotError
from .ranks import agree, all_ok, distributed, identity
from .region import Region, restore_wait, slot_names
from .saving import settle

WAIT_POLL_S = 0.1    # how often the ranks look again for a replica, within the restore wait


def _probe(region: Region, rank: int, world: int) -> list:
    return [c for c in (slots.probe(region, name, rank, world) for name in slot_names(rank))
            if c is not None]


def _found(rank: int, world: int) -> tuple[dict, Exception | None]:
    """{step: (replica dir name or None for this rank's own slot, Complete)}, and the
    refusal or error that stopped the look, if any (raised after the agreement, so the
    other ranks are not left waiting)."""
    try:
        region = Region.open(create=False)
    except (SnapshotError, OSError) as exc:
        return {}, exc
    if region is None:
        return {}, None
    steps: dict = {}
    with region:
        try:
            for peer in region.replicas():
                with peer:
                    for c in _probe(peer, rank, world):
                        steps[c.header.step] = (os.path.basename(peer.path), c)
            for c in _probe(region, rank, world):
                steps[c.header.step] = (None, c)     # own slots win over replicas
        except (SnapshotError, OSError) as exc:
            return {}, exc
    return steps, None


def _load(source: str | None, c) -> object:
    region = Region.open(create=False)
    if region is None:
        raise SnapshotError("the snapshot dir went away during the restore")
    with region:
        if source is None:
            state = slots.load(region, c)
        else:
            peers = region.replicas()
            try:
                peer = next((p for p in peers if os.path.basename(p.path) == source), None)
                state = slots.load(peer, c) if peer is not None else None
            finally:
                for p in peers:
                    p.close()
    if state is None:
        raise SnapshotError(f"slot {c.name} changed during the restore")
    return state


def _borrowed(steps: dict) -> bool:
    """Whether every step this rank holds is a replica (it took over a lost node's ranks)."""
    return bool(steps) and all(source is not None for source, _ in steps.values())


def _agreed(rank: int, world: int, steps: dict, refused) -> tuple:
    """(step, steps, refused) the ranks agree on, having polled again for a replica while
    some rank holds none and another holds one, or none is common while some rank holds
    replicas only (at most the restore wait, collectively)."""
    try:
        polls = math.ceil(restore_wait() / WAIT_POLL_S)
    except SnapshotError as exc:
        polls, refused = 0, refused or exc
    got = agree(list(steps), refused is not None, polls, _borrowed(steps))
    left = got.polls
    while got.starved and left > 0:
        time.sleep(WAIT_POLL_S)
        left -= 1
        steps, refused = _found(rank, world)
        got = agree(list(steps), refused is not None, borrowed=_borrowed(steps))
    return got.step, steps, refused


def _retire_newer(step: int, rank: int, world: int) -> None:
    """Mark this rank's own slots of steps after ``step`` not complete: the ranks went back
    to ``step``, and a step saved before it must never be taken for one saved after."""
    region = Region.open(create=False)
    if region is None:
        return
    with region:
        for c in _probe(region, rank, world):
            if c.header.step > step:
                slots.retire(region, c)


def restore():
    """(step, state) of the newest snapshot every rank holds, or None."""
    t0 = time.perf_counter()
    settle()
    rank, world = identity()
    steps, refused = _found(rank, world)
    together = distributed()
    if together:
        step, steps, refused = _agreed(rank, world, steps, refused)
    else:
        step = max(steps, default=None)
    state, failed = None, refused
    if step is not None and refused is None:
        try:
            state = _load(*steps[step])
        except Exception as exc:  # every rank must still reach all_ok
            failed = exc
    if together and step is not None and not all_ok(failed is None):
        step = None
    if failed is not None:
        raise failed
    took = time.perf_counter() - t0
    if step is None:
        costs.record(restore_step=None, restore_s=took, restore_source="none")
        costs.publish(rank, restored=True)
        return None
    _retire_newer(step, rank, world)
    costs.record(restore_step=step, restore_s=took,
                 restore_source="local" if steps[step][0] is None else "peer")
    costs.publish(rank, restored=True)
    return step, state
