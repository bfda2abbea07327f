"""The daemon's side of the beat channel: where each rank beats, its records, the OS calls.

The channel's format is the worker contract, worker_site/elasticd_heartbeat.py
(loaded here as ``contract``); this module says where each rank's files are
(its environment), reads a record the way anything a worker can write must
be read (capped, no link followed, every field checked), and wraps the OS
calls the hang tracker makes on ranks, so that tests can swap in fakes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

from ..workers import env as envnames
from ..workers import files as workerfiles
from ..workers import signals as rank_signals
from .timeouts import LIMITS_FILE_ENV, write_limits_file
from ..workers.contract import beats as contract

WORKER_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker_site")
HEARTBEAT_ENV = envnames.HEARTBEAT_FILE


# ---------------------------------------------------------------- worker env

def site_env(env: dict) -> dict[str, str]:
    """PYTHONPATH with worker_site/ first: what every worker (and spare) gets."""
    rest = env.get("PYTHONPATH", "")
    parts = [WORKER_SITE] + [p for p in rest.split(os.pathsep) if p and p != WORKER_SITE]
    return {"PYTHONPATH": os.pathsep.join(parts)}


def heartbeat_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, envnames.HEARTBEAT_FILE_NAME.format(rank=rank))


def limits_file(run_dir: str) -> str:
    return os.path.join(run_dir, envnames.LIMITS_FILE_NAME)


def rank_env(run_dir: str, rank: int) -> dict[str, str]:
    """What one rank's environment adds: where it beats, where its learned limits are."""
    return {HEARTBEAT_ENV: heartbeat_file(run_dir, rank), LIMITS_FILE_ENV: limits_file(run_dir)}


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


