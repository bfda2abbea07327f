"""The failure record of a job's failed workers on this node, and what caused it.

``FailureNotes`` makes the typed ``Failure`` the restart decisions read: of the
worker most to blame (agent/failures.py reads its error file and log tail),
of one worker (logged, and recorded as a ``worker_exit`` event), or of the
node itself; and explains it (a hang that ended the rank: the hang detector's
word, or the in-process layer's: agent/recovery.py).
"""
from __future__ import annotations

import logging

from ..config import Config
from ..jobs.records import Failure, FailureKind
from ..jobs.registry import JobRecord, JobRegistry
from ..logsetup import ctx
from ..workers.group import WorkerGroup
from . import failures
from .attempt import AttemptWatch
from .placement import Placement
from .recovery import Recovery

log = logging.getLogger("elasticd.agent.loop")  # the agent's lines, as they always were


class FailureNotes:
    def __init__(self, cfg: Config, registry: JobRegistry, place: Placement,
                 recovery: Recovery, attempt: AttemptWatch):
        self._cfg = cfg
        self._registry = registry
        self._place = place
        self._recovery = recovery
        self._attempt = attempt

    def first(self, job: JobRecord, group: WorkerGroup) -> Failure:
        """The failure of the worker most to blame in ``group``."""
        blamed = failures.most_to_blame(group.workers, job.uid,
                                        self._cfg.agent.error_file_max_bytes,
                                        self._place.log_dir(job),
                                        self._cfg.agent.failure_tail_lines)
        if blamed is None:
            return self.record(job, -1, 1, 0, "worker failed")
        return self.of_worker(job, *blamed)

    def explain(self, failure: Failure) -> Failure:
        """The failure, its cause a hang if one ended the rank: killed by our hang
        detection (hangs/detector.py), or ended by its own wrapper as stuck (agent/recovery.py)."""
        return self._recovery.explain(self._attempt.explain(failure))

    def of_worker(self, job: JobRecord, w, report: failures.ErrorReport) -> Failure:
        """The failure record of one failed worker, logged and recorded as an event."""
        exit_code, sig, cause = failures.describe(w, report.message, report.problem)
        tb = report.traceback
        log.warning("%s: worker pid %d failed: %s",
                    ctx(job=job.id, node=self._cfg.daemon.node_id, round=job.round, rank=w.rank),
                    w.pid, cause)
        self._registry.event(job.id, "worker_exit", cause, rank=w.rank, signal=sig)
        # typed, for whoever decides on it (not the sentence)
        kind = FailureKind.UNREADABLE_ERROR_FILE if report.problem is not None \
            else FailureKind.WORKER
        return self.record(job, w.rank, exit_code, sig, cause, tb, kind)

    def record(self, job: JobRecord, rank: int, exit_code: int, sig: int, cause: str,
               traceback: str = "", kind: FailureKind = FailureKind.WORKER) -> Failure:
        return failures.record(rank, exit_code, sig, cause, traceback, job.restarts,
                               self._cfg.daemon.node_id, kind)
