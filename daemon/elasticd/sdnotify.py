"""systemd's notify protocol (sd_notify), spoken directly: no libsystemd.

The protocol is one datagram of newline-separated ``KEY=VALUE`` lines sent to
the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an
abstract socket). ``Type=notify`` units wait for ``READY=1``; ``WatchdogSec=``
units must send ``WATCHDOG=1`` more often than ``$WATCHDOG_USEC``.

Everything here is best effort: when not run by systemd (no ``NOTIFY_SOCKET``)
every call is a no-op, and a failed send is logged at debug and never raised,
so the daemon runs the same under systemd, in a terminal, or in tests.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Mapping

log = logging.getLogger(__name__)

# What systemd puts in a notify-type service's environment. Processes the
# daemon spawns (workers) should not inherit these: they are the daemon's.
NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends state changes and watchdog pings to systemd, if it is listening.

    ``env`` is the environment to read (default ``os.environ``); ``pid`` is
    this process's id as compared with ``$WATCHDOG_PID`` (default
    ``os.getpid()``). One datagram socket is opened here and kept until
    :meth:`close`; it is close-on-exec, so workers never inherit it.
    """

    def __init__(self, env: Mapping[str, str] | None = None, *, pid: int | None = None):
        env = os.environ if env is None else env
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._address = _parse_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_usec, self._watchdog_ours = _parse_watchdog(
            env, os.getpid() if pid is None else pid)
        if self._address is not None:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            except OSError as exc:
                log.debug("sd_notify: cannot create a socket, notifications off: %s", exc)

    @property
    def enabled(self) -> bool:
        """True when systemd gave us a notify socket (and we could open ours)."""
        return self._sock is not None

    def ready(self, status: str | None = None) -> bool:
        """Startup is done (``READY=1``), optionally with a status line."""
        return self._send("READY=1" if status is None else f"READY=1\nSTATUS={_one_line(status)}")

    def status(self, text: str) -> bool:
        """Set the free-form status shown by ``systemctl status``."""
        return self._send(f"STATUS={_one_line(text)}")

    def stopping(self) -> bool:
        """A clean stop has begun (``STOPPING=1``)."""
        return self._send("STOPPING=1")

    def watchdog(self) -> bool:
        """Ping the watchdog (``WATCHDOG=1``).

        Sent whenever notifications are on (systemd ignores pings for a unit
        without ``WatchdogSec=``), except when ``$WATCHDOG_PID`` names another
        process: then the watchdog is not ours to keep alive.
        """
        if not self._watchdog_ours:
            return False
        return self._send("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between watchdog pings (half of ``$WATCHDOG_USEC``), or None.

        None unless notifications are on and systemd's watchdog is armed for
        this process (``sd_watchdog_enabled`` semantics: ``WATCHDOG_USEC`` a
        positive integer and ``WATCHDOG_PID``, if set, equal to our pid).
        """
        if not self.enabled or not self._watchdog_ours or not self._watchdog_usec:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, message: str) -> bool:
        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.sendto(message.encode("utf-8", "replace"), self._address)
                return True
            except OSError as exc:
                log.debug("sd_notify: sending %r to %r failed: %s",
                          message.split("\n", 1)[0], self._address, exc)
                return False


def _parse_address(value: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` as a socket address: a path, or ``@name`` (abstract)."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    # systemd also knows vsock:CID:PORT (VMs); nothing we run under uses it.
    log.debug("sd_notify: NOTIFY_SOCKET=%r is neither a path nor @abstract; "
              "notifications off", value)
    return None


def _parse_watchdog(env: Mapping[str, str], pid: int) -> tuple[int | None, bool]:
    """(WATCHDOG_USEC or None, whether the watchdog belongs to ``pid``)."""
    ours = True
    pid_text = env.get("WATCHDOG_PID")
    if pid_text:
        try:
            ours = int(pid_text) == pid
        except ValueError:
            log.debug("sd_notify: bad WATCHDOG_PID=%r; watchdog off", pid_text)
            ours = False
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None, ours
    try:
        usec = int(usec_text)
    except ValueError:
        usec = 0
    if usec <= 0:
        log.debug("sd_notify: bad WATCHDOG_USEC=%r; watchdog off", usec_text)
        return None, ours
    return usec, ours


def _one_line(text: str) -> str:
    # A newline would start a new KEY=VALUE assignment in the datagram.
    return " ".join(str(text).splitlines())
