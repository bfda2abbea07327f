"""The checks a job's agent passes before each round it joins on this node: quarantine, GPUs.

``GpuGate.healthy`` first asks whether this node is quarantined (too many
faults recorded for it: cluster/quarantine.py; the drain mark names why): a
quarantined node leaves a running job at its next round when the job's other
nodes without a drain mark still make its min nodes (``leaves_job``), and
stays in it, said once as a ``quarantine`` event, when they do not. Then the
node's health gate (gpus/health.py) about the job's GPUs here. Kept out by
either, the job's reason says why, and after ``cluster.quarantine_recheck``
(or ``daemon.gpu_health_retry_interval``) the agent looks again
(``RoundFinal`` if the job ended meanwhile without this node).
"""
from __future__ import annotations

import threading

from ..config import Config
from ..gpus.alloc import Binding
from ..jobs.registry import JobRegistry
from ..rendezvous.round import ClusterRendezvous, RoundFinal


def leaves_job(peers, drained, min_nodes: int) -> bool:
    """Whether a quarantined node stays out of a running job's next round.

    Only when the job's other nodes (``peers``) that carry no drain mark still
    make its ``min_nodes``: a quarantine cordons a node (no new adoptions) and
    moves work off it where the work has somewhere to go, as `kubectl drain`
    stops at a PodDisruptionBudget. Taking the node from a job that cannot run
    without it would leave the job waiting in RENDEZVOUS for nodes that never
    come, on the strength of a count; a node that truly fails is kept out
    anyway by the checks that see it fail (the GPU health check, its lost lease).
    """
    return len(set(peers) - set(drained)) >= min_nodes


class GpuGate:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry,
                 rendezvous: ClusterRendezvous, binding: Binding, health=None,
                 quarantine=None):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._rdzv = rendezvous
        self._gpus = binding.gpus
        self._health = health   # gpus/health.HealthGate, or None (no check)
        self._quarantine = quarantine   # () -> cluster/faults.NodeQuarantine, or None
        self._kept_in = False           # stayed in though quarantined (said once)

    def healthy(self, wake: threading.Event) -> bool:
        """True to join the round; False after waiting to look again (see the module doc)."""
        q = self._quarantine() if self._quarantine is not None else None
        if q is not None and q.reasons:
            me, need = self._cfg.daemon.node_id, self._rdzv.limits.min_nodes
            if leaves_job(self._rdzv.peers(), q.drained, need):
                again = self._cfg.cluster.quarantine_recheck
                return self._stay_out(wake, again, f"node {me} is quarantined, not joining "
                                                   f"(again in {again:g}s; `elasticctl uncordon` "
                                                   f"takes it back): {q.reasons[0]}")
            if not self._kept_in:   # once per agent: the job runs on, here
                self._kept_in = True
                self._registry.event(self.job_id, "quarantine",
                                     f"node {me} is quarantined but stays in this job: without "
                                     f"it the job's other nodes are fewer than its min nodes "
                                     f"({need}): {q.reasons[0]}")
        if self._health is None or not self._gpus:
            return True
        result = self._health.before_round(self.job_id, self._gpus)
        if result.ok:
            return True
        retry = self._cfg.daemon.gpu_health_retry_interval
        return self._stay_out(wake, retry, f"GPU health check failing on "
                                           f"{self._cfg.daemon.node_id}, not joining (again in "
                                           f"{retry:g}s): {result.reason}")

    def _stay_out(self, wake: threading.Event, retry: float, reason: str) -> bool:
        self._registry.update(self.job_id, reason=reason)
        final = self._rdzv.final_state()
        if final is not None:
            raise RoundFinal(final)
        wake.wait(retry)
        wake.clear()
        return False
