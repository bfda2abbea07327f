"""Peers' replicas on this node: ``<job dir>/replicas/<from node>/rank{r}.{slot}``, written
as the job's user's files, double-buffered, never through a link.

The job dir is the job's user's (workers/snapshot_dirs.py), so everything below it is
reached through descriptors opened with O_NOFOLLOW and checked with fstat: a dir
must be a directory owned by the job's uid (or made here, then handed to it, 0700),
a file is only ever created fresh (O_EXCL, 0600, then fchown'ed to the job's uid)
under a temporary name and renamed over the replica once it is whole and its
header says COMPLETE with the offered step. Until that rename the newest complete
replica stays as it was, and a rename never follows a link: a user who plants
links or FIFOs in their own dir gets nothing but a refused replica.
"""
from __future__ import annotations

import contextlib
import os
import stat

from ..workers import snapshot_format as fmt
from .messages import Offer

REPLICAS = "replicas"
DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
MAX_ENTRIES = 4096      # entries of a dir looked at when summing what it holds


class ReplicaRefused(Exception):
    """The replica cannot be written here; the message says why (sent to the peer)."""


def _own_dir(parent: int | None, name: str, uid: int, gid: int, create: bool) -> int:
    """A descriptor on the dir ``name`` (under ``parent``, or a path), owned by ``uid``."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=parent)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        raise ReplicaRefused(f"{name}: {exc.strerror} (a link or not a directory?)") from None
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if st.st_uid not in (uid, me):
            raise ReplicaRefused(f"{name} belongs to uid {st.st_uid}, not the job's {uid}")
        if st.st_uid == me and me != uid:     # made here: hand it to the job's user
            os.fchmod(fd, DIR_MODE)
            os.fchown(fd, uid, gid)
        elif stat.S_IMODE(st.st_mode) != DIR_MODE and st.st_uid == me:
            os.fchmod(fd, DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_from_dir(job_dir: str, from_node: str, uid: int, gid: int) -> int:
    """The dir that keeps ``from_node``'s replicas of the job, made if needed."""
    top = _own_dir(None, job_dir, uid, gid, create=False)
    try:
        mid = _own_dir(top, REPLICAS, uid, gid, create=True)
    finally:
        os.close(top)
    try:
        return _own_dir(mid, from_node, uid, gid, create=True)
    finally:
        os.close(mid)


def held_bytes(job_dir: str) -> int:
    """What the job's dir holds in plain files, its replicas included (bounded scan)."""
    total, seen = 0, 0
    stack = [job_dir]
    while stack and seen < MAX_ENTRIES:
        path = stack.pop()
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    seen += 1
                    if seen >= MAX_ENTRIES:
                        break
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        total += st.st_blocks * 512
                    elif stat.S_ISDIR(st.st_mode) and path.count(os.sep) - \
                            job_dir.count(os.sep) < 2:
                        stack.append(entry.path)
        except OSError:
            continue
    return total


def header_of(dir_fd: int, name: str, uid: int) -> fmt.Header | None:
    """The complete header of file ``name`` in the dir, if it is a regular file of ``uid``."""
    try:
        fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return None
        h = fmt.parse(os.pread(fd, fmt.HEADER_USED, 0))
        return h if h.state is fmt.SlotState.COMPLETE and st.st_size >= h.total_bytes else None
    except (OSError, fmt.BadHeader):
        return None
    finally:
        os.close(fd)


def holds(dir_fd: int, offer: Offer, uid: int) -> bool:
    """Whether the replica of this very snapshot (step and save time) is here already."""
    h = header_of(dir_fd, offer.name, uid)
    return h is not None and h.rank == offer.rank and h.step == offer.step \
        and h.saved_at_ns == offer.saved_at_ns


def holds_own(job_dir: str, offer: Offer, uid: int) -> bool:
    """Whether this node's own slot file of the offered name holds that very snapshot."""
    try:
        fd = os.open(job_dir, _DIR_FLAGS)
    except OSError:
        return False
    try:
        return holds(fd, offer, uid)
    finally:
        os.close(fd)


class Incoming:
    """One replica being received: a fresh temporary file, renamed over the replica by
    ``finish`` once whole; ``abort`` removes it."""

    def __init__(self, dir_fd: int, offer: Offer, uid: int, gid: int):
        self.dir_fd, self.offer = dir_fd, offer
        self.tmp = f".{offer.name}.incoming"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp, dir_fd=dir_fd)        # left by a crash: never followed
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS
        self.fd = os.open(self.tmp, flags, FILE_MODE, dir_fd=dir_fd)
        try:
            os.fchmod(self.fd, FILE_MODE)
            os.fchown(self.fd, uid, gid)
            os.set_blocking(self.fd, True)
        except BaseException:
            self.abort()
            raise
        self.written = 0
        self._first = b""

    def write(self, chunk: bytes) -> None:
        if self.written + len(chunk) > self.offer.size:
            raise ReplicaRefused(f"more than the {self.offer.size} bytes offered")
        if len(self._first) < fmt.HEADER_USED:
            self._first += chunk[:fmt.HEADER_USED - len(self._first)]
        view = memoryview(chunk)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.written += len(chunk)

    def finish(self) -> None:
        """Check the whole file against the offer, then put it in place."""
        o = self.offer
        if self.written != o.size:
            raise ReplicaRefused(f"{self.written} bytes came of {o.size} offered")
        try:
            h = fmt.parse(self._first)
        except fmt.BadHeader as exc:
            raise ReplicaRefused(f"not a snapshot slot: {exc}") from None
        if h.state is not fmt.SlotState.COMPLETE or h.rank != o.rank or h.step != o.step \
                or h.saved_at_ns != o.saved_at_ns or h.total_bytes > o.size:
            raise ReplicaRefused("the file's header does not match the offer")
        os.close(self.fd)
        self.fd = -1
        os.rename(self.tmp, o.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self.tmp, dir_fd=self.dir_fd)
