"""The writer's count of sealed records kept rising across the daemon's restarts and clock steps.

trust/sealed.py numbers each record a daemon writes with a count taken from
its wall clock (microseconds), at least one more than its last, and a reader
that holds a record of a key refuses an older count there as a replay. Within
one process the "one more than the last" rule covers a clock stepped back; a
restart would lose it: a daemon started again after its clock went back an
hour would write counts below those its peers hold for its own keys (its node
record, its workers and phase records) and be refused for that hour.

So the count is reserved ahead in the daemon's private state dir: the file
``records-seq`` holds a count above every one this daemon has handed out, and
a new process starts above it. The mark is written again (whole, 0600, never
through a link) when the counts reach it, ``RESERVE`` ahead, so a daemon
writes it about once a minute, not once a record. A write that fails is logged
and the process goes on (its counts still rise; only a restart before the next
good write could start below them).
"""
from __future__ import annotations

import logging
import os

from ..statedir import open_private

log = logging.getLogger("elasticd.trust")

NAME = "records-seq"
RESERVE = 60_000_000        # counts (microseconds) reserved ahead at each write
_DIGITS = 20                # the largest count a sealed record carries


class SeqMark:
    """The reserved count in ``<state_dir>/records-seq`` (see the module doc)."""

    def __init__(self, state_dir: str, reserve: int = RESERVE):
        self.path = os.path.join(state_dir, NAME)
        self._reserve = reserve
        self.reserved = self._read()

    def _read(self) -> int:
        """The count in the file, 0 when there is none; a file that does not hold
        one (cut short, or not ours) counts as none, said once."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            log.warning("%s: %s; sealed records count from the clock alone", self.path, exc)
            return 0
        try:
            text = os.read(fd, _DIGITS + 2).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        if not text.isdigit() or len(text) > _DIGITS:
            log.warning("%s does not hold a count (%r); sealed records count from the "
                        "clock alone", self.path, text[:40])
            return 0
        return int(text)

    def reach(self, count: int) -> None:
        """Make the mark lie above ``count`` (a count about to be handed out)."""
        if count < self.reserved:
            return
        mark = count + self._reserve
        self.reserved = mark       # tried once per reserve, even when the write fails
        tmp = self.path + ".tmp"
        try:
            fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, f"{mark}\n".encode("ascii"))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self.path)
        except OSError as exc:
            log.warning("%s: %s; a restart of this daemon after its clock went back "
                        "could see its records refused as replays", self.path, exc)
