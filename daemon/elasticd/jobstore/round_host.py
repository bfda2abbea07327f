"""This node's stores for the rounds it joins (``jobstore/round_server.py``), daemon side.

``RoundStoreHost`` starts the server with the job's Python, as the job's
user (the spawn path of the workers), as soon as the job is here. The first
``new_port()`` waits for the server's torch import (READY; at most
``rendezvous.round_store_timeout``, or until the agent is woken: a cancel,
a shutdown; the worker template imports at the same time, and the first
round's ranks wait for it anyway); every call answers a port whose store
listens already, or 0 when there is none. The
rendezvous offers that port as this node's MASTER_PORT (``Join.port``,
``hosted``); a round whose first member's port is hosted has its ranks
connect to it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, see
``worker_env``). Any failure (not a Python command, the server died, no
answer in ``rendezvous.round_store_timeout``) stops the server: the node
offers a plain free port from then on, rank 0 hosting the store as before.

Owned by the job's agent thread (every call comes from it); no locks.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import time

from ..logsetup import ctx
from ..workers import env as envnames
from ..workers.group import (
    GroupSpec, SpawnError, base_env, end_helper, prepare_dirs, start_job_process, warm_args)

log = logging.getLogger("elasticd.jobstore.round_host")

ROUND_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "round_server.py")
READY = "ELASTICD_ROUND_STORE READY"
PORT = "ELASTICD_ROUND_STORE PORT"
_LINE_MAX = 200


def worker_env(hosted: bool) -> dict[str, str]:
    """What a round's ranks are told about its MASTER_PORT store: hosted by a daemon's
    round store (every rank a client, as under torchrun's agent store) or by rank 0."""
    return {envnames.TORCHRUN_USE_AGENT_STORE: "True" if hosted else "False"}


class RoundStoreHost:
    def __init__(self, job_id: str, node_id: str, timeout: float):
        self._job_id = job_id
        self._node_id = node_id
        self._timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self.ready = False
        self.reason = ""          # why there is none (empty while it starts or serves)

    def start(self, spec: GroupSpec, bind: str) -> None:
        """Start the server (not waiting for it); ``bind``: the one address it listens on."""
        self.stop()
        self.reason = ""
        if warm_args(spec.command) is None:
            self.reason = "the job's command is not `python SCRIPT` or `python -m MODULE`"
            return
        try:
            prepare_dirs(spec)
            self._proc = start_job_process(
                spec, [spec.command[0], ROUND_SERVER, "--host", bind], base_env(spec),
                os.path.join(spec.log_dir, "roundstore.log"), pipes=True)
        except SpawnError as exc:
            self.reason = str(exc)

    def new_port(self, stop=None) -> int:
        """A new store's port, listening already; 0 when there is none (failed: then
        never again, see ``reason``; or ``stop`` was set while it still imported)."""
        if self._proc is None:
            return 0
        if not self.ready:
            line = self._wait_ready(stop)
            if line is None and self._proc.poll() is not None:
                return self._give_up(f"round store server exited ({self._proc.returncode}); "
                                     "see roundstore.log")
            if line is None and stop is not None and stop.is_set():
                return 0          # woken (cancel, shutdown): this join goes without
            if line is None:
                return self._give_up(f"round store server not ready within "
                                     f"{self._timeout:g}s")
            if line != READY:
                return self._give_up(f"round store server said {line[:80]!r}")
            self.ready = True
        try:
            self._proc.stdin.write(b"NEW\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return self._give_up("round store server gone")
        line = self._read_line(self._timeout)
        parts = (line or "").rsplit(" ", 1)
        if line is None or parts[0] != PORT or not parts[1].isdigit() \
                or not 0 < int(parts[1]) < 65536:
            return self._give_up(f"round store server gave no port within "
                                 f"{self._timeout:g}s" if line is None
                                 else f"round store server said {line[:80]!r}")
        return int(parts[1])

    def _wait_ready(self, stop) -> str | None:
        """The server's first line, waited for in slices (``stop`` ends the wait)."""
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            line = self._read_line(max(0.0, min(0.1, left)))
            if line is not None or left <= 0 or self._proc.poll() is not None \
                    or (stop is not None and stop.is_set()):
                return line

    def _read_line(self, timeout: float) -> str | None:
        """One line from the server within ``timeout`` seconds; None if none (or EOF)."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
            if len(self._buf) > _LINE_MAX:
                return "<line too long>"
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace").strip()

    def _give_up(self, why: str) -> int:
        self.stop()
        self.reason = why
        log.warning("%s: no round stores on this node (%s): rank 0 hosts its round's store",
                    ctx(job=self._job_id, node=self._node_id), why)
        return 0

    def stop(self) -> None:
        proc, self._proc, self._buf, self.ready = self._proc, None, b"", False
        if proc is not None:
            end_helper(proc)
