"""The GPU health check a job's agent passes before each round it joins on this node.

``GpuGate.healthy`` asks the node's health gate (gpus/health.py) about the
job's GPUs here. On a failure the node stays out of the round: the job's
reason says why, and after ``daemon.gpu_health_retry_interval`` the agent looks
again (``RoundFinal`` if the job ended meanwhile without this node).
"""
from __future__ import annotations

import threading

from ..config import Config
from ..gpus.alloc import Binding
from ..jobs.registry import JobRegistry
from ..rendezvous.round import ClusterRendezvous, RoundFinal


class GpuGate:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry,
                 rendezvous: ClusterRendezvous, binding: Binding, health=None):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._rdzv = rendezvous
        self._gpus = binding.gpus
        self._health = health   # gpus/health.HealthGate, or None (no check)

    def healthy(self, wake: threading.Event) -> bool:
        """True to join the round; False after waiting to look again (see the module doc)."""
        if self._health is None or not self._gpus:
            return True
        result = self._health.before_round(self.job_id, self._gpus)
        if result.ok:
            return True
        retry = self._cfg.daemon.gpu_health_retry_interval
        self._registry.update(self.job_id, reason=f"GPU health check failing on "
                              f"{self._cfg.daemon.node_id}, not joining (again in {retry:g}s): "
                              f"{result.reason}")
        final = self._rdzv.final_state()
        if final is not None:
            raise RoundFinal(final)
        wake.wait(retry)
        wake.clear()
        return False
