"""The checks a job's agent passes before each round it joins on this node: quarantine, GPUs.

``GpuGate.healthy`` first asks whether this node is quarantined (too many
faults recorded for it: cluster/quarantine.py; the drain mark names why), so
a quarantined node leaves its running jobs at their next round; then the
node's health gate (gpus/health.py) about the job's GPUs here. On either the
node stays out of the round: the job's reason says why, and after
``cluster.quarantine_recheck`` (or ``daemon.gpu_health_retry_interval``) the
agent looks again (``RoundFinal`` if
the job ended meanwhile without this node).
"""
from __future__ import annotations

import threading

from ..config import Config
from ..gpus.alloc import Binding
from ..jobs.registry import JobRegistry
from ..rendezvous.round import ClusterRendezvous, RoundFinal


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
        self._quarantine = quarantine   # () -> this node's quarantine reasons, or None

    def healthy(self, wake: threading.Event) -> bool:
        """True to join the round; False after waiting to look again (see the module doc)."""
        said = self._quarantine() if self._quarantine is not None else ()
        if said:
            again = self._cfg.cluster.quarantine_recheck
            return self._stay_out(wake, again, f"node {self._cfg.daemon.node_id} is quarantined, "
                                               f"not joining (again in {again:g}s; `elasticctl "
                                               f"uncordon` takes it back): {said[0]}")
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
