"""What a job's snapshot dir on this node holds, from the slot files' headers alone: the
newest step every rank here holds complete, its age and size, and the bytes the dir takes.

The dir is the job's user's, so each slot file is read the one way the daemon reads
a file a worker can write (workers/files.py ``read``: O_NOFOLLOW|O_NONBLOCK, a
regular file owned by the job's uid, ``HEADER_USED`` bytes at most) and parsed by
workers/snapshot_format.py: a link, a FIFO, another user's file, a header torn
or foreign is no snapshot. Each rank's ``rank{rank}.costs`` (its last save stall,
restore time and source, for the metrics) is read the same way, bounded to
``COSTS_MAX`` bytes, decoded by values.decode and checked by ``RankCosts.from_doc``:
anything else there is no costs. At most ``max_entries`` entries of the dir are
looked at, so a dir a user filled with files costs a bounded scan.

``Replicated`` is the other half of a job's snapshot status: where its newest
snapshot's replica is, as the buddy acknowledged it (replication/pusher.py records it).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, replace

from . import files as workerfiles
from . import snapshot_format as fmt
from ..values import BadValue, decode



def scan_limit(nproc: int) -> int:
    """Entries of a job's dir looked at: its ranks' four slots, twice over (ranks of an
    earlier round, a library's temporary files), and a few more."""
    return 8 * max(nproc, 1) + 16


@dataclass(frozen=True)
class DirSnapshots:
    """A job's snapshots on this node, as its slot headers say."""
    step: int = -1          # the newest step every rank here holds complete; -1: none
    saved_at: float = 0.0   # unix seconds: the earliest save among that step's slots
    bytes: int = 0          # that snapshot's slots, every rank here together
    ranks: int = 0          # ranks with a slot file here
    held_bytes: int = 0     # what every plain file in the dir takes (memory, on tmpfs)
    costs: tuple = ()       # (rank, fmt.RankCosts) of the ranks that published theirs

    @property
    def save_stall_s(self) -> float | None:
        """The longest last save stall among the ranks here."""
        return max((c.save_stall_s for _, c in self.costs if c.save_stall_s is not None),
                   default=None)

    @property
    def restore(self) -> tuple[float, str] | None:
        """(the longest last restore time among the ranks here, where it came from:
        "peer" if any rank's came from a replica, else "local", else "none")."""
        done = [c for _, c in self.costs if c.restore_s is not None]
        if not done:
            return None
        sources = {c.restore_source for c in done}
        source = next(s for s in ("peer", "local", "none") if s in sources)
        return max(c.restore_s for c in done), source

    @property
    def present(self) -> bool:
        return self.step >= 0

    def age(self, now: float) -> float:
        return max(0.0, now - self.saved_at) if self.present else 0.0


@dataclass(frozen=True)
class Replicated:
    """A job's newest snapshot from this node, as its buddy acknowledged it."""
    node_id: str        # the buddy holding the replica
    step: int
    acked_at: float     # unix seconds
    lag_s: float        # from the local snapshot complete to the replica acknowledged


def read_dir(path: str, uid: int, max_entries: int) -> DirSnapshots | None:
    """The snapshots in the job's dir ``path`` (slot files owned by ``uid``); None when
    there is no such dir (or it is not one: never followed)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    held, complete, costs = 0, {}, []   # rank -> {step: header}; (rank, RankCosts)
    try:
        with os.scandir(fd) as entries:
            for seen, entry in enumerate(entries):
                if seen >= max_entries:
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                held += st.st_blocks * 512
                m = fmt.SLOT_FILE.fullmatch(entry.name)
                if m is None:
                    c = fmt.COSTS_FILE.fullmatch(entry.name)
                    got = c and _costs(os.path.join(path, entry.name), uid)
                    if got:
                        costs.append((int(c.group(1)), got))
                    continue
                rank = int(m.group(1))
                steps = complete.setdefault(rank, {})
                header = _complete_header(os.path.join(path, entry.name), uid)
                if header is not None and header.rank == rank:
                    steps[header.step] = header
    except OSError:
        pass
    finally:
        os.close(fd)
    return replace(_newest_common(complete, held), costs=tuple(sorted(costs, key=lambda rc: rc[0])))


def _costs(path: str, uid: int) -> fmt.RankCosts | None:
    got = workerfiles.read(path, uid, fmt.COSTS_MAX)
    if not got.ok:
        return None
    try:
        return fmt.RankCosts.from_doc(decode(got.data, max_bytes=fmt.COSTS_MAX))
    except (BadValue, ValueError):
        return None


def _complete_header(path: str, uid: int) -> fmt.Header | None:
    got = workerfiles.read(path, uid, fmt.HEADER_USED, whole=False)
    if not got.ok:
        return None
    try:
        header = fmt.parse(got.data)
    except fmt.BadHeader:
        return None
    return header if header.state is fmt.SlotState.COMPLETE else None


def _newest_common(complete: dict, held: int) -> DirSnapshots:
    """The newest step each rank with a slot file holds complete."""
    if not complete:
        return DirSnapshots(held_bytes=held)
    common = set.intersection(*(set(steps) for steps in complete.values()))
    if not common:
        return DirSnapshots(ranks=len(complete), held_bytes=held)
    step = max(common)
    headers = [steps[step] for steps in complete.values()]
    return DirSnapshots(step=step, saved_at=min(h.saved_at_ns for h in headers) / 1e9,
                        bytes=sum(h.total_bytes for h in headers), ranks=len(complete),
                        held_bytes=held)
