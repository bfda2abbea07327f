"""What failed in a worker group and why: the failure record the agent keeps.

Reads torch's ``@record`` error files (untrusted: bounded, never fatal),
decides which of several failed workers seen together is to blame, and
turns a worker's end into the failure dict stored as a job's
``last_failure`` and into the rows ``elasticctl status`` shows. No state.
"""
from __future__ import annotations

import json
import os
import signal
import time

import psutil

from .states import WorkerState
from .workers import Worker, describe_exit

# Signals that mean "we or a peer's teardown stopped it", not a fault of its own.
_STOP_SIGNALS = {-signal.SIGTERM, -signal.SIGINT, -signal.SIGPIPE}


def blame_order(outcome: int, error_file_mtime: float) -> int:
    """Which of several failed workers seen together caused it: lower first.

    A worker killed by a signal of its own (SIGKILL from the OOM killer,
    SIGSEGV, SIGABRT) comes before those that wrote an error file, since its
    peers then fail with "connection reset" errors of their own; then error
    files (by time), then the rest (by rank).
    """
    if outcome < 0 and outcome not in _STOP_SIGNALS:
        return 0
    return 1 if error_file_mtime else 2


def read_error_file(path: str, limit: int = 16 * 1024) -> tuple[str, str, float]:
    """(message, traceback, mtime) from a torch ``@record`` error file, or blanks."""
    try:
        mtime = os.stat(path).st_mtime
        with open(path, "rb") as fh:
            data = json.loads(fh.read(1 << 20))
        msg = data.get("message", {})
        if isinstance(msg, str):
            return msg[:limit], "", mtime
        text = str(msg.get("message", ""))
        tb = str(msg.get("extraInfo", {}).get("py_callstack", ""))
        return text[:limit], tb[-limit:], mtime
    except (OSError, ValueError, AttributeError, TypeError, RecursionError):
        # Whatever a worker left there, a bad file must not stop the restart loop.
        return "", "", 0.0


def most_to_blame(workers: list[Worker]) -> tuple[Worker, str, str] | None:
    """(worker, error message, traceback) of the failed worker to blame, or None."""
    candidates = []
    for w in workers:
        if w.outcome not in (None, 0) and (w.reported_error or not w.stopped_by_us):
            message, tb, mtime = read_error_file(w.error_file)
            candidates.append((blame_order(w.outcome, mtime), mtime, w.rank, w, message, tb))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[:3])
    _, _, _, w, message, tb = candidates[0]
    return w, message, tb


def describe(w: Worker, message: str) -> tuple[int, int, str]:
    """(exit_code, signal, cause) of a failed worker: ``rank 1 exited with exit code 3: ...``."""
    exit_code, sig, text = describe_exit(w.outcome)
    cause = f"rank {w.rank} {'exited with ' if not sig else ''}{text}"
    if message:
        cause += f": {message.splitlines()[0] if message.strip() else message}"
    return exit_code, sig, cause


def record(rank: int, exit_code: int, sig: int, cause: str, traceback: str, restart: int,
           node_id: str) -> dict:
    """A failure as the job record keeps it (the proto's ``Failure``)."""
    return {"rank": rank, "exit_code": exit_code, "signal": sig, "cause": cause,
            "traceback": traceback, "time": time.time(), "restart": restart,
            "node_id": node_id}


def worker_rows(workers: list[Worker], node_id: str) -> list[dict]:
    """The job record's rows for these workers (the proto's ``Worker``)."""
    rows = []
    for w in workers:
        rc = w.outcome
        if rc is None:
            state = WorkerState.RUNNING
        elif w.stopped_by_us and not w.reported_error:
            state = WorkerState.STOPPED
        elif rc == 0:
            state = WorkerState.SUCCEEDED
        else:
            state = WorkerState.FAILED
        try:
            started = psutil.Process(w.pid).create_time() if rc is None else 0.0
        except psutil.Error:
            started = 0.0
        rows.append({"rank": w.rank, "local_rank": w.local_rank, "pid": w.pid,
                     "state": state.value, "exit_code": rc if rc is not None else 0,
                     "node_id": node_id, "create_time": started})
    return rows
