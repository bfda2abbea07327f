"""What the in-process wrapper tells the daemon: one JSON line per event, per rank.

Each rank of an ``--inprocess`` job gets ``ELASTICD_INPROCESS_REPORT``, a file
in the job's run dir, and ``elasticd.inprocess.Wrapper`` appends to it:

    {"kind": "restart", "iteration": N, "fault": "...", "fault_time": T0, "ready_time": T1}
        iteration N (> 0) is running on this rank: its process group is up again
    {"kind": "abandoned", "reason": "..."}
        in-process restart gave up on this rank; the process exits non-zero and
        the daemon's process restart takes over
    {"kind": "stuck", "reason": "..."}
        this rank's function could not be stopped (hung outside Python); the
        process ends itself and the daemon replaces it, the cause a hang
    {"kind": "forged", "record": "fault"}
        this rank ignored a record of that kind in the job store that failed
        authentication (someone else writes to the store); once per kind

The agent reads new lines once per monitor tick (a stat per rank when nothing
changed). The files are written by the job's user, so they are untrusted:
read with ``workerfiles.read`` (no links, no FIFOs, owned by the job's
user), at most ``MAX_READ`` bytes per tick, and any line that is not such an
object is skipped. A line that is one becomes a frozen ``Report`` (``parse_line``,
the one place it is built; ``to_dict`` its one form back), which the agent's
recovery reads (agent/recovery.py).
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass

from . import env as envnames
from . import files as workerfiles
from .. import fields
from ..values import BadValue, decode

log = logging.getLogger("elasticd.workers.inprocess_reports")

ENV = envnames.INPROCESS_REPORT
MAX_READ = 64 * 1024
_TEXT_LIMIT = 2000
_RECORD_LIMIT = 40   # the kind of a record, e.g. "fault", "done marker"


def report_path(run_dir: str, rank: int, restart_count: int) -> str:
    return os.path.join(run_dir, envnames.INPROCESS_REPORT_NAME.format(
        rank=rank, restart=restart_count))


class ReportKind(enum.Enum):
    RESTART = "restart"        # an in-process iteration runs again on the rank
    ABANDONED = "abandoned"    # in-process restart gave up on the rank
    STUCK = "stuck"            # the rank's function could not be stopped (a hang)
    FORGED = "forged"          # the rank ignored a job-store record that failed authentication


@dataclass(frozen=True)
class Report:
    """One rank's report, checked and trimmed; the fields its kind has."""
    kind: ReportKind
    iteration: int = 0          # RESTART: the iteration now running
    fault: str = ""             # RESTART: the fault it recovered from
    fault_time: float = 0.0     # RESTART: when the fault was seen, and when it ran again
    ready_time: float = 0.0
    reason: str = ""            # ABANDONED, STUCK: why
    record: str = ""            # FORGED: the kind of record ignored

    def to_dict(self) -> dict:
        if self.kind is ReportKind.RESTART:
            return {"kind": self.kind.value, "iteration": self.iteration,
                    "fault": self.fault, "fault_time": self.fault_time,
                    "ready_time": self.ready_time}
        if self.kind is ReportKind.FORGED:
            return {"kind": self.kind.value, "record": self.record}
        return {"kind": self.kind.value, "reason": self.reason}


def parse_line(line: bytes) -> Report | None:
    """One report, checked and trimmed; None for anything else."""
    try:
        data = decode(line, max_bytes=MAX_READ)
    except BadValue:
        return None
    kind = data.get("kind")
    try:
        if kind == "restart":
            return Report(ReportKind.RESTART,
                          iteration=fields.whole(data, "iteration", 0, 1 << 62),
                          fault=_text(data, "fault", _TEXT_LIMIT),
                          fault_time=fields.real(data, "fault_time", 0.0, 1e11, 0.0),
                          ready_time=fields.real(data, "ready_time", 0.0, 1e11, 0.0))
        if kind in ("abandoned", "stuck"):
            return Report(ReportKind(kind), reason=_text(data, "reason", _TEXT_LIMIT))
        if kind == "forged":
            return Report(ReportKind.FORGED, record=_text(data, "record", _RECORD_LIMIT))
    except ValueError:
        return None
    return None


def _text(data: dict, name: str, limit: int) -> str:
    value = data.get(name, "")
    return (value if isinstance(value, str) else str(value))[:limit]


class ReportReader:
    """Follows the report files of one process attempt. Owned by the agent thread."""

    def __init__(self) -> None:
        self._offsets: dict[str, int] = {}
        self._partial: dict[str, bytes] = {}

    def reset(self) -> None:
        self._offsets.clear()
        self._partial.clear()

    def poll(self, paths: dict[int, str],
             uid: int | None = None) -> list[tuple[int, Report]]:
        """New reports as (rank, report), from ``{rank: path}``; the files must be
        regular files owned by ``uid`` (the job's user; default: ours)."""
        owner = os.geteuid() if uid is None else uid
        out = []
        for rank, path in paths.items():
            for line in self._new_lines(path, owner):
                rec = parse_line(line)
                if rec is not None:
                    out.append((rank, rec))
        return out

    def _new_lines(self, path: str, uid: int) -> list[bytes]:
        offset = self._offsets.get(path, 0)
        size = workerfiles.regular_size(path)  # a stat per tick when nothing changed
        if size is None or size <= offset:
            return []
        got = workerfiles.read(path, uid, MAX_READ, offset=offset, whole=False)
        if not got.ok:
            return []
        data = got.data
        self._offsets[path] = offset + len(data)
        data = self._partial.pop(path, b"") + data
        lines = data.split(b"\n")
        if lines[-1]:
            if len(lines[-1]) < MAX_READ:
                self._partial[path] = lines[-1]
            else:
                log.warning("skipping an over-long line in %s", path)
        return [ln for ln in lines[:-1] if ln.strip()]
