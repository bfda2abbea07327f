"""Where and how a job's workers run on this node: their spawn spec and their rows.

``Placement`` holds the job's GPUs and CPUs here (gpus/alloc.py ``Binding``,
the same for every attempt and replaced rank), asks the node's snapshot ledger
for the job's snapshot dir and budget each time it makes a spec
(workers/snapshot_dirs.py: computed where a group starts), and makes from the
job's record and its place in a round the ``GroupSpec`` its workers are spawned from
(``group_spec``), the one for what the node starts for the job as a whole
(``node_spec``: its template, round stores and job store), and the worker
rows the job's record and the cluster get (``worker_rows``).
"""
from __future__ import annotations

import dataclasses
import os

from ..config import Config
from ..gpus.alloc import Binding
from ..jobs.records import WorkerRow
from ..jobs.registry import JobRecord
from ..workers.group import GroupSpec, WorkerGroup
from ..workers.round_place import RoundPlace
from ..workers.snapshot_dirs import SnapshotBudgets
from . import failures


class Placement:
    def __init__(self, cfg: Config, binding: Binding, snapshots: SnapshotBudgets | None = None):
        self._cfg = cfg
        self.binding = binding
        self._snapshots = snapshots

    def group_spec(self, job: JobRecord, place: RoundPlace) -> GroupSpec:
        d = self._cfg.daemon
        return GroupSpec(
            job_id=job.id, command=tuple(job.command), cwd=job.cwd, env=job.env,
            uid=job.uid, gid=job.gid, nproc=job.nproc_per_node,
            restart_count=job.restarts, max_restarts=job.max_restarts, place=place,
            log_dir=self.log_dir(job),
            run_dir=os.path.join(self._cfg.jobs_run_dir, job.id), node_id=d.node_id,
            device_env=self.binding.env(), cpus=self.binding.cpus,
            snapshot=self._snapshots.grant(job.id) if self._snapshots is not None else None)

    def log_dir(self, job: JobRecord) -> str:
        return os.path.join(self._cfg.logs_dir, job.id)

    def node_spec(self, job: JobRecord, master_addr: str = "") -> GroupSpec:
        """The job's spawn spec before any round: for what this node starts for the job
        as a whole (its template, round stores and job store), not for one round's ranks."""
        return self.group_spec(job, RoundPlace.before_any_round(job.nproc_per_node, master_addr))

    def worker_rows(self, group: WorkerGroup) -> list[WorkerRow]:
        b = self.binding  # every worker of the job here: the whole set (LOCAL_RANK indexes)
        return [dataclasses.replace(row, gpus=tuple(b.indices),
                                    gpu_uuids=tuple(g.uuid for g in b.gpus), cpus=b.cpus_text)
                for row in failures.worker_rows(group.workers, self._cfg.daemon.node_id)]
