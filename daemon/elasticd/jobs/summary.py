"""A node's recovery summary of a job: the typed, frozen ``RecoverySummary``.

Each node that runs a job publishes, with its worker rows, what it counted of
the job's recovery (rendezvous/round.py ``publish_workers``): restarts per
layer, the budgets, its last failure (bounded), its latest ladder attempts.
``JobRecord.recovery_summary`` builds it; ``to_dict`` is the one form it is
shared in; ``from_dict`` reads a peer's back where it enters (the jobs view,
rendezvous/view.py), checked field by field; control/remote_jobs.py merges
every node's into the record a node that does not run the job shows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .ladder import Attempt
from .records import Failure, clamp_int

CAUSE_SHARED = 500     # characters of an attempt's cause a node shares
ATTEMPTS_SHARED = 10   # the latest attempts a node shares
ATTEMPTS_READ = 20     # the latest attempts read from a peer's summary


@dataclass(frozen=True)
class RecoverySummary:
    restarts_by_layer: dict            # layer -> restarts this node counted
    restart_budget: dict               # layer -> its budget (-1: none)
    last_failure: Failure | None = None
    attempts: tuple[Attempt, ...] = ()

    def to_dict(self) -> dict:
        return {"restarts_by_layer": dict(self.restarts_by_layer),
                "restart_budget": dict(self.restart_budget),
                "last_failure": self.last_failure.to_dict() if self.last_failure else None,
                "attempts": [a.to_dict() for a in self.attempts]}

    @classmethod
    def of_record(cls, restarts_by_layer: dict, restart_budget: dict,
                  last_failure: Failure | None, attempts) -> "RecoverySummary":
        """What this node shares of a job record's recovery, size-bounded."""
        return cls(dict(restarts_by_layer), dict(restart_budget),
                   last_failure.bounded() if last_failure else None,
                   tuple(replace(a, cause=a.cause[:CAUSE_SHARED])
                         for a in list(attempts)[-ATTEMPTS_SHARED:]))

    @classmethod
    def from_dict(cls, d: dict, node: str) -> "RecoverySummary":
        """Node ``node``'s published summary, checked field by field; AttributeError,
        TypeError, ValueError or OverflowError for one that does not parse."""
        layers = {str(k): clamp_int(v) for k, v in (d.get("restarts_by_layer") or {}).items()}
        limits = {str(k): clamp_int(v) for k, v in (d.get("restart_budget") or {}).items()}
        f = d.get("last_failure")
        f = Failure.from_dict(f, node).bounded() if isinstance(f, dict) else None
        tried = tuple(_attempt(a, node) for a in (d.get("attempts") or [])[-ATTEMPTS_READ:]
                      if isinstance(a, dict))
        return cls(layers, limits, f, tried)


def _attempt(a: dict, node: str) -> Attempt:
    got = Attempt.from_dict(a, node)
    return replace(got, cause=got.cause[:CAUSE_SHARED])
