"""Typed records that cross module boundaries: a worker-group failure, a worker row.

A failure is built by the agent (agent/loop.py) from what a worker's end said
(agent/failures.py), rewritten as a hang by hang detection (hangs/detector.py) or by
the in-process layer (agent/recovery.py), kept on the job record (jobs/registry.py),
published to the other nodes (in a jobs/summary.py ``RecoverySummary``, read back
where it enters, rendezvous/view.py), counted in the metrics and sent to ``elasticctl``
(control/messages.py). It is serialised in one place: ``to_dict`` / ``from_dict``
here, the JSON kept in the state dir and in etcd. ``from_dict`` reads what
an older release wrote (any key missing takes its default) and what another
node published (a value of the wrong type raises ValueError or TypeError,
for the caller to skip that record; ``bounded()`` cuts what a peer sent).

A worker row is one worker as ``elasticctl status`` shows it: built by
failures.worker_rows on the node that runs it, kept on the job record,
published to the other nodes (``published`` reads a peer's back, in the jobs
view) and sent as the proto's ``Worker`` (control/messages.py). Same rules:
``to_dict`` / ``from_dict``, the JSON form of before.

No I/O; of the daemon only jobs/states.py.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .states import WorkerState

CAUSE_LIMIT = 2000        # characters of a failure's cause kept when shared
TRACEBACK_LIMIT = 4000    # characters of its traceback (the end) kept when shared


class FailureKind(str, enum.Enum):
    """What kind of fault a failure was, where its exit alone does not say."""
    WORKER = ""                                    # a worker exited non-zero or by a signal
    HANG = "hang"                                  # a rank made no progress and was ended
    UNREADABLE_ERROR_FILE = "unreadable_error_file"  # its error file was not safe to read
    NODE_LOST = "node_lost"                        # a member node's lease expired


def clamp_int(value) -> int:
    """An int32 from an untrusted value (ValueError/TypeError when it is none)."""
    return max(-2**31, min(2**31 - 1, int(value)))


@dataclass(frozen=True)
class Failure:
    """One worker-group failure as the job record keeps it (the proto's ``Failure``)."""
    rank: int = -1
    exit_code: int = 0
    signal: int = 0
    cause: str = ""
    traceback: str = ""
    time: float = 0.0            # unix time it was seen
    restart: int = 0             # the job's restart count when it happened
    node_id: str = ""
    kind: FailureKind = FailureKind.WORKER

    @property
    def exit_status(self) -> int:
        """The job's exit code for it: the worker's, or 128 + the signal that ended it."""
        return self.exit_code if self.exit_code > 0 else 128 + self.signal

    def bounded(self) -> "Failure":
        """The failure with its cause and traceback cut to what is shared with peers."""
        return replace(self, cause=self.cause[:CAUSE_LIMIT],
                       traceback=self.traceback[-TRACEBACK_LIMIT:])

    def to_dict(self) -> dict:
        """The JSON form (state dir, etcd); ``kind`` only when there is one."""
        d = {"rank": self.rank, "exit_code": self.exit_code, "signal": self.signal,
             "cause": self.cause, "traceback": self.traceback, "time": self.time,
             "restart": self.restart, "node_id": self.node_id}
        if self.kind is not FailureKind.WORKER:
            d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, d: dict, node_id: str = "") -> "Failure":
        """A failure from its JSON form; ``node_id`` where the record names none.
        An unknown ``kind`` reads as a worker fault."""
        if not isinstance(d, dict):
            raise TypeError(f"a failure record is an object, not {type(d).__name__}")
        try:
            kind = FailureKind(d.get("kind") or "")
        except ValueError:
            kind = FailureKind.WORKER
        return cls(rank=clamp_int(d.get("rank", -1)), exit_code=clamp_int(d.get("exit_code", 0)),
                   signal=clamp_int(d.get("signal", 0)),
                   cause=str(d.get("cause", "")), traceback=str(d.get("traceback", "")),
                   time=float(d.get("time", 0)), restart=clamp_int(d.get("restart", 0)),
                   node_id=str(d.get("node_id") or node_id), kind=kind)


@dataclass(frozen=True)
class WorkerRow:
    """One worker of a job as status shows it (the proto's ``Worker``)."""
    rank: int
    local_rank: int
    pid: int
    state: WorkerState
    exit_code: int = 0
    node_id: str = ""
    create_time: float = 0.0     # its process's start (psutil), 0 once it ended; local only
    gpus: tuple[int, ...] = ()       # its job's devices on this node (LOCAL_RANK indexes them)
    gpu_uuids: tuple[str, ...] = ()
    cpus: str = ""                   # its CPU affinity as a list ("0-7,16-23"); "" when unbound
    start_path: str = ""             # template | spare | cold: how its process came to be

    def to_dict(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
                "state": self.state.value, "exit_code": self.exit_code,
                "node_id": self.node_id, "create_time": self.create_time,
                "gpus": list(self.gpus), "gpu_uuids": list(self.gpu_uuids), "cpus": self.cpus,
                "start_path": self.start_path}

    @classmethod
    def published(cls, rows: list, node_id: str) -> tuple["WorkerRow", ...]:
        """A peer's published rows (node ``node_id``'s), those that parse; its
        clock's create_time is not ours to use."""
        out = []
        for d in rows:
            try:
                row = cls.from_dict(d, node_id)  # bounds the GPU binding too
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
            out.append(replace(row, create_time=0.0))
        return tuple(out)

    @classmethod
    def from_dict(cls, d: dict, node_id: str | None = None) -> "WorkerRow":
        """A row from its JSON form; ``node_id`` (a peer's rows: the node that
        published them) wins over the row's own. KeyError, TypeError or
        ValueError (an unknown state among them) for a row that does not parse."""
        if not isinstance(d, dict):
            raise TypeError(f"a worker row is an object, not {type(d).__name__}")
        gpus, uuids = d.get("gpus") or [], d.get("gpu_uuids") or []
        if not isinstance(gpus, list) or not isinstance(uuids, list) or len(gpus) > 64 \
                or len(uuids) > 64:
            raise ValueError("bad GPU binding")
        return cls(rank=int(d["rank"]), local_rank=int(d["local_rank"]), pid=int(d["pid"]),
                   state=WorkerState(str(d["state"])), exit_code=int(d["exit_code"]),
                   node_id=str(node_id if node_id is not None else d.get("node_id", "")),
                   create_time=float(d.get("create_time") or 0.0),
                   gpus=tuple(int(i) for i in gpus), gpu_uuids=tuple(str(u)[:100] for u in uuids),
                   cpus=str(d.get("cpus") or "")[:2000],
                   start_path=str(d.get("start_path") or "")[:20])
