"""Rendezvous for a daemon in standalone mode: the group is this node alone.

The result type is shared with the cluster rendezvous: plain data saying
which round this is, this node's place in it, and where rank 0 listens.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RendezvousResult:
    round: int
    group_rank: int            # this node's rank among the nodes
    group_world_size: int      # nodes in the round
    world_size: int            # worker processes in the round
    rank_offset: int           # global rank of this node's local rank 0
    master_addr: str
    master_port: int
    members: tuple = ()        # node ids, in group-rank order


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRendezvous:
    """Every round is complete at once: one node, all of the job's ranks here."""

    def __init__(self, node_id: str, master_addr: str = "127.0.0.1"):
        self._node_id = node_id
        self._master_addr = master_addr

    def next_round(self, job) -> RendezvousResult:
        return RendezvousResult(
            round=job.round + 1, group_rank=0, group_world_size=1,
            world_size=job.nproc_per_node, rank_offset=0,
            master_addr=self._master_addr, master_port=free_port(self._master_addr),
            members=(self._node_id,))
