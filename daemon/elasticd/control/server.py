"""The control socket's gRPC server: the Control service, the standard health service, the
thread pool and the connection limits they share.

The socket is 0660, group ``daemon.socket_group`` (control/auth.set_socket_access);
the health service answers SERVING for the daemon (``""`` and the Control
service) while it runs, and the metrics endpoint's state under its own name
(exposition/endpoint.HEALTH_SERVICE).
"""
from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .auth import TokenIssuer, set_socket_access
from .fairpool import CallerTag, FairExecutor
from .service import SERVICE_NAME, ControlServicer
from ..config import Config
from ..exposition.endpoint import HEALTH_SERVICE as METRICS_HEALTH, EndpointState
from ..v1 import control_pb2_grpc as pb_grpc


class ControlServer:
    """Owns the gRPC server on the control socket and its health service."""

    def __init__(self, cfg: Config, servicer: ControlServicer, gid: int | None,
                 issuer: TokenIssuer):
        self._cfg = cfg
        self._gid = gid
        c = cfg.control
        lim = cfg.limits
        threads = c.rpc_threads + lim.streams_total  # streams never take the short calls' share
        # Callers take turns for the threads (control/fairpool.py), and the caps per uid
        # (control/streamgate.py) refuse what is over them at once: no cap on the calls in
        # progress of all users together, which one user's flood would reach and then
        # hold for everyone. What one connection may have open is bounded instead (twice
        # what one uid may run; streams past it are refused, REFUSED_STREAM), and
        # connections by limits.max_connections.
        self._server = grpc.server(
            FairExecutor(threads, per_key=lim.calls_per_user + lim.streams_per_user,
                         rate=lim.call_rate_per_user, max_queued=lim.calls_queued_per_user,
                         thread_name_prefix="rpc"),
            interceptors=[CallerTag(issuer)],
            options=[("grpc.max_receive_message_length", c.max_message_bytes),
                     ("grpc.max_send_message_length", 64 * 1024 * 1024),
                     ("grpc.max_concurrent_streams",
                      2 * (lim.calls_per_user + lim.streams_per_user)),
                     # A flood of connections is closed, not kept until the fds run out:
                     ("grpc.max_allowed_incoming_connections", lim.max_connections),
                     ("grpc.server_handshake_timeout_ms", int(lim.handshake_timeout * 1000)),
                     ("grpc.max_connection_idle_ms", int(lim.idle_timeout * 1000))])
        pb_grpc.add_ControlServicer_to_server(servicer, self._server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def start(self) -> None:
        path = self._cfg.daemon.socket
        if os.path.exists(path):
            os.unlink(path)  # auth.CredentialServer already refused a live daemon
        old = os.umask(0o177)
        try:
            if not self._server.add_insecure_port(f"unix:{path}"):
                raise RuntimeError(f"cannot listen on {path}")
        finally:
            os.umask(old)
        self._server.start()
        set_socket_access(path, self._gid)
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def metrics_health(self, state: EndpointState) -> None:
        """The metrics endpoint's state as the health of its own service name: SERVING
        while it listens, NOT_SERVING while its port cannot be had (the daemon's own
        service serves on either way); unknown when it is off."""
        if state is EndpointState.LISTENING:
            self.health.set(METRICS_HEALTH, health_pb2.HealthCheckResponse.SERVING)
        elif state is EndpointState.WAITING:
            self.health.set(METRICS_HEALTH, health_pb2.HealthCheckResponse.NOT_SERVING)

    def stop(self, grace: float) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1)
        try:
            os.unlink(self._cfg.daemon.socket)
        except FileNotFoundError:
            pass
