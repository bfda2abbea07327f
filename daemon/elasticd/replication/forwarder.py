"""Forwarding: which replicas this node keeps for ranks that another node now holds.

A node keeps its ring predecessor's newest grid snapshot under
``<job dir>/replicas/<from node>/`` (receiver.py). When that node is lost (or
leaves the round), the ranks it held land on some other node, which has no
snapshot of them; this node does. When it comes back with the same id, its
memory is gone just the same. For a job running here in a closed round of the
same world size as a replica's header, each complete replica file of rank r
goes to the node that holds r in the current round, unless that node is this
one (restore() finds it here). The node it came from, holding its ranks still,
is offered it too: its receiver answers that it has it (its own slot of that
name holds that very snapshot) unless it lost it, so what crosses the wire in
steady state is one small offer per grid step. The pusher (pusher.py) sends
them over the same channel, saying where the replica came from, so the receiver
keeps it under ``replicas/<from node>/`` as it would have. A world-size change forwards nothing: the ranks' numbering does not
match the replicas' (the job falls back to its disk checkpoint).

The replicas dir is the job's user's: every dir is opened without following a
link, a name that is not a node id or not a slot file is skipped, and a file
must be the job's user's regular file with a complete header
(replica_files.header_of). At most MAX_ORIGINS dirs and MAX_FILES files each are
looked at.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from ..workers import snapshot_format as fmt
from . import replica_files as files
from .messages import is_node_id

MAX_ORIGINS = 64
MAX_FILES = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Holder:
    """A member of the job's current round other than this node: its ranks, where it is."""
    node_id: str
    address: str
    port: int             # its replication port
    first_rank: int
    nproc: int

    def holds(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.nproc


@dataclass(frozen=True)
class ForwardPlan:
    """A job running here in a closed round: where its replicas are, who holds which rank."""
    job_id: str
    job_dir: str
    uid: int
    world_size: int
    my_ranks: tuple
    holders: tuple        # of Holder

    def holder_of(self, rank: int) -> Holder | None:
        return next((h for h in self.holders if h.holds(rank)), None)


@dataclass(frozen=True)
class Forward:
    """One replica file here that ``to`` should hold."""
    to: Holder
    origin: str           # the node whose snapshot it is
    path: str
    rank: int
    slot: str
    header: fmt.Header

    @property
    def key(self) -> tuple:
        """What a forward once acknowledged is remembered by."""
        return (self.to.node_id, self.origin, self.rank, self.slot, self.header.step,
                self.header.saved_at_ns)


def _listed(dir_fd: int, most: int) -> list[str]:
    out = []
    with os.scandir(dir_fd) as entries:
        for i, entry in enumerate(entries):
            if i >= most:
                break
            out.append(entry.name)
    return sorted(out)


def forwards(plan: ForwardPlan, me: str) -> list[Forward]:
    """The replica files here that another member of the round should hold, sorted."""
    out: list[Forward] = []
    try:
        top = os.open(os.path.join(plan.job_dir, files.REPLICAS), _DIR_FLAGS)
    except OSError:
        return out
    try:
        for origin in _listed(top, MAX_ORIGINS):
            if not is_node_id(origin) or origin == me:
                continue
            try:
                fd = os.open(origin, _DIR_FLAGS, dir_fd=top)
            except OSError:
                continue
            try:
                out.extend(_from_origin(plan, me, origin, fd))
            finally:
                os.close(fd)
    except OSError:
        pass
    finally:
        os.close(top)
    return out


def _from_origin(plan: ForwardPlan, me: str, origin: str, fd: int) -> list[Forward]:
    out = []
    with contextlib.suppress(OSError):
        for name in _listed(fd, MAX_FILES):
            m = fmt.SLOT_FILE.fullmatch(name)
            if m is None:
                continue
            rank = int(m.group(1))
            if rank in plan.my_ranks:
                continue
            to = plan.holder_of(rank)
            if to is None or to.node_id == me:
                continue
            h = files.header_of(fd, name, plan.uid)
            if h is None or h.rank != rank or h.world_size != plan.world_size:
                continue
            out.append(Forward(to, origin,
                               os.path.join(plan.job_dir, files.REPLICAS, origin, name),
                               rank, m.group(2), h))
    return out
