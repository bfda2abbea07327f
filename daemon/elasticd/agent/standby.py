"""This node as a spare of a job: standing by beside the round's members, then taking a place.

A node that runs a job but is not in its closed round, at the round's max
nodes, stands by (rendezvous/round.py ``ClusterRendezvous._not_a_member``):
no ranks, its worker template warm. ``Standby`` is what the rendezvous asks
and tells on the agent's thread: whether this node may stand by at all (not
while it carries a drain mark: a draining or quarantined node takes no
ranks, so it withdraws), that it began to stand by in a round (the job's
reason, a ``spare`` event, the node's gauge of jobs it stands by for), and,
from the agent, that a round took it from standing by (an event naming the
members it replaced, the takeover counter).
"""
from __future__ import annotations

import logging
from typing import Callable

from ..jobs.registry import JobRegistry
from ..rendezvous.protocol import Result, RoundState
from ..rendezvous.round import ClusterRendezvous

log = logging.getLogger("elasticd.agent.loop")  # the agent's lines, as they always were


class Standby:
    def __init__(self, job_id: str, node_id: str, registry: JobRegistry,
                 rendezvous: ClusterRendezvous, quarantine=None, metrics=None,
                 where: Callable[[int], str] = str):
        self.job_id = job_id
        self._node_id = node_id
        self._registry = registry
        self._rdzv = rendezvous
        # () -> cluster/faults.NodeQuarantine (its ``drained``: the nodes with a drain
        # mark), or None (a standalone daemon)
        self._quarantine = quarantine
        self._metrics = metrics
        self._where = where
        self._withdrawn = False       # said once while drained
        self._beside: tuple = ()      # the members of the round it stands by in
        rendezvous.may_stand_by, rendezvous.on_standby = self.may_stand_by, self.began

    def may_stand_by(self) -> bool:
        """Not while this node carries a drain mark (draining, or quarantined)."""
        drained = self._quarantine().drained if self._quarantine is not None else frozenset()
        if self._node_id not in drained:
            self._withdrawn = False
            return True
        if not self._withdrawn:
            self._withdrawn = True
            self._say(0, "not standing by as a spare node: this node is draining or "
                         "quarantined (`elasticctl uncordon` takes it back)")
            self._gauge(False)
        return False

    def began(self, state: RoundState) -> None:
        """This node stands by in ``state``'s closed round (its max nodes)."""
        members = state.member_ids()
        self._beside = tuple(members)
        why = (f"standing by as a spare node: round {state.round} runs on its max "
               f"{len(members)} node(s) ({', '.join(members)[:300]}); this node takes the "
               "place of one that is lost")
        self._registry.update(self.job_id, reason=why)
        self._say(state.round, why)
        self._gauge(True)

    def joined(self, result: Result) -> None:
        """next_round returned ``result``: said if it took this node from standing by."""
        if self._rdzv.was_spare:
            self._took(result)

    def _took(self, result: Result) -> None:
        place = result.place
        last = place.rank_offset + self._nproc() - 1
        replaced = sorted(set(self._beside) - set(result.members))
        self._say(place.round, f"this spare node takes group rank {place.group_rank} (ranks "
                               f"{place.rank_offset}..{last} of {place.world_size})"
                  + (f" in place of {', '.join(replaced)[:300]}" if replaced else ""))
        self._gauge(False)
        if self._metrics is not None:
            self._metrics.spare_taken(self.job_id)

    def ended(self) -> None:
        self._gauge(False)

    def _nproc(self) -> int:
        return self._registry.get(self.job_id).nproc_per_node

    def _say(self, rnd: int, text: str) -> None:
        log.info("%s: %s", self._where(rnd or None), text)
        self._registry.event(self.job_id, "spare", f"round {rnd}: {text}" if rnd else text)

    def _gauge(self, standing: bool) -> None:
        if self._metrics is not None:
            self._metrics.spare_standing(self.job_id, standing)
