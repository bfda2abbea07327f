"""Who replicates to whom: the push plans of the jobs running here and the targets that
accept peers' replicas, read from the job manager, the jobs view and the node records.

A job replicates while it runs here in a closed round of two nodes or more: its
buddy is the next member in the round's order (the ranks' order), found at the
address the round names and the replication port its node record publishes (both
sealed with the cluster key, so nobody without it can redirect replicas); the
replicas it keeps go on to the members that hold their ranks now (forward plans).
A job accepts replicas while its agent runs here and its snapshot dir exists.
"""
from __future__ import annotations

import os

from ..rendezvous.records import CLOSED
from .forwarder import ForwardPlan, Holder
from .pusher import PushPlan, buddy_of
from ..workers.snapshot_status import SnapshotRow, row_of
from .receiver import ReplicaTarget


class Peers:
    def __init__(self, node_id: str, manager, registry, view, nodes):
        # manager: coordinator (active_jobs, snapshots); registry: jobs by id;
        # view: rendezvous/view.py JobsView; nodes: cluster/membership.py NodeWatcher
        # (its record(node) reads a peer's record once and keeps it)
        self._me, self._manager, self._registry = node_id, manager, registry
        self._view, self._nodes = view, nodes

    def _job(self, job_id: str):
        try:
            return self._registry.get(job_id)
        except Exception:   # gone since it was listed
            return None

    def row(self, job_id: str, stats) -> "SnapshotRow | None":
        """This node's snapshot row of a job here, for a peer's status (asking.py)."""
        job = self._job(job_id)
        return row_of(self._manager.snapshots, job if job is not None and job.id == job_id
                      else None, stats.of_job(job_id))

    def _rounds(self):
        """(job id, job record, closed round state) of each job running here in a closed
        round."""
        for job_id in self._manager.active_jobs():
            keys, job = self._view.job(job_id), self._job(job_id)
            state = keys.state if keys is not None else None
            if job is not None and state is not None and state.status == CLOSED \
                    and self._me in state.member_ids():
                yield job_id, job, state

    def _port(self, node_id: str) -> int:
        """The replication port ``node_id``'s live record publishes (0: none): read once
        and kept while its key lives (cluster/membership.py NodeWatcher.record)."""
        return int((self._nodes.record(node_id) or {}).get("replication_port") or 0)

    def plans(self) -> list[PushPlan]:
        ledger = self._manager.snapshots
        if ledger is None:
            return []
        out = []
        for job_id, job, state in self._rounds():
            ids = state.member_ids()
            buddy = buddy_of(ids, self._me)
            port = self._port(buddy) if buddy else 0
            if not port:
                continue
            at = ids.index(self._me)
            offset = sum(m.nproc for m in state.members[:at])
            ranks = tuple(range(offset, offset + state.members[at].nproc))
            out.append(PushPlan(job_id, ledger.path(job_id), job.uid, ranks,
                                sum(m.nproc for m in state.members), buddy,
                                state.members[ids.index(buddy)].address, port))
        return out

    def forward_plans(self) -> list[ForwardPlan]:
        """Each job running here in a closed round, with the members that hold its
        other ranks and publish a replication port (forwarder.py)."""
        ledger = self._manager.snapshots
        if ledger is None:
            return []
        out = []
        for job_id, job, state in self._rounds():
            holders, mine, first = [], (), 0
            for m in state.members:
                if m.node_id == self._me:
                    mine = tuple(range(first, first + m.nproc))
                else:
                    port = self._port(m.node_id)
                    if port:
                        holders.append(Holder(m.node_id, m.address, port, first, m.nproc))
                first += m.nproc
            if holders:
                out.append(ForwardPlan(job_id, ledger.path(job_id), job.uid, first, mine,
                                       tuple(holders)))
        return out

    def target(self, job_id: str) -> ReplicaTarget | None:
        ledger = self._manager.snapshots
        if ledger is None or job_id not in self._manager.active_jobs():
            return None
        job, budget = self._job(job_id), ledger.granted(job_id)
        path = ledger.path(job_id)
        if job is None or budget is None or not os.path.isdir(path):
            return None
        return ReplicaTarget(path, job.uid, job.gid, budget)
