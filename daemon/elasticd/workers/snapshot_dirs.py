"""Jobs' snapshot dirs on this node: the root made safe, one dir per job for its user, and
the bytes each job's ranks here may hold in it.

The root (``snapshot.root``, ``/dev/shm/elasticd`` by default) is the daemon's, 0711:
anyone may pass, nobody but the daemon may create, rename or remove what is in
it. It sits in a directory every user may write (``/dev/shm``, sticky), so at
start the daemon refuses a root that is a link or another user's (someone
made it first) rather than use it. Each job gets ``<root>/<job id>``, made by
the daemon and handed to the job's user (0700, fchown on the dir opened without
following a link), before any of its workers start, whichever way they start
(``prepare_dirs`` in workers/group.py). An existing dir is kept as it is
when it is the job's user's (a restart, a daemon restart: the snapshots in it
are the point); one another user holds is refused. Removing a job's dir is the
retirer's (jobs/retirer.py), once the job is no longer live here.

``SnapshotBudgets`` is the node's ledger of budgets: a job whose group starts
is granted min(``snapshot.job_budget``, ``snapshot.node_budget`` minus what the
other live jobs here were granted), as a ``SnapshotGrant``; its grant goes when
its agent exits here.
"""
from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass

from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.snapshot_dirs")

ROOT_MODE = 0o711
JOB_DIR_MODE = 0o700


@dataclass(frozen=True)
class SnapshotGrant:
    """A job's snapshot dir on this node, the bytes its ranks here may hold in it (every
    slot of every rank together), the pin grid and the restore wait: what its workers'
    environment says."""
    dir: str
    budget_bytes: int
    pin_every: int = 0
    restore_wait: float = 0.0


def prepare_root(path: str) -> None:
    """Make ``path`` the daemon's own dir, mode 0711; OSError, naming the setting, where
    a link or another user's entry already stands there."""
    os.makedirs(os.path.dirname(path) or "/", mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, ROOT_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"snapshot.root {path} is not a directory (a link?): remove it, or "
                      "set snapshot.root to a path only root can create")
    if st.st_uid != os.geteuid():
        raise OSError(f"snapshot.root {path} belongs to uid {st.st_uid}, not to elasticd's "
                      f"user (uid {os.geteuid()}): someone made it first; remove it, or set "
                      "snapshot.root elsewhere")
    if stat.S_IMODE(st.st_mode) != ROOT_MODE:  # the entry is ours: nobody can swap it
        os.chmod(path, ROOT_MODE)


def ensure_job_dir(root: str, job_id: str, uid: int, gid: int) -> str:
    """``<root>/<job_id>``, a dir the job's user owns (0700 when made here); its path.
    Never follows a link; OSError for a link, a file, or a dir another user owns."""
    if not job_id or job_id in (".", "..") or "/" in job_id or "\0" in job_id:
        raise OSError(f"{job_id!r} is not a job id")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    parent = os.open(root, flags)
    try:
        try:
            os.mkdir(job_id, JOB_DIR_MODE, dir_fd=parent)
        except FileExistsError:
            pass
        fd = os.open(job_id, flags, dir_fd=parent)  # ELOOP / ENOTDIR: not a plain dir
        try:
            st = os.fstat(fd)
            me = os.geteuid()
            if st.st_uid not in (uid, me):
                raise OSError(f"snapshot dir {os.path.join(root, job_id)} belongs to uid "
                              f"{st.st_uid}, not to the job's user (uid {uid}): refused")
            if st.st_uid == me and me != uid:  # made here (or left half made): hand it over
                os.fchmod(fd, JOB_DIR_MODE)     # first: without CAP_FOWNER, root cannot
                os.fchown(fd, uid, gid)         # change the mode of a dir it gave away
            elif st.st_uid == me and stat.S_IMODE(st.st_mode) != JOB_DIR_MODE:
                os.fchmod(fd, JOB_DIR_MODE)
        finally:
            os.close(fd)
    finally:
        os.close(parent)
    return os.path.join(root, job_id)


def filesystem_half(path: str) -> int:
    """Half the size of the filesystem holding ``path``: ``snapshot.node_budget`` = 0."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize // 2


class SnapshotBudgets:
    """The node's ledger of snapshot budgets (held by the coordinator, thread-safe)."""

    def __init__(self, root: str, node_budget: int, job_budget: int = 0, pin_every: int = 0,
                 restore_wait: float = 0.0):
        self.root = root
        self.pin_every, self.restore_wait = pin_every, restore_wait
        self.node_budget = node_budget
        self.job_budget = job_budget or node_budget   # 0: as much as the node's
        self._lock = threading.Lock()
        self._given: dict[str, int] = {}

    @classmethod
    def for_node(cls, settings, node_id: str = "") -> "SnapshotBudgets":
        """From the [snapshot] settings; ``node_budget`` 0 read from the filesystem (the
        root must exist: ``prepare_root``), logged."""
        node = settings.node_budget
        if not node:
            node = filesystem_half(settings.root)
            log.info("%s: snapshot.node_budget is half of %s's filesystem: %d bytes "
                     "(%.1f GiB)", ctx(node=node_id), settings.root, node, node / 2**30)
        return cls(settings.root, node, min(settings.job_budget or node, node),
                   settings.pin_every, settings.restore_wait)

    def path(self, job_id: str) -> str:
        return os.path.join(self.root, job_id)

    def grant(self, job_id: str) -> SnapshotGrant:
        """The job's budget as its group starts: the least of its own cap and what the
        node's budget leaves after the other jobs' grants (never below 0)."""
        with self._lock:
            others = sum(b for j, b in self._given.items() if j != job_id)
            budget = max(0, min(self.job_budget, self.node_budget - others))
            self._given[job_id] = budget
        return SnapshotGrant(self.path(job_id), budget, self.pin_every, self.restore_wait)

    def granted(self, job_id: str) -> int | None:
        """The job's budget now; None while it has none (its agent is not running here)."""
        with self._lock:
            return self._given.get(job_id)

    def release(self, job_id: str) -> None:
        """The job's agent here exited: its grant returns to the node."""
        with self._lock:
            self._given.pop(job_id, None)

    def given_bytes(self) -> int:
        with self._lock:
            return sum(self._given.values())
