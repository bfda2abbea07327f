"""The restart ladder: which layer recovers a fault, and the record of every climb.

Layers, fastest first (DESIGN.md "Restart layers"):

* ``inprocess``: the ranks re-enter the training function in the same
  processes (elasticd.inprocess.Wrapper); a rank that died is replaced by a
  new process that joins the next iteration. Budget: ``inprocess.max_restarts``
  iterations per process attempt (a job's ``--env
  ELASTICD_INPROCESS_MAX_RESTARTS`` wins); it gives up when a fault repeats
  ``inprocess.repeat_limit`` times within ``inprocess.repeat_window``, or when
  the ranks do not all meet within ``inprocess.barrier_timeout``.
* ``process``: the node's worker group is stopped and started again, in a new
  round with the same nodes. Budget: the job's ``max_restarts``, counted once
  cluster-wide; backoff ``agent.restart_backoff_*``.
* ``rendezvous``: a node was lost or one waits to join: a new round with other
  nodes. It draws on the same cluster-wide ``max_restarts`` when a fault came
  with it (as torchrun counts it); below the job's minimum nodes it ends after
  ``rendezvous.join_timeout``.

Each layer falls back to the next when it cannot recover. The agent owns one
``Ladder`` per job; every climb is an ``Attempt`` (layer, cause, time, how
long until the workers ran again, outcome), kept on the job record, so
``elasticctl status`` shows the cause chain and a FAILED job says how it got
there. Nothing here does I/O.
"""
from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, field, replace

from .records import clamp_int

MAX_ATTEMPTS_KEPT = 50
CHAIN_TEXT_LIMIT = 1000
_RANK_PREFIX = re.compile(r"rank (\d+):")  # how the wrapper's fault texts begin


class Layer(str, enum.Enum):
    INPROCESS = "inprocess"
    PROCESS = "process"
    RENDEZVOUS = "rendezvous"


class Outcome(str, enum.Enum):
    PENDING = "pending"        # the layer is at work
    RECOVERED = "recovered"    # workers ran again
    FELL_BACK = "fell_back"    # the layer gave up; the next one took over
    FAILED = "failed"          # no layer left: the job failed


@dataclass(frozen=True)
class Attempt:
    """One climb of the ladder (a recovery attempt), as the job record keeps it
    (the proto's ``RecoveryAttempt``). Its JSON form (state dir, the summary
    published to the other nodes) is ``to_dict``/``from_dict``, here only."""
    layer: Layer
    cause: str
    time: float                 # unix time of the fault
    rank: int = -1
    node_id: str = ""
    duration: float = 0.0       # fault -> workers running again
    outcome: Outcome = Outcome.PENDING

    def to_dict(self) -> dict:
        return {"layer": self.layer.value, "cause": self.cause, "time": self.time,
                "rank": self.rank, "node_id": self.node_id, "duration": self.duration,
                "outcome": self.outcome.value}

    @classmethod
    def from_dict(cls, d: dict, node_id: str = "") -> "Attempt":
        """An attempt from its JSON form (``node_id`` where it names none); a value
        of the wrong type, or a layer or outcome this release does not know,
        raises ValueError or TypeError."""
        if not isinstance(d, dict):
            raise TypeError(f"an attempt is an object, not {type(d).__name__}")
        return cls(layer=Layer(str(d.get("layer", ""))), cause=str(d.get("cause", "")),
                   time=float(d.get("time", 0)), rank=clamp_int(d.get("rank", -1)),
                   node_id=str(d.get("node_id") or node_id),
                   duration=float(d.get("duration", 0)),
                   outcome=Outcome(str(d.get("outcome", ""))))


def chain_text(attempts: list[Attempt], limit: int = CHAIN_TEXT_LIMIT) -> str:
    """``inprocess x2 (rank 1: ...) -> process x1 (...)``: consecutive climbs of a
    layer folded into one step, each with its latest cause."""
    steps: list[list] = []   # [layer, count, last cause]
    for a in attempts:
        if steps and steps[-1][0] == a.layer.value:
            steps[-1][1] += 1
            steps[-1][2] = a.cause
        else:
            steps.append([a.layer.value, 1, a.cause])
    text = " -> ".join(f"{layer} x{n} ({_short(cause, 120)})" for layer, n, cause in steps)
    if len(text) > limit:
        text = "... " + text[-(limit - 4):]
    return text


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


@dataclass
class Ladder:
    """One job's climbs on this node. Owned by the job's agent thread."""
    node_id: str
    inprocess_budget: int       # in-process restarts per process attempt (0: layer off)
    restarts_by_layer: dict = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)   # oldest first
    pending: Attempt | None = None   # a process/rendezvous climb waiting for RUNNING
    # -- the in-process layer, per process attempt --
    iterations_seen: int = 0    # the highest in-process iteration the ranks reported
    replacements: int = 0       # ranks replaced in this process attempt
    replaced_cause: str = ""    # why the latest replacement: the cause of the next iteration
    replaced_at: float = 0.0
    replaced_rank: int = -1
    abandoned: str = ""         # a rank said in-process restart gave up, and why
    abandoned_rank: int = -1

    @classmethod
    def from_record(cls, node_id: str, inprocess_budget: int, restarts_by_layer: dict,
                    attempts: list[Attempt]) -> "Ladder":
        return cls(node_id, inprocess_budget, dict(restarts_by_layer), list(attempts))

    # -- the in-process layer ----------------------------------------------------
    def new_process_attempt(self) -> None:
        self.iterations_seen = self.replacements = 0
        self.replaced_cause, self.replaced_at, self.abandoned = "", 0.0, ""
        self.replaced_rank = self.abandoned_rank = -1

    def inprocess_left(self) -> int:
        """Ranks the in-process layer may still replace in this process attempt."""
        if self.abandoned:
            return 0
        used = max(self.iterations_seen, self.replacements)
        return max(0, self.inprocess_budget - used)

    def replaced(self, cause: str, at: float, rank: int) -> None:
        self.replacements += 1
        self.replaced_cause, self.replaced_at, self.replaced_rank = cause, at, rank
        self._count(Layer.INPROCESS, count=False)

    def iteration_started(self, iteration: int, fault: str, fault_time: float,
                          ready_time: float, rank: int) -> Attempt | None:
        """A rank reported iteration ``iteration`` running; the climb, if it is news."""
        if iteration <= self.iterations_seen:
            return None
        self.iterations_seen = iteration
        cause, since = fault, fault_time
        m = _RANK_PREFIX.match(fault)
        rank = int(m.group(1)) if m else rank
        if self.replaced_cause:  # a dead rank, replaced: its death is the cause, not the
            # "connection closed" the others saw first
            cause, rank = self.replaced_cause, self.replaced_rank
            since = min(fault_time, self.replaced_at) or fault_time
            self.replaced_cause, self.replaced_at, self.replaced_rank = "", 0.0, -1
        a = Attempt(Layer.INPROCESS, cause, since, rank=rank, node_id=self.node_id,
                    duration=max(0.0, ready_time - since), outcome=Outcome.RECOVERED)
        self._count(Layer.INPROCESS)
        self._keep(a)
        return a

    def gave_up(self, reason: str, rank: int = -1) -> None:
        if not self.abandoned:
            self.abandoned, self.abandoned_rank = reason, rank

    # -- the process and rendezvous layers --------------------------------------
    def begin(self, layer: Layer, cause: str, at: float, rank: int = -1) -> Attempt:
        """A process or rendezvous climb starts; it ends at ``recovered`` or ``failed``."""
        a = Attempt(layer, cause, at, rank=rank, node_id=self.node_id)
        self.pending = a
        self._count(layer)
        self._keep(a)
        return a

    def recovered(self, now: float | None = None) -> Attempt | None:
        """The workers run again: the pending climb recovered (None if none was pending)."""
        a, self.pending = self.pending, None
        if a is None:
            return None
        now = time.time() if now is None else now
        a = replace(a, duration=max(0.0, now - a.time), outcome=Outcome.RECOVERED)
        self._replace_last(a)
        return a

    def failed(self, layer: Layer, cause: str, at: float, rank: int = -1) -> str:
        """No layer can recover: record it; returns the cause chain for the job's reason."""
        if self.pending is not None:
            self._replace_last(replace(self.pending, outcome=Outcome.FELL_BACK))
            self.pending = None
        self._keep(Attempt(layer, cause, at, rank=rank, node_id=self.node_id,
                           outcome=Outcome.FAILED))
        return chain_text(self.attempts)

    # -- bookkeeping ---------------------------------------------------------------
    def _count(self, layer: Layer, count: bool = True) -> None:
        if count:
            self.restarts_by_layer[layer.value] = self.restarts_by_layer.get(layer.value, 0) + 1
        else:
            self.restarts_by_layer.setdefault(layer.value, 0)

    def _keep(self, a: Attempt) -> None:
        self.attempts.append(a)
        del self.attempts[:-MAX_ATTEMPTS_KEPT]

    def _replace_last(self, a: Attempt) -> None:
        """The kept climb ``a`` is a later look at (same fault) becomes ``a``."""
        for i in range(len(self.attempts) - 1, -1, -1):
            old = self.attempts[i]
            if old.time == a.time and old.layer == a.layer and old.cause == a.cause:
                self.attempts[i] = a
                return
        self._keep(a)
