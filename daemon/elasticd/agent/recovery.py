"""The restart ladder's bookkeeping for one job on this node.

The agent decides and acts (stop, restart, replace a rank); ``Recovery``
keeps the record of it (jobs/ladder.py): which layer climbed, why, how long
until the workers ran again. It reads what the in-process wrapper of each
rank reported (workers/inprocess_reports.py), stores restarts per layer and the
latest attempts on the job record, writes one event per climb, and counts
in-process restarts in the metrics (process and rendezvous restarts are
counted from the job's state events, see metrics.py). Owned by the job's
agent thread.
"""
from __future__ import annotations

import dataclasses
import logging

from ..config import Config
from ..workers import env as envnames
from ..workers.inprocess_reports import ReportKind, ReportReader, report_path
from ..jobs.registry import JobRecord, JobRegistry
from ..jobs.ladder import Ladder, Layer
from ..metrics import failure_cause
from ..jobs.records import Failure, FailureKind
from ..workers.group import WorkerGroup

log = logging.getLogger("elasticd.agent.recovery")


class Recovery:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry, metrics=None):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._metrics = metrics
        self._reports = ReportReader()
        self.ladder: Ladder | None = None
        self.inprocess_on = False         # this attempt's ranks can restart in-process
        self._replaced_label = ""         # metrics cause of the pending replacement
        self._stuck: dict[int, str] = {}  # rank -> why its wrapper ended it (a hang)

    # -- per process attempt -------------------------------------------------------
    def start_attempt(self, job: JobRecord, inprocess_on: bool) -> Ladder:
        """A new worker group starts: in-process counts begin again."""
        if self.ladder is None:
            budget = self._inprocess_budget(job) if job.inprocess else 0
            self.ladder = Ladder.from_record(self._cfg.daemon.node_id, budget,
                                             job.restarts_by_layer, job.attempts)
            self._registry.update(self.job_id, restart_budget={
                "inprocess": budget, "process": job.max_restarts,
                "rendezvous": -1})  # no limit of its own: shares max_restarts
        self.ladder.new_process_attempt()
        self._reports.reset()
        self._stuck.clear()
        self.inprocess_on = inprocess_on
        return self.ladder

    def _inprocess_budget(self, job: JobRecord) -> int:
        raw = job.env.get(envnames.INPROCESS_MAX_RESTARTS)
        try:
            return max(0, int(raw)) if raw is not None else self._cfg.inprocess.max_restarts
        except ValueError:
            return self._cfg.inprocess.max_restarts

    # -- what the agent asks -------------------------------------------------------
    def inprocess_left(self) -> int:
        return self.ladder.inprocess_left() if self.inprocess_on else 0

    def gave_up(self) -> bool:
        return self.inprocess_on and bool(self.ladder.abandoned)

    def fields(self) -> dict:
        """The job record's ladder fields, for the agent's next update or transition."""
        return {"restarts_by_layer": dict(self.ladder.restarts_by_layer),
                "attempts": list(self.ladder.attempts)}

    # -- what happened ---------------------------------------------------------------
    def explain(self, failure: Failure) -> Failure:
        """The failure record, as a hang if the rank's wrapper ended it for being stuck."""
        why = self._stuck.get(failure.rank)
        if why is None:
            return failure
        return dataclasses.replace(failure, kind=FailureKind.HANG, cause=why)

    def replaced(self, failure: Failure, rank: int) -> int:
        """A dead rank got a new process; returns the in-process restarts used so far."""
        self._stuck.pop(rank, None)
        self.ladder.replaced(failure.cause, failure.time, rank)
        self._replaced_label = failure_cause(failure)
        return max(self.ladder.iterations_seen, self.ladder.replacements)

    def recovered(self) -> None:
        """Workers run again: the pending process or rendezvous climb recovered."""
        climb = self.ladder.recovered()
        if climb is None:
            return
        self._registry.update(self.job_id, **self.fields())
        self._registry.event(self.job_id, "restart",
                             f"{climb.layer.value} restart: running again {climb.duration:.2f}s "
                             f"after the fault ({climb.cause})", rank=climb.rank,
                             layer=climb.layer.value,
                             duration=climb.duration)

    def read_reports(self, group: WorkerGroup) -> None:
        """What the in-process wrapper of each rank reported since the last tick."""
        spec = group.spec
        paths = {w.rank: report_path(spec.run_dir, w.rank, spec.restart_count)
                 for w in group.workers}
        for rank, rep in self._reports.poll(paths, spec.uid):
            if rep.kind is ReportKind.STUCK:
                self._stuck[rank] = rep.reason
                self._registry.event(self.job_id, "hang", rep.reason, rank=rank,
                                     layer=Layer.INPROCESS.value)
                continue
            if rep.kind is ReportKind.FORGED:
                self._registry.event(self.job_id, "info", f"rank {rank}: ignored a "
                                     f"{rep.record} record in the job store that failed "
                                     "authentication: someone other than the job's ranks "
                                     "writes to its store", rank=rank,
                                     layer=Layer.INPROCESS.value)
                continue
            if rep.kind is ReportKind.ABANDONED:
                if not self.ladder.abandoned:
                    self._registry.event(self.job_id, "info", f"rank {rank}: in-process restart "
                                         f"gave up: {rep.reason}", rank=rank,
                                         layer=Layer.INPROCESS.value)
                self.ladder.gave_up(rep.reason, rank)
                continue
            climb = self.ladder.iteration_started(rep.iteration, rep.fault,
                                                  rep.fault_time, rep.ready_time, rank)
            if climb is None:
                continue
            self._registry.update(self.job_id, **self.fields())
            self._registry.event(self.job_id, "restart",
                                 f"in-process restart {rep.iteration} of "
                                 f"{self.ladder.inprocess_budget}: running again "
                                 f"{climb.duration:.2f}s after the fault ({climb.cause})",
                                 rank=rank, layer=climb.layer.value, duration=climb.duration)
            if self._metrics:
                self._metrics.count_restart(Layer.INPROCESS.value, self._replaced_label or "exit")
                self._metrics.observe_recovery(Layer.INPROCESS.value, climb.duration)
            self._replaced_label = ""
