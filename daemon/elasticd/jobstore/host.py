"""The per-job store for in-process restart, hosted outside the ranks.

``elasticctl submit --inprocess`` jobs get a ``jobstore/server.py`` process (a
torch TCPStore, as the job's user, in its own session, dying with the
daemon) for as long as the job runs on this node: forked from the job's
worker template once it is ready (no second torch import), else started
with the job's own Python (jobstore/helper.py). Its address reaches the
workers as ELASTICD_STORE_ADDR/PORT, where ``elasticd.inprocess.Wrapper``
coordinates its restarts through it. A template that dies takes the store
with it (and the ranks: a process restart); the next round gets a new one.
"""
from __future__ import annotations

import logging
import os

from ..logsetup import ctx
from ..workers.group import GroupSpec, SpawnError, warm_args
from ..workers.template import WorkerTemplate
from .helper import JobHelper

log = logging.getLogger("elasticd.jobstore.host")

JOBSTORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")


class JobStoreHost:
    def __init__(self) -> None:
        self._store = JobHelper()
        self.address: tuple[str, int] | None = None

    @property
    def forked_from(self) -> int:
        """The pid of the worker template it was forked from (0: spawned, or none)."""
        return self._store.template_pid

    def ensure(self, spec: GroupSpec, bind: str, advertise: str, timeout: float,
               template: WorkerTemplate | None = None, stop=None) -> tuple[str, int] | None:
        """The running store's (addr, port), starting it if need be; None when ``stop``
        (a threading.Event: a cancel, a shutdown) was set before it could answer.

        ``bind``: the one address it listens on (loopback for a single node,
        this node's address when ranks on other nodes use it); ``advertise``:
        the address the ranks are told; ``template``: the job's worker template,
        waited for while it imports (at most ``timeout``) and forked from.
        Its errors go to ``<job logs>/jobstore.log``.
        """
        if self._store.running and self.address:
            return self.address
        self.stop()
        if warm_args(spec.command) is None:
            raise SpawnError("in-process restart needs a `python SCRIPT` or `python -m MODULE` "
                             "command (the store host runs with the job's Python)")
        why = self._store.launch(template, spec, [JOBSTORE, "--host", bind, "--advertise",
                                                  advertise],
                                 os.path.join(spec.log_dir, "jobstore.log"), timeout, stop)
        if why is None:
            return None
        line = self._store.wait_line(timeout, stop)
        words = (line or "").split()
        # It runs as the job's user: what it says is checked (the address is ours).
        if len(words) != 3 or words[0] != "ELASTICD_STORE" or words[1] != (advertise or bind) \
                or not words[2].isdigit() or not 0 < int(words[2]) < 65536:
            code = self._store.exit_code()
            self.stop()
            if line is None and stop is not None and stop.is_set():
                return None
            raise SpawnError(f"the job store exited ({code}); see jobstore.log"
                             if code is not None and line is None else
                             f"the job store said {line[:80]!r}" if line is not None else
                             f"the job store did not start within {timeout:g}s")
        self.address = (words[1], int(words[2]))
        log.info("%s: job store for in-process restart on %s:%d (%s)",
                 ctx(job=spec.job_id, node=spec.node_id), *self.address,
                 f"forked from worker template pid {self.forked_from}" if not why
                 else f"started on its own: {why}")
        return self.address

    def stop(self) -> None:
        self._store.stop()
        self.address = None
