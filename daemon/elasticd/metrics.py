"""Prometheus metrics of this daemon (``elasticd_`` prefix, units in names).

Counters move from the events the job registry emits, so every state
change is counted in one place; gauges are read from the live objects at
scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server

from . import __version__
from .states import JobState


class Metrics:
    def __init__(self, node_id: str):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        Info("elasticd_build", "elasticd build information", registry=r).info(
            {"version": __version__, "node_id": node_id})
        self.transitions = Counter(
            "elasticd_job_transitions_total", "Job state transitions, by the state entered",
            ["to_state"], registry=r)
        self.restarts = Counter(
            "elasticd_restarts_total", "Worker-group restarts, by layer and cause",
            ["layer", "cause"], registry=r)
        self.workers_started = Counter(
            "elasticd_workers_started_total", "Worker processes started", registry=r)
        self.rpc_seconds = Histogram(
            "elasticd_control_rpc_duration_seconds", "Control RPC latency, by method and code",
            ["method", "code"], registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5))
        self._server = None

    def attach(self, registry, manager) -> None:
        """Count registry events; export job and worker gauges at scrape time."""
        registry.listeners.append(self._on_event)
        self.registry.register(_JobCollector(registry, manager))

    def _on_event(self, ev: dict) -> None:
        if ev["kind"] == "state" and ev["to_state"]:
            self.transitions.labels(ev["to_state"]).inc()

    # -- called by the agent and control service ------------------------------
    def workers_started_n(self, n: int) -> None:
        self.workers_started.inc(n)

    def restart_or_failure(self, failure: dict) -> None:
        cause = "signal" if failure.get("signal") else "exit"
        self.restarts.labels("process", cause).inc()

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_seconds.labels(method, code).observe(seconds)

    def serve(self, address: str, port: int) -> None:
        if port:
            self._server, _ = start_http_server(port, addr=address, registry=self.registry)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()


class _JobCollector:
    def __init__(self, registry, manager):
        self._jobs = registry
        self._manager = manager

    def describe(self):
        return []

    def collect(self):
        by_state = {s.value: 0 for s in JobState}
        workers = 0
        for job in self._jobs.list():
            by_state[job.state.value] += 1
            workers += sum(1 for w in job.workers if w["state"] == "running")
        g = GaugeMetricFamily("elasticd_jobs", "Jobs known to this node, by state",
                              labels=["state"])
        for state, n in by_state.items():
            g.add_metric([state], n)
        yield g
        yield GaugeMetricFamily("elasticd_workers_running", "Worker processes running",
                                value=workers)
        yield GaugeMetricFamily("elasticd_slots_used", "Worker slots in use on this node",
                                value=self._manager.slots_used())
