"""The daemon's side of the beat channel: each rank's beat records, and the OS calls.

The channel's format is the worker contract, worker_site/elasticd_heartbeat.py
(loaded here as ``contract``); where each rank's files are (its environment) is
workers/rank_files.py. This module reads a record the way anything a worker can
write must be read (capped, no link followed, every field checked), and wraps the
OS calls the hang tracker makes on ranks, so that tests can swap in fakes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from ..workers import env as envnames
from ..workers import files as workerfiles
from ..workers import signals as rank_signals
from .timeouts import write_limits_file
from ..workers.contract import beats as contract

HEARTBEAT_ENV = envnames.HEARTBEAT_FILE


@dataclass(frozen=True)
class BeatRecord:
    """One record of a rank's heartbeat file (worker contract), checked."""
    pid: int
    phase: str
    steps: int
    busy_us: int

    @property
    def exiting(self) -> bool:
        return self.phase == contract.EXITING

    @property
    def off(self) -> bool:
        """The process cannot beat (its sitecustomize could not install the beats)."""
        return self.phase == contract.OFF

    @classmethod
    def parse(cls, data: bytes | None) -> "BeatRecord | None":
        fields = contract.parse_record(data) if data else None
        return cls(*fields) if fields else None



# ---------------------------------------------------------------- OS calls

class ProcessOps:
    """The OS calls the tracker makes; tests swap in a fake."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    @staticmethod
    def beat_mark(path: str) -> int | None:
        """The heartbeat file's mtime in ns, or None; never follows a link."""
        st = workerfiles.regular_stat(path)
        return st.st_mtime_ns if st is not None else None

    @staticmethod
    def read_beat(path: str, uid: int) -> BeatRecord | None:
        """The record in a heartbeat file, or None (missing, not a regular file of
        ``uid``'s, malformed).

        The worker (as ``uid``) wrote it, so it is untrusted: read with
        ``workerfiles.read`` (capped, no link followed, never blocking), every
        field checked (contract.parse_record); the pid is checked by the caller.
        """
        got = workerfiles.read(path, uid, contract.RECORD_BYTES, whole=False)
        return BeatRecord.parse(got.data if got.ok else None)

    @staticmethod
    def write_limits(path: str, data: bytes) -> None:
        write_limits_file(path, data)

    @staticmethod
    def pgid(pid: int) -> int | None:
        try:
            return os.getpgid(pid)
        except OSError:
            return None

    @staticmethod
    def catches(pid: int, sig: int) -> bool:
        """Whether ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("SigCgt:"):
                        return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
        except (OSError, ValueError, IndexError):
            pass
        return False

    @staticmethod
    def kill(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def kill_rank(worker, sig: int) -> None:
        """Signal a rank's process group (workers.group.Worker): through the same
        checks as every other signal to a rank (workers/signals.py)."""
        rank_signals.signal_rank_group(worker.proc, sig)


