"""What failed in a worker group and why: the failure record the agent keeps.

Reads torch's ``@record`` error files (a file a worker can touch: read
bounded, decoded by ``values.decode``, never fatal) and, for a rank that
left none, the last lines of its output since its start (as torchrun shows a
child's stderr): its last line is the failure's cause, the lines its
traceback. Decides which of several failed workers seen together is to
blame, turns a worker's end into the cause of the ``records.Failure`` stored
as a job's ``last_failure`` and into the rows ``elasticctl status`` shows,
and says when two failures are the same one (``same_way``: a crash loop).
No state.
"""
from __future__ import annotations

import os
import re
import signal
import time
from typing import NamedTuple

import psutil

from .. import values
from ..workers import files as workerfiles
from ..jobs.records import Failure, FailureKind, WorkerRow
from ..jobs.states import WorkerState
from ..workers.group import Worker, describe_exit, log_file_path
from ..workers.logrotate import MARKER, ROTATED

DEFAULT_MAX_BYTES = 1 << 20   # agent.error_file_max_bytes
DEFAULT_TAIL_LINES = 20       # agent.failure_tail_lines
TAIL_BYTES = 64 * 1024        # of a rank's log read for its last lines
LINE_LIMIT = 500              # characters of one line kept
UNREADABLE = "unreadable error file"
_RANK_CAUSE = re.compile(r"rank \d+ ")

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


class ErrorReport(NamedTuple):
    """What a worker's error file said: blanks when it wrote none; ``problem`` when
    the file is there but not safe to read (a link, a FIFO, another owner, too big)."""
    message: str
    traceback: str
    mtime: float
    problem: workerfiles.Problem | None = None


def read_error_file(path: str, uid: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                    limit: int = 16 * 1024) -> ErrorReport:
    """What a torch ``@record`` error file says (``limit`` characters of each part).

    The worker wrote it, as ``uid`` (default: ours): read with
    ``workerfiles.read`` (no links, no blocking, at most ``max_bytes``)."""
    got = workerfiles.read(path, os.geteuid() if uid is None else uid, max_bytes)
    if got.problem is workerfiles.Problem.MISSING:
        return ErrorReport("", "", 0.0)
    if got.problem is not None:
        return ErrorReport("", "", got.mtime, got.problem)
    try:
        data = values.decode(got.data, max_bytes=max_bytes, want=dict)
    except values.BadValue:
        # Whatever a worker left there, a bad file must not stop the restart loop:
        # the rank's output tells instead (``stderr_tail``).
        return ErrorReport("", "", 0.0)
    msg = data.get("message", {})
    if isinstance(msg, str):
        return ErrorReport(msg[:limit], "", got.mtime)
    if not isinstance(msg, dict):
        return ErrorReport("", "", 0.0)
    info = msg.get("extraInfo")
    tb = info.get("py_callstack", "") if isinstance(info, dict) else ""
    return ErrorReport(str(msg.get("message", ""))[:limit], str(tb)[-limit:], got.mtime)


def stderr_tail(log_dir: str, rank: int, lines: int = DEFAULT_TAIL_LINES) -> ErrorReport:
    """The last ``lines`` lines a rank wrote since its latest start (its log: stdout and
    stderr together, root's file) as a report: the last of them its message, all of
    them its traceback. Blank when it wrote nothing, or ``lines`` is 0."""
    if lines <= 0 or not log_dir:
        return ErrorReport("", "", 0.0)
    try:
        fd = os.open(log_file_path(log_dir, rank), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ErrorReport("", "", 0.0)
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, TAIL_BYTES, max(0, size - TAIL_BYTES))
    except OSError:
        return ErrorReport("", "", 0.0)
    finally:
        os.close(fd)
    text = data.splitlines()
    starts = [i for i, line in enumerate(text)
              if line.startswith(MARKER) and not line.startswith(ROTATED)]
    first = starts[-1] + 1 if starts else int(size > TAIL_BYTES)  # a line cut short: out
    own = [line for line in text[first:] if not line.startswith(MARKER)]
    kept = [line.decode("utf-8", "replace").rstrip()[:LINE_LIMIT] for line in own]
    while kept and not kept[-1].strip():
        kept.pop()
    kept = kept[-lines:]
    if not kept:
        return ErrorReport("", "", 0.0)
    return ErrorReport(kept[-1].strip(), "\n".join(kept) + "\n", 0.0)


def signature(f: Failure) -> tuple:
    """What makes two failures one failure seen twice (a crash loop repeats it): the
    same exit (code, signal, kind) and the same cause, whichever rank it hit."""
    return f.exit_code, f.signal, f.kind.value, _RANK_CAUSE.sub("", f.cause, count=1)


def _or_tail(report: ErrorReport, w: Worker, log_dir: str, tail_lines: int) -> ErrorReport:
    """The error file's report, else the rank's last lines: their last one is the cause
    of a rank that exited, not of one a signal ended (its lines only lead up to it)."""
    if report.message or report.traceback or report.problem is not None:
        return report
    tail = stderr_tail(log_dir, w.rank, tail_lines)
    return tail._replace(message="") if (w.outcome or 0) < 0 else tail


def report_of(w: Worker, uid: int | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
              log_dir: str = "", tail_lines: int = DEFAULT_TAIL_LINES) -> ErrorReport:
    """What a failed worker said: its error file, else the last lines of its output."""
    return _or_tail(read_error_file(w.error_file, uid, max_bytes), w, log_dir, tail_lines)


def most_to_blame(workers: list[Worker], uid: int | None = None,
                  max_bytes: int = DEFAULT_MAX_BYTES, log_dir: str = "",
                  tail_lines: int = DEFAULT_TAIL_LINES) -> tuple[Worker, ErrorReport] | None:
    """(worker, its report) of the failed worker to blame, or None: its error file,
    else (``log_dir`` given) the last ``tail_lines`` lines of its output."""
    candidates = []
    for w in workers:
        if w.outcome not in (None, 0) and (w.reported_error or not w.stopped_by_us):
            report = read_error_file(w.error_file, uid, max_bytes)
            candidates.append((blame_order(w.outcome, report.mtime), report.mtime, w.rank, w,
                               report))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[:3])
    _, _, _, w, report = candidates[0]
    return w, _or_tail(report, w, log_dir, tail_lines)


def describe(w: Worker, message: str,
             problem: workerfiles.Problem | None = None) -> tuple[int, int, str]:
    """(exit_code, signal, cause) of a failed worker: ``rank 1 exited with exit code 3: ...``."""
    exit_code, sig, text = describe_exit(w.outcome)
    cause = f"rank {w.rank} {'exited with ' if not sig else ''}{text}"
    if problem is not None:
        cause += f" ({UNREADABLE}: {problem.value})"
    elif message:
        cause += f": {message.splitlines()[0] if message.strip() else message}"
    return exit_code, sig, cause


def record(rank: int, exit_code: int, sig: int, cause: str, traceback: str, restart: int,
           node_id: str, kind: FailureKind = FailureKind.WORKER) -> Failure:
    """A failure seen now, as the job record keeps it (the proto's ``Failure``)."""
    return Failure(rank=rank, exit_code=exit_code, signal=sig, cause=cause,
                   traceback=traceback, time=time.time(), restart=restart, node_id=node_id,
                   kind=kind)


def worker_rows(workers: list[Worker], node_id: str) -> list[WorkerRow]:
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
        rows.append(WorkerRow(rank=w.rank, local_rank=w.local_rank, pid=w.pid, state=state,
                              exit_code=rc if rc is not None else 0, node_id=node_id,
                              create_time=started, start_path=w.start_path))
    return rows
