"""Resuming at start the jobs a previous daemon on this node left unfinished.

Each live record is looked at once, against the cluster's word on the job
(rendezvous/view.py): a job the cluster ended is ended here as it ended
there; one whose cancel was asked is cancelled; one the cluster still runs
is rejoined (RESTARTING); one the store forgot (the in-memory store of a
standalone daemon) starts again as a counted restart while its budgets
allow (jobs/restartpolicy.plan_forgotten). Workers the previous daemon left
running are killed first (node/leftovers.py). The coordinator then
schedules what was resumed.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from .leftovers import kill_leftover_workers
from ..config import Config
from ..jobs.registry import JobRecord, JobRegistry
from ..jobs.restartpolicy import RestartWindow, plan_forgotten
from ..jobs.spec import JobSpec
from ..jobs.states import LIVE_STATES, JobState, WorkerState
from ..logsetup import ctx
from ..rendezvous.round import create_job
from ..store import StoreError

log = logging.getLogger("elasticd.coordinator")  # the coordinator's lines, as they were


class Resumer:
    """One pass over this node's live records at start (``resume``)."""

    def __init__(self, cfg: Config, registry: JobRegistry, view, store, codec):
        self._cfg = cfg
        self._registry = registry
        self._view = view
        self._store = store
        self._codec = codec

    def resume(self, end_from_cluster: Callable) -> None:
        """Pick up jobs a previous daemon left unfinished; ``end_from_cluster(job_id,
        state)`` records the end of one the cluster finished meanwhile."""
        self._view.synced.wait(self._cfg.membership.startup_timeout)
        for job in self._registry.list():
            if job.state not in LIVE_STATES:
                continue
            killed = kill_leftover_workers(job.workers)
            where = ctx(job=job.id, node=self._cfg.daemon.node_id, round=job.round)
            if killed:
                log.warning("%s: killed %d worker(s) left by the previous daemon", where,
                            killed)
            if any(w.state is WorkerState.RUNNING for w in job.workers):
                # None of them runs now: status must not list them (this node may
                # come back as a spare while another node holds their ranks).
                job = self._registry.update(job.id, workers=[
                    dataclasses.replace(w, state=WorkerState.STOPPED, create_time=0.0)
                    if w.state is WorkerState.RUNNING else w for w in job.workers])
            keys = self._view.job(job.id)
            state = keys.state if keys else None
            if state is not None and state.final:
                end_from_cluster(job.id, state)
            elif job.cancel_requested:
                self._move(job, JobState.CANCELLED, "cancelled by user (daemon restarted)")
            elif state is None:
                self._restart_forgotten(job)
            elif job.state != JobState.PENDING:
                self._move(job, JobState.RESTARTING, "daemon restarted; rejoining the job")

    def _restart_forgotten(self, job: JobRecord) -> None:
        """The store lost the job (standalone daemon restarted): start it again."""
        now = time.time()
        plan = plan_forgotten(job.state != JobState.PENDING, job.restarts, job.max_restarts,
                              RestartWindow(job.max_restarts_per_window, job.restart_window),
                              job.restart_times, now)
        if not plan.fits:
            self._move(job, JobState.FAILED, plan.reason, exit_code=1)
            return
        try:
            spec = JobSpec.of_record(job)
            create_job(self._store, job.id, self._codec.seal(spec), now,
                       round=job.round + 1, restarts=plan.restarts, restart_times=plan.times,
                       records=self._codec.records, expected=spec.nodes)
        except (StoreError, ValueError) as exc:
            log.error("%s: cannot resume: %s", ctx(job=job.id), exc)
            return
        if plan.counted:
            allowed = "unlimited" if job.max_restarts < 0 else str(job.max_restarts)
            self._move(job, JobState.RESTARTING, f"daemon restarted; resuming as restart "
                       f"{plan.restarts} of {allowed}", restarts=plan.restarts,
                       restart_times=list(plan.times))

    def _move(self, job: JobRecord, state: JobState, reason: str, **changes) -> None:
        if job.state == state:
            self._registry.update(job.id, reason=reason, **changes)
            self._registry.event(job.id, "info", reason)
        else:
            self._registry.transition(job.id, state, reason, **changes)
