"""Caller identity from the kernel, carried into gRPC as a signed token.

gRPC does not expose a unix socket's peer credentials, so beside the control
socket the daemon listens on a small credential socket (``<socket>.cred``).
A client connects, the daemon reads the peer's pid/uid/gid with SO_PEERCRED
and writes back one line: a token naming that uid/gid, an expiry, and an
HMAC under a secret that never leaves this process. The client sends it as
``elasticd-token`` metadata; ``TokenIssuer.verify`` turns it back into a
``Caller``. Nothing the client says about itself is trusted.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pwd
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass

from ..errors import PermissionDenied
from ..jobs.jobrecord import JobRecord

log = logging.getLogger("elasticd.control.auth")

TOKEN_METADATA_KEY = "elasticd-token"


class AuthError(Exception):
    pass


@dataclass(frozen=True)
class Caller:
    uid: int
    gid: int
    pid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def user(self) -> str:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    def may_act_on(self, owner_uid: int) -> bool:
        return self.is_root or self.uid == owner_uid


class TokenIssuer:
    def __init__(self, ttl: float, clock=time.time):
        self._key = secrets.token_bytes(32)
        self._ttl = ttl
        self._clock = clock

    def _sign(self, body: str) -> str:
        return hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()

    def issue(self, uid: int, gid: int, pid: int) -> str:
        expiry = int(self._clock() + self._ttl)
        body = f"v1:{uid}:{gid}:{pid}:{expiry}:{secrets.token_hex(8)}"
        return f"{body}:{self._sign(body)}"

    def verify(self, token: str | None) -> Caller:
        if not token:
            raise AuthError("no credential token: connect through elasticctl, which fetches one "
                            "from the .cred socket beside the control socket")
        if len(token) > 512 or not token.isascii():
            raise AuthError("credential token is malformed")
        body, _, mac = token.rpartition(":")
        if not body or not hmac.compare_digest(self._sign(body), mac):
            raise AuthError("credential token is not valid for this daemon (it restarted?); "
                            "run the command again")
        try:
            version, uid, gid, pid, expiry, _nonce = body.split(":")
            if version != "v1":
                raise ValueError
            uid_i, gid_i, pid_i, expiry_i = int(uid), int(gid), int(pid), int(expiry)
        except ValueError:
            raise AuthError("credential token is malformed") from None
        if self._clock() > expiry_i:
            raise AuthError("credential token expired; run the command again")
        return Caller(uid=uid_i, gid=gid_i, pid=pid_i)


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class CredentialServer:
    """Owns the credential socket and its accept loop (one thread)."""

    def __init__(self, path: str, issuer: TokenIssuer, gid: int | None, poll: float = 0.5):
        self.path = path
        self._issuer = issuer
        self._gid = gid
        self._poll = poll
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        set_socket_access(self.path, self._gid)
        sock.listen(socket.SOMAXCONN)  # a burst of clients queues, not refused
        sock.settimeout(self._poll)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="cred-socket", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("credential socket accept failed")
                self._stop.wait(self._poll)
                continue
            with conn:
                try:
                    conn.settimeout(2.0)
                    pid, uid, gid = peer_credentials(conn)
                    conn.sendall((self._issuer.issue(uid, gid, pid) + "\n").encode())
                except OSError as exc:
                    log.debug("credential exchange failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):  # wakes the accept() now, not at its timeout
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._poll + 1)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a dead daemon; refuse if one is alive."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except BlockingIOError:
        pass  # its listen queue is full: a daemon is there, busy
    except OSError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another elasticd is already serving {path}")


def set_socket_access(path: str, gid: int | None) -> None:
    """0660, group ``gid`` when there is one (only root may give it away)."""
    if gid is not None and os.geteuid() == 0:
        os.chown(path, 0, gid)
    os.chmod(path, 0o660)


def check_access(job: JobRecord, caller: Caller) -> None:
    """root may see and change every job; anyone else only their own."""
    if not caller.may_act_on(job.uid):
        raise PermissionDenied(
            f"job {job.id} is another user's; only its owner or root may see or change "
            "it (the owner is not named to anyone else)")
