"""restore(): the newest snapshot every rank of the current round holds, as (step, state).

Each rank looks at its two slots (a slot whose header, meta or size do not agree
counts as absent); with torch.distributed initialized and more than one rank,
the ranks agree on the newest step all of them hold (ranks.agree) and all
return it, or all return None. A slot file that is not the caller's own
(NotOwned), or any other error while looking, is raised on that rank after the
agreement, so the others are never left waiting; they return None.
"""
from __future__ import annotations

import time

from . import costs, slots
from .errors import SnapshotError
from .ranks import agree, all_ok, distributed, identity
from .region import Region, slot_names
from .saving import settle


def _local(rank: int, world: int) -> tuple[list, Exception | None]:
    """This rank's complete slots, and the refusal or error that stopped the look, if any
    (raised after the agreement, so the other ranks are not left waiting)."""
    try:
        region = Region.open(create=False)
    except (SnapshotError, OSError) as exc:
        return [], exc
    if region is None:
        return [], None
    with region:
        found = []
        for name in slot_names(rank):
            try:
                c = slots.probe(region, name, rank, world)
            except (SnapshotError, OSError) as exc:
                return [], exc
            if c is not None:
                found.append(c)
    return found, None


def _load(c) -> object:
    region = Region.open(create=False)
    if region is None:
        raise SnapshotError("the snapshot dir went away during the restore")
    with region:
        state = slots.load(region, c)
    if state is None:
        raise SnapshotError(f"slot {c.name} changed during the restore")
    return state


def restore():
    """(step, state) of the newest snapshot every rank holds, or None."""
    t0 = time.perf_counter()
    settle()
    rank, world = identity()
    found, refused = _local(rank, world)
    steps = {c.header.step: c for c in found}
    together = distributed()
    step = agree(list(steps)) if together else max(steps, default=None)
    state, failed = None, refused
    if step is not None and refused is None:
        try:
            state = _load(steps[step])
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
    costs.record(restore_step=step, restore_s=took, restore_source="local")
    return step, state
