"""The Prometheus endpoint: listens on metrics.address:metrics.port, and never stops the daemon.

Any local user can bind a port above 1023 before the daemon does. A port
that cannot be bound (taken, an address not on this host yet, refused) is
not a reason to leave jobs unserved: the daemon starts without its
endpoint, says why once per distinct reason (a log line; ``problem()``,
which ``elasticctl nodes`` lists; ``on_change``, which the daemon turns into
the gRPC health of ``HEALTH_SERVICE``), and tries again every
``metrics.retry_interval`` seconds until it listens. The retry thread is
this object's own, ends once the port is bound or ``stop()`` is called, and
waits at most one interval at a time. docs/metrics.md, "The endpoint", says how
to serve metrics where no user can take the port first.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import psutil
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import start_http_server

from ..logsetup import ctx

log = logging.getLogger("elasticd.exposition.endpoint")

# The name the endpoint's state has in the control socket's gRPC health service.
HEALTH_SERVICE = "elasticd.metrics"


class EndpointState(enum.Enum):
    OFF = "off"              # metrics.port 0
    LISTENING = "listening"
    WAITING = "waiting"      # could not bind; trying again every retry interval


@dataclass(frozen=True)
class EndpointStatus:
    state: EndpointState
    address: str
    port: int            # the one listened on (the setting's, until it listens)
    reason: str = ""     # why it is WAITING
    tries: int = 0       # binds that failed since the start

    def problem(self) -> str:
        """One line for ``elasticctl nodes``; "" unless it is waiting."""
        if self.state is not EndpointState.WAITING:
            return ""
        return (f"metrics endpoint {self.address}:{self.port} not serving: {self.reason}; "
                f"trying again (metrics.retry_interval)")


class MetricsEndpoint:
    def __init__(self, registry: CollectorRegistry, address: str, port: int,
                 retry_interval: float, node_id: str = "",
                 on_change: Callable[[EndpointState], None] | None = None):
        self._registry = registry
        self._address = address
        self._port = port
        self._retry = retry_interval
        self._node = node_id
        # Told each new state (the daemon sets the gRPC health of HEALTH_SERVICE).
        self.on_change = on_change or (lambda state: None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = None
        self._thread: threading.Thread | None = None
        self._status = EndpointStatus(EndpointState.OFF, address, port)
        self._said = ""        # the last reason logged

    # -- life ----------------------------------------------------------------
    def start(self) -> None:
        """Listen now if the port can be had, else go on trying in the background."""
        if not self._port:
            self.on_change(EndpointState.OFF)
            return
        if self._try_bind():
            return
        self._thread = threading.Thread(target=self._run, name="metrics-endpoint",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._retry):
            if self._try_bind():
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._retry + 5)
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # -- what it says ---------------------------------------------------------
    def status(self) -> EndpointStatus:
        with self._lock:
            return self._status

    def problem(self) -> str:
        return self.status().problem()

    @property
    def port(self) -> int:
        """The port it listens on; 0 while it does not (off, or waiting)."""
        with self._lock:
            return self._server.server_port if self._server is not None else 0

    # -- binding ---------------------------------------------------------------
    def _try_bind(self) -> bool:
        try:
            server, _ = start_http_server(self._port, addr=self._address,
                                          registry=self._registry)
        except OSError as exc:
            self._failed(exc)
            return False
        with self._lock:
            if self._stop.is_set():  # stopped meanwhile: not ours to keep
                server.shutdown()
                server.server_close()
                return True
            self._server = server
            before, self._said = self._status, ""
            self._status = EndpointStatus(EndpointState.LISTENING, self._address,
                                          server.server_port, tries=before.tries)
        log.info("%s: metrics endpoint serving on %s:%d%s", ctx(node=self._node), self._address,
                 server.server_port,
                 f" (after {before.tries} failed tries: {before.reason})" if before.tries else "")
        self.on_change(EndpointState.LISTENING)
        return True

    def _failed(self, exc: OSError) -> None:
        reason = str(exc.strerror or exc)
        if reason == self._said:  # said already: only count the try
            with self._lock:
                self._status = dataclasses.replace(self._status, tries=self._status.tries + 1)
            return
        self._said = reason
        holder = _holder(self._port)
        with self._lock:
            self._status = EndpointStatus(EndpointState.WAITING, self._address, self._port,
                                          reason + (f" ({holder})" if holder else ""),
                                          self._status.tries + 1)
        log.warning("%s: metrics endpoint %s:%d cannot listen: %s; the daemon serves jobs "
                    "without it and tries again every %g s (metrics.retry_interval)",
                    ctx(node=self._node), self._address, self._port, self._status.reason,
                    self._retry)
        self.on_change(EndpointState.WAITING)


def _holder(port: int) -> str:
    """Who listens on ``port`` on this host ("" if nobody can be named; a root daemon
    reads every process's sockets)."""
    try:
        for conn in psutil.net_connections("tcp"):
            if conn.laddr and conn.laddr.port == port and conn.pid:
                try:
                    return f"held by pid {conn.pid}, uid {psutil.Process(conn.pid).uids().real}"
                except psutil.Error:
                    return f"held by pid {conn.pid}"
    except (psutil.Error, OSError):
        pass
    return ""
