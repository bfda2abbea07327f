"""Reading per-rank worker logs, whole or followed live.

Workers append to ``<logs>/<job>/rank-<R>.log`` across restarts (each start
is marked by a ``==== elasticd:`` line). ``LogReader`` hands out whole lines
only, in chunks small enough for one gRPC message.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Iterator

CHUNK = 64 * 1024
_RANK_FILE = re.compile(r"rank-(\d+)\.log\Z")


def ranks_in(log_dir: str) -> list[int]:
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_RANK_FILE.match, names) if m)


def tail_offset(path: str, lines: int) -> int:
    """Byte offset where the last ``lines`` lines of the file begin."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0
    with open(path, "rb") as fh:
        pos, seen = size, 0
        while pos > 0:
            step = min(CHUNK, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
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
                    return pos + idx + 1
        return 0


class LogReader:
    """Reads new whole lines from several ranks' log files."""

    def __init__(self, log_dir: str, ranks: list[int] | None, tail_lines: int = 0):
        self._dir = log_dir
        self._fixed = ranks
        self._offsets: dict[int, int] = {}
        self._tail = tail_lines

    def _ranks(self) -> list[int]:
        return self._fixed if self._fixed is not None else ranks_in(self._dir)

    def read(self, final: bool = False) -> Iterator[tuple[int, str]]:
        """New text per rank; with ``final``, a trailing partial line too."""
        for rank in self._ranks():
            path = os.path.join(self._dir, f"rank-{rank}.log")
            if rank not in self._offsets:
                self._offsets[rank] = tail_offset(path, self._tail) if self._tail else 0
            try:
                with open(path, "rb") as fh:
                    fh.seek(self._offsets[rank])
                    while True:
                        data = fh.read(CHUNK)
                        if not data:
                            break
                        cut = data.rfind(b"\n") + 1
                        if cut == 0 and len(data) < CHUNK and not final:
                            break  # a partial line: wait for the rest
                        if cut == 0 or (final and len(data) < CHUNK):
                            cut = len(data)
                        self._offsets[rank] += cut
                        fh.seek(self._offsets[rank])
                        yield rank, data[:cut].decode("utf-8", "replace")
            except FileNotFoundError:
                continue

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
