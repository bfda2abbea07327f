"""Whether a node's round still stands: the record ``ClusterRendezvous.status`` returns.

Each monitor tick the agent (and torchrun's handler) asks; the answer is one
``RoundStatus``: its ``kind``, the nodes it names (lost, or waiting to join),
the cause of the round that superseded ours (``protocol.RoundCause``), and
``why`` in words for the job's reason and the log (never parsed), and the
round state it was read from. No I/O.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .protocol import RoundCause, RoundState


class StatusKind(enum.Enum):
    CURRENT = "current"          # the round stands
    SUPERSEDED = "superseded"    # another node opened a new round: stop and rejoin
    FINAL = "final"              # the job ended cluster-wide
    LOST = "lost"                # member nodes' leases expired: open a new round
    WAITING = "waiting"          # nodes wait to join: the leader may open a new round


@dataclass(frozen=True)
class RoundStatus:
    kind: StatusKind
    why: str = ""
    nodes: tuple[str, ...] = ()               # LOST: the lost nodes; WAITING: those waiting
    cause: RoundCause = RoundCause.FAULT      # SUPERSEDED: why the new round opened
    # The job's round state the answer was read from (None: none was read).
    state: RoundState | None = field(default=None, compare=False, repr=False)


CURRENT = RoundStatus(StatusKind.CURRENT)
