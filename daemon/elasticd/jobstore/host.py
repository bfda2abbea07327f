"""The per-job store for in-process restart, hosted outside the ranks.

``elasticctl submit --inprocess`` jobs get a ``jobstore/server.py`` process (a
torch TCPStore, started with the job's own Python as the job's user, in its
own process group, dying with the daemon) for as long as the job runs on
this node. Its address reaches the workers as ELASTICD_STORE_ADDR/PORT,
where ``elasticd.inprocess.Wrapper`` coordinates its restarts through it.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess

from ..logsetup import ctx
from ..workers.group import (
    GroupSpec, SpawnError, base_env, end_helper, prepare_dirs, start_job_process, warm_args)

log = logging.getLogger("elasticd.jobstore.host")

JOBSTORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "server.py")


class JobStoreHost:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self.address: tuple[str, int] | None = None

    def ensure(self, spec: GroupSpec, bind: str, advertise: str,
               timeout: float) -> tuple[str, int]:
        """The running store's (addr, port), starting it if need be.

        ``bind``: the one address it listens on (loopback for a single node,
        this node's address when ranks on other nodes use it); ``advertise``:
        the address the ranks are told. Its errors go to ``<job logs>/jobstore.log``.
        """
        if self._proc is not None and self._proc.poll() is None and self.address:
            return self.address
        self.stop()
        if warm_args(spec.command) is None:
            raise SpawnError("in-process restart needs a `python SCRIPT` or `python -m MODULE` "
                             "command (the store host runs with the job's Python)")
        prepare_dirs(spec)
        proc = start_job_process(
            spec, [spec.command[0], JOBSTORE, "--host", bind, "--advertise", advertise],
            base_env(spec), os.path.join(spec.log_dir, "jobstore.log"), pipes=True)
        self._proc = proc
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().decode(errors="replace").split() if ready else []
        if len(line) != 3 or line[0] != "ELASTICD_STORE":
            self.stop()
            raise SpawnError(f"the job store did not start within {timeout:g}s")
        self.address = (line[1], int(line[2]))
        log.info("%s: job store for in-process restart on %s:%d",
                 ctx(job=spec.job_id, node=spec.node_id), *self.address)
        return self.address

    def stop(self) -> None:
        proc, self._proc, self.address = self._proc, None, None
        if proc is not None:
            end_helper(proc)
