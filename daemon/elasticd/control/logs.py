"""Reading per-rank worker logs, whole or followed live, across rotation.

Workers append to ``<logs>/<job>/rank-<R>.log`` across restarts (each start
is marked by a ``==== elasticd:`` line); past a size the daemon rotates the
log into ``rank-<R>.log.1`` (workers/logrotate.py). ``LogReader`` reads the rotated
part first, then the live one, and keeps its place across a rotation: it
reads the live log a chunk at a time under the rotation lock, so a chunk is
never from a log truncated under it. It hands out whole lines only, in
chunks small enough for one gRPC message.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from ..workers import logrotate

CHUNK = 64 * 1024
_RANK_FILE = re.compile(r"rank-(\d+)\.log\Z")
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def ranks_in(log_dir: str) -> list[int]:
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_RANK_FILE.match, names) if m)


def _tail(fd: int, lines: int) -> tuple[int, int]:
    """(byte offset where the last ``lines`` lines of the open file begin,
    how many lines it has, up to ``lines``)."""
    size = os.fstat(fd).st_size
    pos, seen = size, 0
    while pos > 0:
        step = min(CHUNK, pos)
        pos -= step
        block = os.pread(fd, step, pos)
        # A final newline ends the last line; it does not start one.
        if pos + step == size and block.endswith(b"\n"):
            block = block[:-1]
        idx = len(block)
        while True:
            idx = block.rfind(b"\n", 0, idx)
            if idx < 0:
                break
            seen += 1
            if seen == lines:
                return pos + idx + 1, seen
    return 0, seen + (1 if size else 0)


def _ends_line(fd: int) -> bool:
    """Whether the open file is empty or ends with a newline (a rotation may cut a
    line in two: its head ends the rotated part, its rest begins the live log)."""
    size = os.fstat(fd).st_size
    return size == 0 or os.pread(fd, 1, size - 1) == b"\n"


@dataclass
class _Place:
    generation: int   # rotations of the live log when ``offset`` was taken
    offset: int       # bytes of the live log handed out


@dataclass
class _Rotated:
    """Part of a rotated log still to hand out: an open fd, from ``offset``."""
    fd: int
    offset: int
    note: str = ""


def _cut(data: bytes, final: bool) -> int:
    """How much of ``data`` to hand out: up to its last newline (all of it if
    ``final`` and short, or if one line fills a chunk); 0: wait for more."""
    cut = data.rfind(b"\n") + 1
    if cut == 0 and len(data) < CHUNK and not final:
        return 0
    if cut == 0 or (final and len(data) < CHUNK):
        return len(data)
    return cut


class LogReader:
    """Reads new whole lines from several ranks' log files."""

    def __init__(self, log_dir: str, ranks: list[int] | None, tail_lines: int = 0):
        self._dir = log_dir
        self._fixed = ranks
        self._places: dict[int, _Place] = {}
        self._tail = tail_lines

    def _ranks(self) -> list[int]:
        return self._fixed if self._fixed is not None else ranks_in(self._dir)

    def read(self, final: bool = False) -> Iterator[tuple[int, str]]:
        """New text per rank; with ``final``, a trailing partial line too."""
        for rank in self._ranks():
            for text in self._read_rank(os.path.join(self._dir, f"rank-{rank}.log"), rank,
                                        final):
                yield rank, text

    def _read_rank(self, path: str, rank: int, final: bool) -> Iterator[str]:
        while True:
            with logrotate.LOCK:
                gen = logrotate.generation(path)
                place = self._places.get(rank)
                rotated = None
                if place is None or place.generation != gen:
                    rotated, place = self._reposition(path, place, gen)
                    self._places[rank] = place
                data = b""
                if rotated is None:
                    try:
                        fd = os.open(path, _OPEN)
                    except FileNotFoundError:
                        return
                    try:
                        data = os.pread(fd, CHUNK, place.offset)
                    finally:
                        os.close(fd)
            if rotated is not None:
                yield from _drain(rotated)
                continue
            cut = _cut(data, final) if data else 0
            if cut == 0:
                return
            place.offset += cut
            yield data[:cut].decode("utf-8", "replace")

    def _reposition(self, path: str, place: _Place | None,
                    gen: int) -> tuple[_Rotated | None, _Place]:
        """Where to read next: first (or again after a rotation) the rotated part."""
        try:
            fd = os.open(logrotate.rotated_path(path), _OPEN)
        except FileNotFoundError:
            fd = None
        if place is None:  # a first look: the rotated part, then the live log
            if not self._tail:
                return (_Rotated(fd, 0) if fd is not None else None), _Place(gen, 0)
            start, seen = 0, 0
            try:
                live = os.open(path, _OPEN)
            except FileNotFoundError:
                pass
            else:
                try:
                    start, seen = _tail(live, self._tail)
                finally:
                    os.close(live)
            if fd is not None and start == 0 and seen and not _ends_line(fd):
                seen -= 1   # the live log's first line began in the rotated part
            if seen >= self._tail or fd is None:
                if fd is not None:
                    os.close(fd)
                return None, _Place(gen, start)
            return _Rotated(fd, _tail(fd, self._tail - seen)[0]), _Place(gen, 0)
        if fd is None:
            return None, _Place(gen, 0)
        header = logrotate.read_header(fd)
        if header is None or header.generation != place.generation + 1:
            return _Rotated(fd, 0), _Place(gen, 0)  # missed rotations: all that is left
        # The part holds bytes [start, end) of the live log as it was; the live
        # log now begins at its byte ``end`` (the rest, where it was truncated).
        end = header.start + os.fstat(fd).st_size - header.length
        live = _Place(gen, max(0, place.offset - end))
        if place.offset >= header.start:
            return _Rotated(fd, header.length + min(place.offset, end) - header.start), live
        note = (f"==== elasticd: {header.start - place.offset} bytes of this log were dropped "
                "before they were read (agent.log_max_bytes) ====\n")
        return _Rotated(fd, header.length, note), live

    def follow(self, done: Callable[[], bool], wait: Callable[[float], bool],
               interval: float) -> Iterator[tuple[int, str]]:
        """Yield lines until ``done()`` and the files are drained.

        ``wait(seconds)`` sleeps and returns True if the caller went away.
        """
        while True:
            finished = done()
            yield from self.read(final=finished)
            if finished or wait(interval):
                return


def _drain(part: _Rotated) -> Iterator[str]:
    """All of a rotated part from its offset (it no longer grows), then close it."""
    try:
        if part.note:
            yield part.note
        offset = part.offset
        while True:
            data = os.pread(part.fd, CHUNK, offset)
            if not data:
                return
            cut = _cut(data, True)
            offset += cut
            yield data[:cut].decode("utf-8", "replace")
    finally:
        os.close(part.fd)
