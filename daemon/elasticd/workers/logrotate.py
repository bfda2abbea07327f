"""Bounded rank logs: rotation of ``rank-R.log`` into ``rank-R.log.1``.

Workers write their output straight into their rank's log through an
O_APPEND descriptor (workers/launch.py), so a slow daemon never blocks them and a
daemon restart loses nothing they wrote. To bound what a log takes on disk,
the ``LogKeeper`` looks at the logs of running jobs every
``agent.log_check_interval`` seconds; a log past half of ``agent.log_max_bytes``
is rotated:

1. ``rank-R.log.1.tmp`` gets a header (the restart markers, ``==== elasticd:``
   lines, of the part being dropped, newest kept up to ``MARKER_BYTES``, then
   one rotation line saying what was dropped) and then the newest
   ``max_bytes / 2`` minus header bytes of ``rank-R.log``; where
   ``rank-R.log`` holds less than that (it was rotated a moment ago, and the
   copy of what a fast rank wrote during that rotation made ``rank-R.log.1``
   big), the newest output of the old ``rank-R.log.1`` comes first, so a
   rotation never drops a log's newest lines.
   The rotation line says at which byte of ``rank-R.log`` the copy begins
   (negative: that many bytes from the part rotated before come first);
2. the head of ``rank-R.log`` that the copy holds is cut off the live file:
   where the filesystem can collapse a file's head in place (ext4, xfs:
   ``fallocate(FALLOC_FL_COLLAPSE_RANGE)``, in whole blocks), the copy ends at
   the last block boundary, that much is collapsed, and the rest (less than a
   block, and whatever the rank wrote meanwhile) stays in ``rank-R.log``: the
   kernel orders the collapse with the rank's O_APPEND writes, so nothing is
   lost. Elsewhere (tmpfs, btrfs, NFS) ``rank-R.log`` is truncated to 0 after
   the copy (copytruncate), and the worker's next write lands at 0;
3. the copy replaces ``rank-R.log.1`` (rename: readers holding the old one keep it).

So the two files hold at most ``log_max_bytes`` plus what a rank writes in
one check interval while the job runs, and at most ``log_max_bytes`` once it
ended: ``LogKeeper.cap_finished`` looks at a job's logs once more when its agent
has exited (jobs/retirer.py calls it at each job's end, and at start for every
finished job), so a job that writes 200 MB and ends between two checks keeps
its newest ``log_max_bytes / 2`` at most. Only with copytruncate is what a rank
writes between the copy's last read and the truncate (microseconds) lost, as
with logrotate's; the alternative, workers writing into pipes the daemon
drains, would make every worker wait for the daemon, and lose output when it
restarts.

Every rotation of a log happens under ``LOCK``, and bumps that log's
generation (in the rotation line, and in memory): ``logfiles.LogReader``
reads a log's chunks under the same lock and maps its position across a
rotation with it.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .. import statedir
from ..logsetup import ctx
from .libc import LIBC

log = logging.getLogger("elasticd.workers.logrotate")

LOCK = threading.Lock()          # held while any log rotates, and by readers per chunk
MARKER = b"==== elasticd: "
ROTATED = b"==== elasticd: log rotated"
MARKER_BYTES = 64 * 1024         # restart markers kept in a rotated part's header
FULL_DISK_BYTES = 64 * 1024      # a log past this is rotated while the disk is full
_HEADER_SCAN = MARKER_BYTES + 4096
_ROTATION_LINE = re.compile(rb"==== elasticd: log rotated \(generation (\d+)\) at \S+: "
                            rb"(\d+) bytes dropped[^;\n]*; what follows is from byte (-?\d+) of the "
                            rb"log before ====\n")
_generations: dict[str, int] = {}  # log path -> rotations so far (under LOCK)
_COLLAPSE_RANGE = 0x08             # FALLOC_FL_COLLAPSE_RANGE, linux/falloc.h
_fallocate = LIBC.fallocate
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_fallocate.restype = ctypes.c_int


def rotated_path(path: str) -> str:
    return path + ".1"


@dataclass(frozen=True)
class Header:
    """The head of a rotated part: ``length`` bytes of markers and the rotation
    line; the copy that follows starts at byte ``start`` of the log as it was."""
    generation: int
    length: int
    start: int


def read_header(fd: int) -> Header | None:
    """The header of an open rotated part, or None if it has none (not ours)."""
    head = os.pread(fd, _HEADER_SCAN, 0)
    at = 0 if head.startswith(ROTATED) else head.find(b"\n" + ROTATED) + 1
    if at <= 0 and not head.startswith(ROTATED):
        return None
    m = _ROTATION_LINE.match(head, at)
    if m is None:
        return None
    return Header(int(m.group(1)), m.end(), int(m.group(3)))


def generation(path: str) -> int:
    """How often the log at ``path`` has been rotated (call under LOCK)."""
    gen = _generations.get(path)
    if gen is None:
        gen = 0
        try:
            fd = os.open(rotated_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            pass
        else:
            try:
                header = read_header(fd)
                gen = header.generation if header else 0
            finally:
                os.close(fd)
        _generations[path] = gen
    return gen


def _markers(fd: int, size: int, limit: int) -> list[bytes]:
    """The marker lines of an open file, newest last, at most ``limit`` bytes;
    rotation lines are left out (the new header has its own)."""
    found: list[bytes] = []
    pos, tail = 0, b""
    while pos < size:
        block = tail + os.pread(fd, min(1 << 20, size - pos), pos)
        if not block:
            break
        pos += len(block) - len(tail)
        lines = block.split(b"\n")
        tail = lines.pop()  # the rest of a line goes with the next block
        found.extend(line + b"\n" for line in lines
                     if line.startswith(MARKER) and not line.startswith(ROTATED))
        if len(tail) > 4096:
            tail = b""  # a long line is no marker
    kept, total = [], 0
    for line in reversed(found):
        if total + len(line) > limit:
            break
        kept.append(line[:4096])
        total += len(line)
    return kept[::-1]


def _newest(markers: list[bytes], limit: int) -> list[bytes]:
    """The newest of ``markers`` that fit in ``limit`` bytes, in order."""
    total, first = 0, len(markers)
    while first > 0 and total + len(markers[first - 1]) <= limit:
        first -= 1
        total += len(markers[first])
    return markers[first:]


def _copy(src: int, dst: int, offset: int, end: int) -> None:
    while offset < end:
        n = os.copy_file_range(src, dst, end - offset, offset) if hasattr(os, "copy_file_range") \
            else 0
        if n <= 0:
            data = os.pread(src, min(1 << 20, end - offset), offset)
            if not data:
                return
            n = os.write(dst, data)
        offset += n


def _line_start(fd: int, pos: int) -> int:
    """``pos`` moved on to the start of the next line (within 4 KiB)."""
    if pos <= 0:
        return 0
    nl = os.pread(fd, 4096, pos - 1).find(b"\n")
    return pos + nl if nl >= 0 else pos


def _collapse_head(fd: int, start: int, size: int) -> int:
    """Cut the head of the live log off in place, up to the last block boundary
    at or before ``size`` and past ``start`` (where the copy begins), leaving at
    least one byte; the bytes cut (0: this filesystem cannot, or there is less
    than a block to cut: truncate instead)."""
    try:
        block = os.fstatvfs(fd).f_bsize
    except OSError:
        return 0
    if block <= 0:
        return 0
    cut = size // block * block
    if cut >= os.fstat(fd).st_size:  # a collapse must end before the end of the file
        cut -= block
    if cut <= 0 or cut < start:
        return 0
    if _fallocate(fd, _COLLAPSE_RANGE, 0, cut) != 0:
        return 0  # EOPNOTSUPP (tmpfs, btrfs, NFS), EINVAL (alignment): truncate
    return cut


def rotate(path: str, max_bytes: int) -> int:
    """Rotate the log at ``path`` (see the module doc); the bytes dropped."""
    old_part = rotated_path(path)
    tmp = old_part + ".tmp"
    with LOCK:
        gen = generation(path) + 1
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        ofd = None
        try:
            limit = min(MARKER_BYTES, max_bytes // 16)  # the header's share
            share = max_bytes // 2 - limit - 256         # the newest output kept
            try:
                ofd = os.open(old_part, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                old_size = 0
            else:
                old_size = os.fstat(ofd).st_size
            size = os.fstat(fd).st_size
            start = _line_start(fd, max(0, size - share))
            # A live log shorter than the share (the rank wrote little since a
            # rotation whose catch-up copy made the old part big) keeps the old
            # part's newest output too: the newest lines may be there.
            back_from = old_size
            if ofd is not None and size < share:
                header = read_header(ofd)
                body = header.length if header is not None else 0
                back_from = _line_start(ofd, max(body, old_size - (share - size)))
            markers: list[bytes] = []
            if ofd is not None:
                markers = _markers(ofd, back_from, limit)
            kept = markers
            markers = _newest(kept + _markers(fd, start, limit), limit)  # + those dropped now
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            back = old_size - back_from
            dropped = back_from + start
            # Where the copy begins in the live log; negative: that many bytes
            # before its byte 0, from the part rotated before.
            begins = start - back
            line = (f"==== elasticd: log rotated (generation {gen}) at {stamp}: {dropped} bytes "
                    f"dropped; what follows is from byte {begins} of the log before ====\n")
            try:
                out = statedir.open_private(tmp, os.O_WRONLY | os.O_TRUNC)
                try:
                    os.write(out, b"".join(markers) + line.encode())
                    if back:
                        _copy(ofd, out, back_from, old_size)
                    _copy(fd, out, start, size)
                    # What the rank wrote during the copy, before the cut.
                    for _ in range(3):
                        now = os.fstat(fd).st_size
                        if now <= size:
                            break
                        _copy(fd, out, size, now)
                        size = now
                    cut = _collapse_head(fd, start, size)
                    if cut:  # the copy ends where the live log now begins
                        os.ftruncate(out, os.lseek(out, 0, os.SEEK_CUR) - (size - cut))
                    os.replace(tmp, old_part)
                finally:
                    os.close(out)
                if not cut:
                    os.ftruncate(fd, 0)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # No room for the copy: drop the whole log so the rank can go
                # on writing, and keep only the markers and what was dropped.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                size = os.fstat(fd).st_size
                if back:
                    kept = _markers(ofd, old_size, limit)
                markers = _newest(kept + _markers(fd, size, limit), limit)
                os.ftruncate(fd, 0)
                line = (f"==== elasticd: log rotated (generation {gen}) at {stamp}: "
                        f"{old_size + size} bytes dropped, the disk being full; what follows is "
                        f"from byte {size} of the log before ====\n")
                out = statedir.open_private(tmp, os.O_WRONLY | os.O_TRUNC)
                try:
                    os.write(out, b"".join(markers) + line.encode())
                    os.replace(tmp, old_part)
                finally:
                    os.close(out)
                dropped = old_size + size
            _generations[path] = gen
        finally:
            os.close(fd)
            if ofd is not None:
                os.close(ofd)
    return dropped


class LogKeeper:
    """Owns the loop that keeps running jobs' logs under ``agent.log_max_bytes``.

    ``active()`` names the jobs whose logs may grow; a job is looked at once
    more after it leaves that list, and ``cap_finished`` once more after it
    ended (from another thread), so what it wrote last is bounded too, even when
    it ran between two looks. A log that cannot be rotated (disk full, removed)
    is logged and tried at the next look; the loop never stops on a log's account.
    """

    def __init__(self, logs_dir: str, max_bytes: int, interval: float,
                 active: Callable[[], list[str]], node_id: str = "",
                 disk_full: Callable[[], bool] = lambda: False):
        self._dir = logs_dir
        self._max = max_bytes
        self._interval = interval
        self._active = active
        self._node = node_id
        self._disk_full = disk_full
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: set[str] = set()
        self._look = threading.Lock()  # one look at a job's logs at a time
        self.rotations = 0
        self.dropped_bytes = 0
        self.errors = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="log-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the loop outlives any one bad look
                log.exception("%s: log size check failed", ctx(node=self._node))

    def check(self) -> None:
        """One look at every log of the active jobs (and of those just ended)."""
        now = set(self._active())
        # A full disk: running ranks would fail to write, so their logs give
        # way at a much lower size (what they hold is dropped first).
        low = FULL_DISK_BYTES if self._disk_full() else None
        for job_id in sorted(now | self._last):
            self.check_job(job_id, low)
        self._last = now

    def cap_finished(self, job_id: str) -> None:
        """The last look at an ended job's logs: each under ``log_max_bytes``, its
        newest lines kept (its ranks are gone, so nothing grows them again)."""
        self.check_job(job_id)

    def check_job(self, job_id: str, low: int | None = None) -> None:
        with self._look:
            self._check_job(job_id, low)

    def _check_job(self, job_id: str, low: int | None) -> None:
        job_dir = os.path.join(self._dir, job_id)
        try:
            names = os.listdir(job_dir)
        except FileNotFoundError:
            return
        for name in names:
            if not name.endswith(".log"):  # rank-R.log, jobstore.log
                continue
            path = os.path.join(job_dir, name)
            try:
                size = os.lstat(path).st_size
                try:
                    rotated = os.lstat(rotated_path(path)).st_size
                except FileNotFoundError:
                    rotated = 0
                # Past half, or both parts past the cap (a rotation that copied
                # what a fast rank wrote meanwhile may leave the old part big).
                if size <= self._max // 2 and size + rotated <= self._max and (
                        low is None or size <= low):
                    continue
                dropped = rotate(path, self._max)
            except OSError as exc:
                self.errors += 1
                log.warning("%s: cannot rotate %s: %s", ctx(job=job_id, node=self._node),
                            path, exc)
                continue
            self.rotations += 1
            self.dropped_bytes += dropped
            log.info("%s: rotated %s: its oldest %d bytes dropped (agent.log_max_bytes %d)",
                     ctx(job=job_id, node=self._node), name, dropped, self._max)
