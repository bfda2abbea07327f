"""The in-process layer of the restart ladder on this node: a dead rank replaced alone.

``RankReplacer.replace_dead`` starts a new process for each rank of the group
that died (from a spare when there is one); it joins the others' next
iteration. Each replacement is logged, recorded as a ``replace`` event and
counted against the job's in-process budget (agent/recovery.py); a rank that
cannot be replaced makes the layer give up, and the group restarts.
"""
from __future__ import annotations

import logging
from typing import Callable

from ..config import Config
from ..jobs.ladder import Layer
from ..jobs.registry import JobRegistry
from ..logsetup import ctx
from ..workers import env as envnames
from ..workers.group import SpawnError, WorkerGroup
from ..workers.spares import SparePool
from . import failures
from .attempt import AttemptWatch
from .blame import FailureNotes
from .placement import Placement
from .recovery import Recovery

log = logging.getLogger("elasticd.agent.loop")  # the agent's lines, as they always were


class RankReplacer:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry, place: Placement,
                 notes: FailureNotes, recovery: Recovery, attempt: AttemptWatch,
                 spares: SparePool, publish: Callable[[WorkerGroup], None]):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._place = place
        self._notes = notes
        self._recovery = recovery
        self._attempt = attempt
        self._spares = spares
        self._publish = publish   # the group's rows and summary to the cluster

    def replace_dead(self, group: WorkerGroup) -> None:
        """Start a new process for each dead rank; it joins the others' next iteration."""
        job = self._registry.get(self.job_id)
        failure = None
        for w in list(group.workers):
            if w.outcome in (None, 0):
                continue
            report = failures.report_of(w, job.uid, self._cfg.agent.error_file_max_bytes,
                                        self._place.log_dir(job),
                                        self._cfg.agent.failure_tail_lines)
            failure = self._notes.explain(self._notes.of_worker(job, w, report))
            self._attempt.forget(w.rank)
            cause = failure.cause
            try:
                new = group.replace(w, self._spares, {envnames.INPROCESS_REPLACES: cause},
                                    cause)
            except SpawnError as exc:
                # Nothing to join the others: they fall back at their barrier; restart now.
                self._registry.event(self.job_id, "info", f"rank {w.rank} not replaced: {exc}",
                                     rank=w.rank, layer=Layer.INPROCESS.value)
                self._recovery.ladder.gave_up(f"rank {w.rank} could not be replaced: {exc}",
                                              w.rank)
                return
            used = self._recovery.replaced(failure, w.rank)
            log.warning("%s: %s; replaced in-process by pid %d",
                        ctx(job=self.job_id, node=self._cfg.daemon.node_id, round=job.round,
                            rank=w.rank), cause, new.pid)
            self._registry.event(self.job_id, "replace",
                                 f"{cause}; replaced in-process by pid {new.pid} "
                                 f"({new.start_path}) "
                                 f"({used} of {self._recovery.ladder.inprocess_budget})",
                                 rank=w.rank, layer=Layer.INPROCESS.value)
        if failure is not None:
            self._registry.update(self.job_id, last_failure=failure,
                                  workers=self._place.worker_rows(group),
                                  **self._recovery.fields())
            self._publish(group)
