"""``RoundPlace``: this node's place in a closed round (its ranks, the world, rank 0's
store), made by the rendezvous (rendezvous/protocol.py ``result_for``) and carried as
it is into the spawn spec its workers' environment is made from (spec.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundPlace:
    """This node's place in one round: which group rank it holds among how many
    nodes, its first global rank among how many, and where rank 0's store listens."""
    round: int
    group_rank: int
    group_world_size: int
    world_size: int
    rank_offset: int
    master_addr: str
    master_port: int

    @classmethod
    def before_any_round(cls, nproc: int, master_addr: str = "") -> "RoundPlace":
        """The place of what a node starts for a job as a whole, before any round (its
        template, round stores and job store): all of the job's ``nproc`` ranks, alone."""
        return cls(round=0, group_rank=0, group_world_size=1, world_size=nproc,
                   rank_offset=0, master_addr=master_addr, master_port=0)
