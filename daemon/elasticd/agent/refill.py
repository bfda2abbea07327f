"""When a running attempt's warm spares for the next restart start, and starting them.

Spares (workers/spares.py) import torch before any fault, so that a restart
hands ranks an interpreter that already did. ``SpareRefill`` is armed when an
attempt's workers start and again when a rank is replaced in-process (it took
a spare); at each look of the monitor ``tick`` starts them once they are due
(jobs/restartpolicy.spares_due), unless no restart is left or the job's
worker template is ready (a restart forks from it instead).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ..config import Config
from ..jobs.restartpolicy import spares_due
from ..workers.group import GroupSpec
from ..workers.spares import SparePool
from .template import JobTemplate

log = logging.getLogger("elasticd.agent.loop")  # the agent's lines, as they always were


class SpareRefill:
    """One agent's spares still to start for its running attempt."""

    def __init__(self, cfg: Config, spares: SparePool, tpl: JobTemplate,
                 where: Callable[[int], str]):
        self._agent = cfg.agent
        self._spares = spares
        self._tpl = tpl
        self._where = where
        self._armed = False
        self._since = 0.0      # monotonic: when the workers the spares follow started
        self._warm = False     # they started from spares or the template

    def arm(self, since: float, warm: bool) -> None:
        """Spares are due again for workers started at ``since`` (monotonic), warm or not."""
        self._armed, self._since, self._warm = bool(self._agent.warm_spares), since, warm

    def tick(self, spec: GroupSpec, first_beat: float | None, restarts_left: bool,
             rnd: int) -> None:
        """Start the spares once due (``first_beat``: the attempt's first progress
        beat, monotonic), at most once per arming."""
        a = self._agent
        if not self._armed or not spares_due(time.monotonic(), self._since, first_beat,
                                             self._warm, a.warm_spare_delay,
                                             a.warm_spare_restart_delay):
            return
        self._armed = False
        if restarts_left and not self._tpl.template.ready(0) \
                and self._spares.fill(spec, a.warm_preload, a.warm_spare_nice):
            log.info("%s: warm spares started for the next restart", self._where(rnd))
