"""Reading a file the job's user can write: the one way the daemon does it.

A worker runs as the job's user and can write its run dir (error files,
in-process reports, heartbeats), so what the daemon finds there may be a
symlink to a file only root may read, a FIFO that blocks any reader, a
device, or gigabytes. ``read`` opens with ``O_NOFOLLOW|O_NONBLOCK`` (a link
is refused, a FIFO's open returns at once), then checks on the open file
that it is a regular file owned by the job's uid, and reads at most
``limit`` bytes: it never follows a link, never blocks, never reads more
than asked. What is wrong with a file is a ``Problem``, for the caller to
record; the reason never depends on the file's contents.
"""
from __future__ import annotations

import enum
import os
import stat
from dataclasses import dataclass


class Problem(enum.Enum):
    MISSING = "missing"
    NOT_REGULAR = "not a regular file"            # a link, FIFO, socket, device, directory
    WRONG_OWNER = "not owned by the job's user"
    TOO_LARGE = "larger than the limit"
    UNREADABLE = "could not be read"


@dataclass(frozen=True)
class FileRead:
    data: bytes = b""
    size: int = 0            # the file's size when read (may exceed len(data) with offset)
    mtime: float = 0.0
    problem: Problem | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


def read(path: str, uid: int, limit: int, offset: int = 0, whole: bool = True) -> FileRead:
    """At most ``limit`` bytes of ``path`` from ``offset``, if it is safe to read.

    ``whole``: the file must fit in ``limit`` (else TOO_LARGE and no data);
    otherwise a longer file yields its first ``limit`` bytes after ``offset``.
    ``uid``: the owner the file must have (the job's user).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                     | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return FileRead(problem=Problem.MISSING)
    except OSError:  # ELOOP: a symlink; ENXIO: a socket; EACCES...
        return FileRead(problem=Problem.NOT_REGULAR if _is_special(path)
                        else Problem.UNREADABLE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return FileRead(problem=Problem.NOT_REGULAR)
        if st.st_uid != uid:
            return FileRead(problem=Problem.WRONG_OWNER)
        if whole and st.st_size > limit:
            return FileRead(size=st.st_size, mtime=st.st_mtime, problem=Problem.TOO_LARGE)
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, limit)
        return FileRead(data=data, size=st.st_size, mtime=st.st_mtime)
    except OSError:
        return FileRead(problem=Problem.UNREADABLE)
    finally:
        os.close(fd)


def regular_stat(path: str) -> os.stat_result | None:
    """``lstat`` of ``path`` if it is a regular file (never follows a link), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def regular_size(path: str) -> int | None:
    """The size of ``path`` if it is a regular file (never follows a link), else None."""
    st = regular_stat(path)
    return st.st_size if st is not None else None


def _is_special(path: str) -> bool:
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
