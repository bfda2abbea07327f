"""The stores this node hosts for one job, and the store a round's ranks are given.

``JobStores`` owns them: for a job across nodes, the round store server
(jobstore/round_host.py), asked for a new store at each join; for an
``--inprocess`` job, this node's job store (jobstore/host.py), up before it
joins a round, and the address, port and secret of the round's job store put
into the ranks' environment. Both stop when the job ends here.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable

from ..config import Config
from ..jobs.registry import JobRecord, JobRegistry
from ..jobs.states import TERMINAL_STATES
from ..jobstore import address as jobstore_env, round_host
from ..jobstore.host import JobStoreHost
from ..rendezvous.protocol import Result
from ..rendezvous.round import ClusterRendezvous
from ..workers import env as envnames
from ..workers.group import GroupSpec, SpawnError
from ..workers.round_place import RoundPlace
from ..workers.template import WorkerTemplate

# Where a job on one node has its stores (its job store, rank 0's): no other host needs them.
LOOPBACK = "127.0.0.1"


class JobStores:
    def __init__(self, job_id: str, cfg: Config, registry: JobRegistry,
                 rendezvous: ClusterRendezvous):
        self.job_id = job_id
        self._cfg = cfg
        self._registry = registry
        self._rdzv = rendezvous
        self._store_host = JobStoreHost()
        self._round_stores = round_host.RoundStoreHost(job_id, cfg.daemon.node_id,
                                                       cfg.rendezvous.round_store_timeout)
        self._secret = jobstore_env.new_secret()

    def start_round_stores(self, node_spec: Callable[[JobRecord], GroupSpec],
                           stop: threading.Event,
                           template: Callable[[], WorkerTemplate | None]) -> None:
        """A job across nodes: this node's round store server (jobstore/round_host.py),
        asked for a new store at each join (not waiting for its imports), forked from
        the job's worker template (``template()``: the agent's now) once it is ready."""
        job = self._registry.get(self.job_id)
        if not self._cfg.rendezvous.round_stores or job.max_nodes <= 1 or job.inprocess \
                or job.state in TERMINAL_STATES:
            return
        self._round_stores.start(node_spec(job), bind=self._rdzv.address, template=template)
        if self._round_stores.reason:
            self._registry.event(self.job_id, "info", f"no round stores on this node: "
                                 f"{self._round_stores.reason}; rank 0 hosts its round's store")
        self._rdzv.hosted_port = lambda: self._round_stores.new_port(stop=stop)

    def start_job_store(self, job: JobRecord,
                        node_spec: Callable[[JobRecord, str], GroupSpec],
                        template: WorkerTemplate | None,
                        stop: threading.Event) -> int | None:
        """For --inprocess jobs: this node's job store, up before it joins a round; its port.

        Every node hosts one; the ranks of a round share the first member's
        (rendezvous Result.store_addr), which outlives any rank. It is forked
        from the job's worker ``template`` (waited for while it imports) when
        it can be. 0 when it cannot start: the job then restarts processes
        only; None when ``stop`` (the agent's wake) ended the wait first.
        """
        address = LOOPBACK if job.max_nodes <= 1 else self._rdzv.address
        local = address.startswith("127.") or address in ("localhost", "::1")
        spec = node_spec(job, address)
        try:
            got = self._store_host.ensure(spec, bind=LOOPBACK if local else address,
                                          advertise=address, timeout=120.0,
                                          template=template, stop=stop)
            return got[1] if got is not None else None
        except SpawnError as exc:
            self._registry.event(job.id, "info", f"no in-process restart on this node: {exc}")
            return 0

    def round_spec(self, job: JobRecord, result: Result,
                   group_spec: Callable[[JobRecord, RoundPlace], GroupSpec]) \
            -> tuple[Result, GroupSpec]:
        """The round as this node's ranks see it, and their group's spec: a job on one
        node keeps its stores on loopback; the ranks are told of the job store and of
        a round store that hosts MASTER_PORT."""
        if job.max_nodes <= 1:  # one node: its stores listen on loopback alone
            result = dataclasses.replace(
                result, place=dataclasses.replace(result.place, master_addr=LOOPBACK),
                store_addr=LOOPBACK if result.store_addr else "")
        spec = self.with_job_store(job, group_spec(job, result.place), result)
        if result.master_hosted:  # a round store listens on MASTER_PORT already
            spec = dataclasses.replace(spec, extra_env={
                **spec.extra_env, **round_host.worker_env(True)})
        return result, spec

    def with_job_store(self, job: JobRecord, spec: GroupSpec, rdzv: Result) -> GroupSpec:
        """For --inprocess jobs: the store the round's wrappers coordinate through."""
        if not job.inprocess:
            return spec
        if not rdzv.store_port:
            self._registry.event(job.id, "info", f"round {rdzv.place.round}: its first node "
                                 "hosts no job store; this round restarts processes only")
            return spec
        settings = {envnames.INPROCESS_PREFIX + name.upper(): str(value)
                    for name, value in dataclasses.asdict(self._cfg.inprocess).items()}
        defaults = {k: v for k, v in settings.items() if k not in job.env}  # --env wins
        # The secret came with the job (made at submit); a job from a daemon that did not
        # make one gets this agent's own (every rank of a single-node round shares it).
        secret = job.env.get(jobstore_env.SECRET) or self._secret
        return dataclasses.replace(spec, extra_env={**spec.extra_env, **defaults,
                                                    jobstore_env.ADDR: rdzv.store_addr,
                                                    jobstore_env.PORT: str(rdzv.store_port),
                                                    jobstore_env.SECRET: secret})

    def stop(self) -> None:
        """Before the job's template goes back to the pool: a round store server forked
        from it is one of its children."""
        self._store_host.stop()
        self._round_stores.stop()
