"""restore(): the newest snapshot every rank of the current round holds, as (step, state).

Each rank looks at its two slots (a slot whose header, meta or size do not agree
counts as absent) and at the replicas of them the daemon received from a peer
node (``replicas/<node>/rank{r}.{slot}``): a rank that moved here from a lost node
finds its snapshot there, and ``timings().restore_source`` says "peer". Its own
slot wins for a step both hold. With torch.distributed initialized and more than one rank,
the ranks agree on the newest step all of them hold (ranks.agree) and all
return it, or all return None. A slot file that is not the caller's own
(NotOwned), or any other error while looking, is raised on that rank after the
agreement, so the others are never left waiting; they return None.
"""
from __future__ import annotations

import os
import time

from . import costs, slots
from .errors import SnapshotError
from .ranks import agree, all_ok, distributed, identity
from .region import Region, slot_names
from .saving import settle


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


def restore():
    """(step, state) of the newest snapshot every rank holds, or None."""
    t0 = time.perf_counter()
    settle()
    rank, world = identity()
    steps, refused = _found(rank, world)
    together = distributed()
    step = agree(list(steps)) if together else max(steps, default=None)
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
        return None
    costs.record(restore_step=step, restore_s=took,
                 restore_source="local" if steps[step][0] is None else "peer")
    return step, state
