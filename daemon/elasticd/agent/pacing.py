"""How soon one agent restarts its job's workers after a fault, and when it stops trying.

``RestartPacer`` keeps what jobs/restartpolicy.py decides from: the attempts
in a row that made no progress (the backoff's streak: ``plan``, ``restarting``;
a peer's fault after an attempt that made progress starts it over:
``peer_fault``) and the crash loop (the same failure, no progress, in a row:
``crash_loop``). No I/O.
"""
from __future__ import annotations

from ..config import Config
from ..jobs.records import Failure
from ..jobs.restartpolicy import (
    AttemptProgress, BackoffSettings, CrashLoop, RestartPlan, made_progress, plan_restart)
from . import failures


class RestartPacer:
    """One agent's backoff streak and crash-loop count."""

    def __init__(self, cfg: Config, saved_crash_loop=()):
        """``saved_crash_loop``: the count the job's record kept (a restarted daemon)."""
        self._settings = BackoffSettings.from_settings(cfg.agent)
        self._streak = 0   # attempts in a row without progress
        self._crash_loop = CrashLoop.resumed(cfg.agent.crash_loop_limit, saved_crash_loop)

    def peer_fault(self, progress: AttemptProgress) -> None:
        """Another node's fault ended an attempt that did ``progress``."""
        if made_progress(progress, self._settings):
            self._streak = 0

    def plan(self, progress: AttemptProgress) -> RestartPlan:
        """The wait before restarting after a local fault ended ``progress``."""
        return plan_restart(progress, self._streak, self._settings)

    def crash_loop(self, failure: Failure, plan: RestartPlan) -> str:
        """Count the failure; why not to restart when it completes a crash loop, else ""."""
        if self._crash_loop.note(failures.signature(failure), plan.streak == 0):
            return self._crash_loop.sentence()
        return ""

    def crash_loop_saved(self) -> list:
        """The crash-loop count as the job record keeps it."""
        return self._crash_loop.saved()

    def restarting(self, plan: RestartPlan) -> None:
        """The job restarts as ``plan`` says: its streak is the one to build on."""
        self._streak = plan.streak
