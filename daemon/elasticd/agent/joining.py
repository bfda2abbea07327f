"""Whether this node, new to a job's running round, is warm enough to ask to join it.

``JoinGate.ready`` is what the rendezvous asks (``ClusterRendezvous.ready_to_join``)
before this node, not in the job's last round, says it waits to join a running
round or joins an open round that does not expect it: once its worker template
is (or, without one, its spares are: agent/newcomer.py), or after
``rendezvous.newcomer_warm_timeout`` anyway. It owns the spares' warm-up and
says each turn of it once, in the log and as a job event.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from ..config import Config
from ..jobs.registry import JobRecord, JobRegistry
from ..rendezvous.protocol import RoundState
from ..workers.group import GroupSpec
from ..workers.round_place import RoundPlace
from ..workers.spares import SparePool
from ..workers.template import TemplateState
from .newcomer import NewcomerWarmup, WarmVerdict
from .template import JobTemplate

log = logging.getLogger("elasticd.agent.loop")  # the agent's lines, as they always were


class JoinGate:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry, tpl: JobTemplate,
                 spares: SparePool, group_spec: Callable[[JobRecord, RoundPlace], GroupSpec],
                 where: Callable[[int], str]):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._tpl = tpl
        self._group_spec = group_spec
        self._where = where
        # Before this node asks to join a running round: its spares first (agent/newcomer.py).
        self._newcomer = NewcomerWarmup(
            spares, cfg.rendezvous.newcomer_warm_timeout if cfg.agent.warm_spares else 0,
            cfg.agent.warm_preload, cfg.agent.warm_spare_nice)
        self._said: set[str] = set()    # what it said of the template
        self._wait_since = 0.0          # when it began to wait for the template to join

    def joined(self) -> None:
        """A round was joined: the next warm-up starts afresh."""
        self._newcomer.reset()

    def ready(self, state: RoundState) -> bool:
        """Whether to ask now to join ``state``'s round (see the module doc)."""
        limit = self._cfg.rendezvous.newcomer_warm_timeout  # 0: ask at once
        if self._tpl.on and self._tpl.template.state in (
                TemplateState.STARTING, TemplateState.READY):
            self._tpl.note()   # status shows it warm while this node waits (or stands by)
            if limit <= 0:
                return True
            now = time.monotonic()
            self._wait_since = self._wait_since or now
            warm = self._tpl.template.ready(0)
            ready = warm or now - self._wait_since >= limit
            said = "ready" if ready else "waiting"
            if said not in self._said:  # once each: waiting, then ready
                self._said.add(said)
                # a spare (the running round has its max nodes) stands by, it does not ask
                ask = "standing by as a spare" if len(state.members) >= \
                    self._registry.get(self.job_id).max_nodes else "asking to join"
                why = ((f"worker template ready; {ask}" if warm else
                        f"worker template not ready after {limit:g}s; {ask} anyway")
                       if ready else
                       f"waiting for the worker template's imports before {ask}")
                log.info("%s: %s", self._where(state.round), why)
                self._registry.event(self.job_id, "info", f"round {state.round}: {why}")
            return ready
        job = self._registry.get(self.job_id)
        # The ranks it will most likely get: after the running round's members (an open
        # round has none yet: after the nodes it expects, as many ranks each as ours).
        n = len(state.members) or len(state.expected)
        offset = sum(m.nproc for m in state.members) if state.members \
            else n * job.nproc_per_node
        check, first = self._newcomer.check(lambda: self._group_spec(job, RoundPlace(
            round=state.round + 1, group_rank=n, group_world_size=n + 1,
            world_size=offset + job.nproc_per_node, rank_offset=offset, master_addr="",
            master_port=0)))
        said = (first and check.verdict is not WarmVerdict.NOTHING) or (
            check.verdict is WarmVerdict.WARMING and self._newcomer.just_began)
        if said:
            log.info("%s: %s", self._where(state.round), check.sentence())
            self._registry.event(self.job_id, "info",
                                 f"round {state.round}: {check.sentence()}",
                                 duration=check.waited)
        return check.ask
