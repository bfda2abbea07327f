"""This node's stores for the rounds it joins (``jobstore/round_server.py``), daemon side.

``RoundStoreHost`` runs the server as the job's user, forked from the job's
worker template (workers/template.py ``fork_helper``: torch is imported
there already, so the server costs no second interpreter and torch import,
~2.6 s of CPU and its memory per node and job): at once when the template
is ready, else at the first ``new_port()``, which waits for the template's
imports (at most ``rendezvous.round_store_timeout``, or until the agent is
woken: a cancel, a shutdown; the first round's ranks wait for the template
anyway). Without a usable template (``agent.worker_template`` off, the
template failed or refuses to fork) it starts the server with the job's
Python (the spawn path of the workers) and the first ``new_port()`` waits
for its torch import (READY). Every call answers a port whose store
listens already, or 0 when there is none. The rendezvous offers that port
as this node's MASTER_PORT (``Join.port``, ``hosted``); a round whose first
member's port is hosted has its ranks connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``, see ``worker_env``). Any failure
(not a Python command, the server died, no answer in
``rendezvous.round_store_timeout``) stops the server: the node offers a
plain free port from then on, rank 0 hosting the store as before. The
process and its channel: jobstore/helper.py.

Owned by the job's agent thread (every call comes from it, as for the
template); no locks.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from ..logsetup import ctx
from ..workers import env as envnames
from ..workers.group import GroupSpec, SpawnError, warm_args
from ..workers.template import TemplateState, WorkerTemplate
from .helper import JobHelper

log = logging.getLogger("elasticd.jobstore.round_host")

ROUND_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "round_server.py")
READY = "ELASTICD_ROUND_STORE READY"
PORT = "ELASTICD_ROUND_STORE PORT"


def worker_env(hosted: bool) -> dict[str, str]:
    """What a round's ranks are told about its MASTER_PORT store: hosted by a daemon's
    round store (every rank a client, as under torchrun's agent store) or by rank 0."""
    return {envnames.TORCHRUN_USE_AGENT_STORE: "True" if hosted else "False"}


class RoundStoreHost:
    def __init__(self, job_id: str, node_id: str, timeout: float):
        self._job_id = job_id
        self._node_id = node_id
        self._timeout = timeout
        self._server = JobHelper()
        self._spec: GroupSpec | None = None
        self._bind = ""
        self._template: Callable[[], WorkerTemplate | None] | None = None
        self.ready = False
        self.reason = ""          # why there is none (empty while it starts or serves)

    @property
    def pid(self) -> int:
        """The server's pid (0: none)."""
        return self._server.pid

    @property
    def forked_from(self) -> int:
        """The pid of the worker template it was forked from (0: spawned, or none)."""
        return self._server.template_pid

    def start(self, spec: GroupSpec, bind: str,
              template: Callable[[], WorkerTemplate | None] | None = None) -> None:
        """Start the server (not waiting for it); ``bind``: the one address it listens on;
        ``template``: the job's worker template now (the agent's may be replaced), to
        fork the server from once it is ready."""
        self.stop()
        self.reason = ""
        if warm_args(spec.command) is None:
            self.reason = "the job's command is not `python SCRIPT` or `python -m MODULE`"
            return
        self._spec, self._bind, self._template = spec, bind, template
        tpl = template() if template is not None else None
        if tpl is None or tpl.state is not TemplateState.STARTING:
            self._launch(tpl, None)   # forked from a ready one, else spawned: now
        # else forked at the first new_port, once the template is ready

    def _launch(self, tpl: WorkerTemplate | None, stop) -> bool:
        """Start the server (jobstore/helper.py ``launch``: forked from ``tpl`` once it is
        ready, at most ``rendezvous.round_store_timeout`` later, else spawned); False
        when ``stop`` ended the wait for the template first."""
        try:
            why = self._server.launch(tpl, self._spec, [ROUND_SERVER, "--host", self._bind],
                                      os.path.join(self._spec.log_dir, "roundstore.log"),
                                      self._timeout, stop)
        except SpawnError as exc:
            self.reason = str(exc)
            return True
        where = ctx(job=self._job_id, node=self._node_id)
        if why == "":
            log.info("%s: round store server pid %d forked from worker template pid %d",
                     where, self._server.pid, self._server.template_pid)
        elif why is not None and tpl is not None:
            log.info("%s: round store server not forked from the worker template (%s): "
                     "started on its own", where, why)
        return why is not None

    def new_port(self, stop=None) -> int:
        """A new store's port, listening already; 0 when there is none (failed: then
        never again, see ``reason``; or ``stop`` was set while it still imported). A
        server forked from a template that is no longer the job's (it died: its children
        die with it, some time after) is replaced by one forked from the job's template
        now: a port from the dying one would leave the ranks without their store."""
        forked_from = self._server.template_pid
        if forked_from and self._template is not None:
            now = self._template()
            if now is None or now.pid != forked_from or now.state not in (
                    TemplateState.STARTING, TemplateState.READY):
                log.info("%s: round store server was forked from worker template pid %d, "
                         "which the job no longer has or which died: starting another",
                         ctx(job=self._job_id, node=self._node_id), forked_from)
                self._server.stop()
                self.ready = False
        if not self._server.started and self._spec is not None and not self.reason:
            if not self._launch(self._template() if self._template is not None else None,
                                stop):
                return 0          # woken (cancel, shutdown): this join goes without
        if not self._server.started:
            return 0
        if not self.ready:
            line = self._server.wait_line(self._timeout, stop)
            if line is None and self._server.exit_code() is not None:
                return self._give_up(f"round store server exited "
                                     f"({self._server.exit_code()}); see roundstore.log")
            if line is None and stop is not None and stop.is_set():
                return 0          # woken (cancel, shutdown): this join goes without
            if line is None:
                return self._give_up(f"round store server not ready within "
                                     f"{self._timeout:g}s")
            if line != READY:
                return self._give_up(f"round store server said {line[:80]!r}")
            self.ready = True
        if not self._server.send(b"NEW\n"):
            return self._give_up("round store server gone")
        line = self._server.read_line(self._timeout)
        parts = (line or "").rsplit(" ", 1)
        if line is None or parts[0] != PORT or not parts[1].isdigit() \
                or not 0 < int(parts[1]) < 65536:
            return self._give_up(f"round store server gave no port within "
                                 f"{self._timeout:g}s" if line is None
                                 else f"round store server said {line[:80]!r}")
        return int(parts[1])

    def _give_up(self, why: str) -> int:
        self.stop()
        self.reason = why
        log.warning("%s: no round stores on this node (%s): rank 0 hosts its round's store",
                    ctx(job=self._job_id, node=self._node_id), why)
        return 0

    def stop(self) -> None:
        self._server.stop()
        self._spec, self.ready = None, False
