"""The daemon's private state dir: its modes, its files, how full its disk is.

Everything under the state dir is root's alone (0700 dirs, 0600 files): job
records hold every job's environment, logs hold every job's output, and
users read their own only through the daemon, which checks who asks. Files
are created with explicit modes (never left to the umask), without
following a link planted where the file should be; a dir left looser by an
older version is tightened at start, with a log line.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
from dataclasses import dataclass

log = logging.getLogger("elasticd.statedir")

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str) -> None:
    """Make ``path`` (and missing parents, 0700) a directory only its owner may
    enter; tighten it if it exists with looser bits."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} is not a directory (a link?); elasticd keeps its state only in "
                      "a real directory")
    if st.st_mode & 0o077:
        os.chmod(path, DIR_MODE)
        log.warning("tightened %s from %o to %o: job records and logs are for root alone "
                    "(users read theirs through elasticctl)", path, stat.S_IMODE(st.st_mode),
                    DIR_MODE)


def tighten_files(path: str) -> None:
    """Give 0600 to every plain file directly in ``path`` that is looser (what
    an older version left behind)."""
    loose = 0
    for name in os.listdir(path):
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
            os.chmod(full, FILE_MODE)
            loose += 1
        elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077:
            os.chmod(full, DIR_MODE)
            loose += 1
    if loose:
        log.warning("tightened %d files and dirs in %s to owner-only", loose, path)


def open_private(path: str, flags: int = os.O_WRONLY | os.O_APPEND) -> int:
    """An fd on ``path``, created 0600 if missing, never through a link; an
    existing file that is looser is tightened (fchmod, whatever the umask)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a plain file")
        if st.st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch_private(path: str) -> None:
    """Make sure ``path`` exists as a 0600 file (before another library opens it)."""
    os.close(open_private(path, os.O_WRONLY))


def remove_tree(parent: str, name: str) -> bool:
    """Remove the directory ``name`` in ``parent`` and all it holds, without ever
    following a link: what a user could write in it (a job's run dir) may hold
    links planted to make root delete something else. ``parent`` is opened once
    and ``name`` removed relative to it; ``shutil.rmtree`` then walks by dir fds,
    unlinks links as links, and checks that each dir it opens is the one it
    lstat'ed (a link swapped in meanwhile is refused). A link or a non-directory
    at ``name`` is refused (OSError), as is a ``name`` that is not one path
    segment. False when there was nothing to remove."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise OSError(f"{name!r} is not a single path segment")
    if not shutil.rmtree.avoids_symlink_attacks:
        raise OSError("this platform's rmtree cannot avoid symlink attacks")
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(f"{os.path.join(parent, name)} is not a directory (a link?); "
                          "left in place")
        shutil.rmtree(name, dir_fd=fd)
        return True
    finally:
        os.close(fd)


def tree_bytes(path: str) -> int:
    """What the plain files directly in ``path`` take on disk (blocks), 0 if it is
    gone; links and subdirs are not followed."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += max(st.st_blocks * 512, 0)
    return total


@dataclass(frozen=True)
class DiskSpace:
    """The state dir's filesystem: free bytes and whether that counts as full."""
    free_bytes: int
    total_bytes: int
    full: bool

    def problem(self, path: str) -> str:
        """One line for `elasticctl nodes`; empty when there is room."""
        if not self.full:
            return ""
        return (f"state dir {path} is full ({self.free_bytes // (1024 * 1024)} MiB free): "
                "submits fail and logs may lose output; free some space")


def disk_space(path: str, min_free: int) -> DiskSpace:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    return DiskSpace(free, st.f_blocks * st.f_frsize, free < min_free)
