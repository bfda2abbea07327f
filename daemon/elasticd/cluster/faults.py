"""A node's fault record in etcd and the quarantine decision over it, without I/O.

Each node keeps one record at ``/v1/faults/<node>`` (``fault_key``): the
faults it owns (``node_owned``: a GPU health failure, a lost lease, a worker
killed by a signal that points at the machine; never a job's own failure),
newest ``MAX_FAULTS`` within the window, whether it is quarantined, and when
an operator last released it. The key is under no
lease, so the record outlives the node's daemon and its lease. Its only
writer is the node itself (cluster/quarantine.py): one writer per key, no
race between peers, and a peer cut off from the node cannot blame it.

``judge`` decides: quarantined once at least ``threshold`` faults fell
within ``window`` seconds of ``now``, counting only faults after the last
release (an uncordon forgives what came before it). ``threshold`` 0: never.
``FaultBook.to_json`` and ``FaultBook.from_doc`` are the record's one
serialisation and its one validation (a record read back is checked field by
field, as anything from etcd).
"""
from __future__ import annotations

import enum
import json
import signal
from dataclasses import dataclass, field

from .. import fields

FAULTS = "/v1/faults"
MAX_FAULTS = 100        # faults kept per node; the oldest fall out first
MAX_DETAIL = 200        # characters of one fault's detail
MAX_REASONS = 5         # reasons a quarantine names (its newest faults)
MAX_LINE = 500          # characters of one reason


def fault_key(node_id: str) -> str:
    return f"{FAULTS}/{node_id}"


class FaultKind(str, enum.Enum):
    """What went wrong on the node: the metric's ``cause`` label."""
    WORKER_EXIT = "worker_exit"     # a worker died of a signal that points at the machine
    HANG = "hang"                   # its in-process wrapper reported a rank stuck (hang)
    GPU_HEALTH = "gpu_health"       # the pre-start GPU health check failed
    LEASE_LOST = "lease_lost"       # the node's lease expired under it


# The job events that may be faults of the node they happened on (``node_owned`` decides).
EVENT_FAULTS = {"worker_exit": FaultKind.WORKER_EXIT, "hang": FaultKind.HANG,
                "gpu_health": FaultKind.GPU_HEALTH}

# Signals that say the machine failed its worker, not the job: SIGBUS is how the
# kernel ends a process that touched memory it found broken (an uncorrectable ECC
# error, a machine check), whatever the job's code.
MACHINE_SIGNALS = frozenset({int(signal.SIGBUS)})


def node_owned(kind: FaultKind, sig: int = 0) -> bool:
    """Whether a fault of ``kind`` is the node's (it counts toward quarantine), not its job's.

    A failed GPU health check and a lease lost under a running daemon are the
    node's. A worker's exit is its job's (the user's exception, a kill someone
    sent, the job's own memory use: the OOM killer's SIGKILL cannot be told from
    an operator's), unless its signal ``sig`` is a MACHINE_SIGNALS one. A rank
    reported stuck is not the node's either: a stuck collective waits as often
    for a peer or for the job's own code as for this node's GPU or network, and
    nothing here says which. Counting the job's faults would quarantine every
    node a broken job runs on, one after another.
    """
    if kind in (FaultKind.GPU_HEALTH, FaultKind.LEASE_LOST):
        return True
    if kind is FaultKind.WORKER_EXIT:
        return sig in MACHINE_SIGNALS
    return False


@dataclass(frozen=True)
class Fault:
    time: float
    kind: FaultKind
    job_id: str = ""        # "" for a lost lease
    detail: str = ""
    attempt: int = 0        # the job's restart count when it happened

    def key(self) -> tuple:
        """Its identity: one fault per kind per job attempt (a job's failed attempt
        counts once however many of its events say so)."""
        return (self.kind, self.job_id, self.attempt) if self.job_id else \
            (self.kind, "", self.time)

    def line(self) -> str:
        where = f" (job {self.job_id})" if self.job_id else ""
        return f"{self.kind.value}{where}: {self.detail}"[:MAX_LINE]


@dataclass(frozen=True)
class NodeQuarantine:
    """This node's quarantine as its agents see it: why (() when it is not), and
    the nodes of the cluster with a drain mark (drained or quarantined)."""
    reasons: tuple = ()
    drained: frozenset = frozenset()


@dataclass(frozen=True)
class Verdict:
    quarantine: bool
    faults: tuple = ()       # the faults that count, oldest first
    reason: str = ""         # one line; "" when not quarantined

    def causes(self) -> dict:
        """Faults that count by kind value."""
        out: dict[str, int] = {}
        for f in self.faults:
            out[f.kind.value] = out.get(f.kind.value, 0) + 1
        return out


def judge(faults, now: float, window: float, threshold: int,
          released_at: float = 0.0) -> Verdict:
    """Whether the node with ``faults`` (Fault records) is to be quarantined at ``now``."""
    counted = tuple(sorted((f for f in faults
                            if max(now - window, released_at) < f.time <= now),
                           key=lambda f: f.time))
    if threshold <= 0 or len(counted) < threshold:
        return Verdict(False, counted)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(Verdict(True, counted).causes().items()))
    return Verdict(True, counted, f"{len(counted)} faults in the last {window:g}s ({kinds}; "
                                  f"cluster.quarantine_faults {threshold})")


def reasons(verdict: Verdict) -> tuple:
    """What a quarantine names: its summary, then its newest faults, one line each."""
    return (verdict.reason,) + tuple(f.line() for f in verdict.faults[-(MAX_REASONS - 1):])


@dataclass(frozen=True)
class FaultBook:
    """One node's record: its faults, whether it is quarantined, its last release."""
    faults: tuple = ()
    quarantined: bool = False
    released_at: float = 0.0
    reasons: tuple = field(default=())   # the quarantine's, while quarantined

    def add(self, fault: Fault, now: float, window: float) -> "FaultBook":
        """With ``fault``, the aged-out and the oldest over MAX_FAULTS dropped."""
        kept = [f for f in self.faults if f.time > now - window] + [fault]
        kept.sort(key=lambda f: f.time)
        return FaultBook(tuple(kept[-MAX_FAULTS:]), self.quarantined, self.released_at,
                         self.reasons)

    def to_json(self, max_bytes: int) -> str:
        """The body, the oldest faults left out until it fits ``max_bytes``."""
        faults = list(self.faults[-MAX_FAULTS:])
        while True:
            body = json.dumps({
                "faults": [{"time": f.time, "kind": f.kind.value, "job_id": f.job_id,
                            "detail": f.detail[:MAX_DETAIL], "attempt": f.attempt}
                           for f in faults],
                "quarantined": self.quarantined, "released_at": self.released_at,
                "reasons": [r[:MAX_LINE] for r in self.reasons[:MAX_REASONS]]})
            if len(body.encode("utf-8")) <= max_bytes or not faults:
                return body
            faults = faults[len(faults) // 4 + 1:]

    @classmethod
    def from_doc(cls, doc: dict) -> "FaultBook":
        """The record from its decoded body; ValueError names a bad field."""
        raw = doc.get("faults", [])
        if not isinstance(raw, list) or len(raw) > MAX_FAULTS:
            raise ValueError(f"faults: not a list of at most {MAX_FAULTS}")
        faults = []
        for item in raw:
            if not isinstance(item, dict):
                raise ValueError("faults: an item is not an object")
            try:
                kind = FaultKind(item.get("kind"))
            except ValueError:
                raise ValueError("faults: an unknown kind") from None
            job = fields.text(item, "job_id", fields.MAX_ID, "")
            faults.append(Fault(fields.real(item, "time", 0.0, 1e11), kind, job,
                                fields.text(item, "detail", MAX_DETAIL, ""),
                                fields.whole(item, "attempt", 0, 2**31, 0)))
        return cls(tuple(faults), fields.flag(doc, "quarantined", False),
                   fields.real(doc, "released_at", 0.0, 1e11, 0.0), reason_lines(doc))


def reason_lines(doc: dict) -> tuple:
    """``doc["reasons"]`` (a fault record's or a drain mark's), checked; ValueError if bad."""
    said = doc.get("reasons", [])
    if not isinstance(said, list) or len(said) > MAX_REASONS or not all(
            isinstance(r, str) and len(r) <= MAX_LINE for r in said):
        raise ValueError(f"reasons: not a list of at most {MAX_REASONS} lines")
    return tuple(said)
