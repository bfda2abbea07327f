"""Whether a peer's daemon is gone: its host refuses a connection to the daemon's port.

A node whose daemon died (kill -9, a crash, the OOM killer) keeps its node lease,
and the join keys under it, until the lease's TTL passes (membership.lease_ttl): a
round opened after the fault waits ``rendezvous.rejoin_timeout`` for it to rejoin
meanwhile. Its host knows sooner: a connection to the replication listener the dead
daemon held (the port its sealed node record publishes) is refused at once. That
daemon is gone, whatever its lease says, and with it every rank it ran.

Only a refusal counts. A connection accepted (the daemon lives), no answer within
``rendezvous.gone_probe_timeout`` (a host that is down or cut off answers nothing:
its lease tells that, as before), no route, or no port published: none of these
says the daemon is gone. A wrong "gone" costs little: the round closes without
waiting for that node, which then joins as a newcomer (or stands by as a spare).

A probe never blocks: ``gone()`` starts a non-blocking connect on the first ask and
looks at it without waiting on each later one; the caller (the rendezvous decider,
one thread per job) asks again on its next look, sooner while ``pending()``. An
accepted connection is closed at once before a byte is sent (the listener takes
that quietly as a probe, replication/receiver.py). ``forget()`` closes what is
open; a new round starts afresh.
"""
from __future__ import annotations

import errno
import logging
import select
import socket
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("elasticd.cluster.probe")


@dataclass
class _Probe:
    sock: socket.socket | None
    started: float
    gone: bool | None = None       # None: no answer yet


class DaemonProbe:
    def __init__(self, port_of: Callable[[str], int], timeout: float,
                 clock=time.monotonic):
        self._port_of = port_of      # node id -> its published daemon port (0: none)
        self._timeout = timeout      # 0: no probes
        self._clock = clock
        self.look = timeout / 10     # how soon to look again while a probe is pending
        self._probes: dict[tuple, _Probe] = {}

    def gone(self, node_id: str, address: str) -> bool:
        """True once ``node_id``'s host refused a connection to its daemon's port."""
        if self._timeout <= 0 or not address:
            return False
        key = (node_id, address)
        probe = self._probes.get(key)
        if probe is None:   # the port is looked up once, when the probe starts
            try:
                port = int(self._port_of(node_id) or 0)
            except (TypeError, ValueError):
                port = 0
            if not 0 < port < 65536:
                # No port known yet (no record held and etcd did not answer its read,
                # or none published): no answer, and none kept; the next ask looks
                # again (the record's reader bounds how often it asks etcd).
                return False
            probe = self._probes[key] = self._start(address, port)
        if probe.gone is None:
            self._look(probe)
        return bool(probe.gone)

    def pending(self) -> bool:
        """A probe waits for its answer: look again soon."""
        return any(p.gone is None for p in self._probes.values())

    def forget(self) -> None:
        for probe in self._probes.values():
            self._close(probe)
        self._probes.clear()

    def _start(self, address: str, port: int) -> _Probe:
        try:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            log.debug("no probe of %s:%d: %s", address, port, exc)
            return _Probe(None, self._clock(), False)
        sock.setblocking(False)
        probe = _Probe(sock, self._clock())
        try:
            code = sock.connect_ex((address, port))
        except OSError as exc:          # a bad address: says nothing of the daemon
            log.debug("no probe of %s:%d: %s", address, port, exc)
            code = errno.EHOSTUNREACH
        self._settle(probe, code)
        return probe

    def _look(self, probe: _Probe) -> None:
        try:
            _, writable, _ = select.select([], [probe.sock], [], 0)
        except (OSError, ValueError):
            writable = [probe.sock]
        if writable:
            self._settle(probe, probe.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        elif self._clock() - probe.started >= self._timeout:
            probe.gone = False          # no answer: the lease tells, as before
            self._close(probe)

    def _settle(self, probe: _Probe, code: int) -> None:
        if code in (errno.EINPROGRESS, errno.EALREADY, errno.EAGAIN):
            return
        probe.gone = code == errno.ECONNREFUSED
        self._close(probe)

    @staticmethod
    def _close(probe: _Probe) -> None:
        if probe.sock is not None:
            try:
                probe.sock.close()
            except OSError:
                pass
            probe.sock = None
