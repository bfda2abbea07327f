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

import json
import os
import stat
from dataclasses import asdict, dataclass, replace

from . import files as workerfiles
from . import snapshot_format as fmt
from .. import fields as f
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


ROW_MAX = 4096          # bytes of a serialised SnapshotRow
_MAX = 1 << 62


@dataclass(frozen=True)
class SnapshotRow:
    """One node's snapshots of a job as `status` shows them: the newest step every rank
    there holds complete (-1: none), when it was saved (that node's clock), its bytes,
    the ranks with slot files, what the dir takes, its budget (-1: not granted now) and
    where its replica went (replica_step -1: none). Built from the slot headers in one
    place (``of``), serialised in one (``to_bytes``/``from_bytes``)."""
    step: int = -1
    saved_at: float = 0.0
    bytes: int = 0
    ranks: int = 0
    held_bytes: int = 0
    budget_bytes: int = -1
    replica_node: str = ""
    replica_step: int = -1

    @classmethod
    def of(cls, snap, budget: int | None, replicated) -> "SnapshotRow":
        """From a DirSnapshots (read_dir) and a Replicated (or None)."""
        return cls(step=snap.step, saved_at=snap.saved_at, bytes=snap.bytes,
                   ranks=snap.ranks, held_bytes=snap.held_bytes,
                   budget_bytes=-1 if budget is None else budget,
                   replica_node=replicated.node_id if replicated is not None else "",
                   replica_step=replicated.step if replicated is not None else -1)

    def age(self, now: float) -> float:
        return max(0.0, now - self.saved_at) if self.saved_at else 0.0

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SnapshotRow":
        try:
            doc = decode(raw, max_bytes=ROW_MAX)
        except BadValue as exc:
            raise ValueError(str(exc)) from None
        node = doc.get("replica_node", "")
        if node and not f.is_ident(node):
            raise ValueError("replica_node: not a node id")
        return cls(step=f.whole(doc, "step", -1, _MAX),
                   saved_at=f.real(doc, "saved_at", 0.0, float(1 << 40)),
                   bytes=f.whole(doc, "bytes", 0, _MAX),
                   ranks=f.whole(doc, "ranks", 0, _MAX),
                   held_bytes=f.whole(doc, "held_bytes", 0, _MAX),
                   budget_bytes=f.whole(doc, "budget_bytes", -1, _MAX),
                   replica_node=node,
                   replica_step=f.whole(doc, "replica_step", -1, _MAX))


def row_of(ledger, job, replicated: Replicated | None) -> SnapshotRow | None:
    """This node's snapshot row of ``job`` (its record here, or None): ``ledger``,
    workers/snapshot_dirs.py (None: no snapshots on this node); ``replicated``, where
    its replica went (replication/stats.py)."""
    if ledger is None or job is None:
        return None
    found = read_dir(ledger.path(job.id), job.uid, scan_limit(job.nproc_per_node))
    if found is None:
        return None
    return SnapshotRow.of(found, ledger.granted(job.id), replicated)
