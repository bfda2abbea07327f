"""A node about to join a running job warms up before it asks for ranks.

A node that is not in the job's running round (started later, or back after
its daemon was killed) says it waits to join; every member then stops its
workers and a round with the newcomer forms (rendezvous/round.py). The
members restart from their warm spares in well under a second, but the
newcomer's ranks, started cold, import torch first: seconds, during which
every other rank waits for them in ``init_process_group``. Measured on
bench/goodput.py --nodes 3: each node that came back stalled the whole job
for its cold start.

So the newcomer first starts its warm spares (for the ranks it will most
likely get: after the running round's members) and asks only once they have
imported, or after ``rendezvous.newcomer_warm_timeout`` seconds (then its
ranks start cold, as before). The job trains on meanwhile. ``NewcomerWarmup``
is owned by the agent thread; ``ClusterRendezvous.ready_to_join`` calls it.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ..logsetup import ctx
from ..workers.group import GroupSpec, prepare_dirs, warm_args
from ..workers.spares import SparePool

log = logging.getLogger("elasticd.agent.newcomer")


class WarmVerdict(enum.Enum):
    WARMING = "warming"      # spares still importing: do not ask yet
    WARM = "warm"            # every local rank has an imported spare: ask
    TIMED_OUT = "timed_out"  # newcomer_warm_timeout passed: ask, ranks start cold
    GONE = "gone"            # a spare exited before it was ready: ask, ranks start cold
    NOTHING = "nothing"      # no spares for this job (off, or not python): ask at once


@dataclass(frozen=True)
class WarmCheck:
    verdict: WarmVerdict
    waited: float            # seconds since the warm-up began

    @property
    def ask(self) -> bool:
        return self.verdict is not WarmVerdict.WARMING

    def sentence(self) -> str:
        if self.verdict is WarmVerdict.WARM:
            return f"warm spares ready after {self.waited:.1f}s; asking to join"
        if self.verdict is WarmVerdict.TIMED_OUT:
            return (f"warm spares not ready after {self.waited:.0f}s; asking to join "
                    "anyway (ranks start cold)")
        if self.verdict is WarmVerdict.GONE:
            return "a warm spare exited; asking to join anyway (ranks start cold)"
        if self.verdict is WarmVerdict.NOTHING:
            return "asking to join"
        return "starting warm spares before asking to join"


def judge(imported: int, wanted: int, waited: float, timeout: float,
          alive: int | None = None) -> WarmVerdict:
    """Whether to ask now (no I/O); ``alive``: spares still running (None: all)."""
    if wanted <= 0 or timeout <= 0:
        return WarmVerdict.NOTHING
    if imported >= wanted:
        return WarmVerdict.WARM
    if alive is not None and alive < wanted:
        return WarmVerdict.GONE
    if waited >= timeout:
        return WarmVerdict.TIMED_OUT
    return WarmVerdict.WARMING


class NewcomerWarmup:
    def __init__(self, spares: SparePool, timeout: float, preload: list, nice: int,
                 clock: Callable[[], float] = time.monotonic):
        self._spares = spares
        self._timeout = timeout
        self._preload = preload
        self._nice = nice
        self._clock = clock
        self._since: float | None = None
        self._wanted = 0
        self._asked: WarmCheck | None = None
        self.just_began = False      # the last check() started the warm-up

    def check(self, spec: Callable[[], GroupSpec]) -> tuple[WarmCheck, bool]:
        """Start the spares on the first call (``spec``: the group this node would
        run), then say whether to ask; and whether this is the first call that asks
        (for the one log line and event). Once asked, it asks until ``reset()``."""
        if self._asked is not None:
            self.just_began = False
            return self._asked, False
        now = self._clock()
        self.just_began = self._since is None
        if self._since is None:
            self._since = now
            if self._timeout > 0:
                group = spec()
                if warm_args(group.command) is not None:
                    try:
                        prepare_dirs(group)  # the spares' output goes to the ranks' logs
                        self._spares.fill(group, self._preload, self._nice)
                    except OSError as exc:  # no warm-up then: ask at once, start cold
                        log.warning("%s: no warm spares before joining: %s",
                                    ctx(job=group.job_id, node=group.node_id), exc)
                    self._wanted = self._spares.ready()  # those that could be started
        check = WarmCheck(judge(self._spares.imported(), self._wanted, now - self._since,
                                self._timeout, self._spares.ready()), now - self._since)
        if check.ask:
            self._asked = check
        return check, check.ask

    def reset(self) -> None:
        """This node got ranks (or the job moved on): a later wait starts over."""
        self._since, self._wanted, self._asked = None, 0, None
