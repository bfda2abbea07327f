"""Connecting to elasticd: socket checks, the caller's token, the gRPC stub.

The identity protocol (see protos/elasticd/v1/control.proto): connect a unix
stream socket to ``<control socket>.cred``, read to EOF; the one ASCII line is
a short-lived token, or ``ERR <message>``. Every call then carries the token
as gRPC metadata under ``elasticd-token``.

``Client.upcheck()`` turns everything that means "no daemon to talk to" (no
socket file, nothing listening, no permission, UNAVAILABLE) into one
:class:`DaemonUnreachable` whose message says what to do about it, the way
supervisorctl's ``upcheck`` does.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import time
from typing import Any, Iterator

import grpc

from elasticd.socket_paths import default_socket_path
from elasticd.v1 import control_pb2_grpc

TOKEN_METADATA_KEY = "elasticd-token"
CRED_SUFFIX = ".cred"
# Where the system daemon (systemd unit, root) listens; non-root users fall
# back to it when their own default socket does not exist.
SYSTEM_SOCKET = "/run/elasticd/control.sock"
UNARY_TIMEOUT = 10.0        # seconds one unary call may take, on top of any wait it asks for
CRED_TIMEOUT = 5.0          # seconds the credential socket has to answer
CONNECT_RETRY = 0.02        # seconds between connects while its listen queue is full
MAX_TOKEN_BYTES = 64 * 1024

_RUNNING_HINT = "is the daemon running? (systemctl status elasticd, or start one: elasticd --standalone)"
_GROUP_HINT = ("permission denied — join the 'elasticd' group (sudo usermod -aG elasticd $USER, "
               "then log in again) or run as root")

# Tokens fetched so far, by socket path: one fetch per process unless the
# daemon rejects the token (it expired during a long `wait` or `-f`).
_tokens: dict[str, str] = {}


class CtlError(Exception):
    """An error elasticctl reports in one line and exits with ``exit_code``."""

    exit_code = 1


class DaemonUnreachable(CtlError):
    """No daemon answers on the socket; exit code 3."""

    exit_code = 3

    def __init__(self, path: str, why: str):
        self.path = path
        self.why = why
        super().__init__(f"cannot reach elasticd at {path}: {why}")


class CredentialError(CtlError):
    """The daemon answered the credential socket with ``ERR ...``."""


def resolve_socket(explicit: str | None = None) -> str:
    """The control socket to use: --socket, $ELASTICD_SOCKET, then the defaults."""
    if explicit:
        return os.path.abspath(explicit)
    env = os.environ.get("ELASTICD_SOCKET")
    if env:
        return os.path.abspath(env)
    default = default_socket_path()
    if not os.path.lexists(default) and os.path.exists(SYSTEM_SOCKET) and \
            "ELASTICD_DAEMON_SOCKET" not in os.environ:
        return SYSTEM_SOCKET
    return default


def _os_reason(exc: OSError, what: str) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"no such {what} — {_RUNNING_HINT}"
    if isinstance(exc, PermissionError):
        return _GROUP_HINT
    if isinstance(exc, ConnectionRefusedError):
        return (f"nothing is listening on the {what} (a stale socket left by a stopped daemon?) "
                f"— {_RUNNING_HINT}")
    if isinstance(exc, socket.timeout):
        return f"the daemon did not answer on the {what} within {CRED_TIMEOUT:g} s (is it hung?)"
    if exc.errno == errno.ENOTSOCK:
        return "not a socket — point --socket at elasticd's control socket"
    return f"{exc.strerror or exc} — {_RUNNING_HINT}"


class UntrustedSocket(DaemonUnreachable):
    """The socket, or its directory, could belong to someone else; exit code 3."""


def _trusted(path: str, what: str, want_socket: bool) -> os.stat_result:
    """lstat ``path`` and refuse it unless root or we own it (as ssh and gpg-agent
    do): a socket anyone else made could collect what we send it."""
    st = os.lstat(path)
    me = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedSocket(path, f"the {what} is a symbolic link; refusing to follow it "
                                    "(give --socket the real path)")
    if want_socket and not stat.S_ISSOCK(st.st_mode):
        raise UntrustedSocket(path, f"the {what} is not a socket — point --socket at "
                                    "elasticd's control socket")
    if not want_socket and not stat.S_ISDIR(st.st_mode):
        raise UntrustedSocket(path, f"the {what} is not a directory")
    if st.st_uid not in (0, me):
        raise UntrustedSocket(path, f"the {what} belongs to uid {st.st_uid}, neither root nor "
                                    f"you (uid {me}); refusing to send it anything (someone "
                                    "may be impersonating elasticd)")
    return st


def check_socket(path: str) -> None:
    """Raise DaemonUnreachable unless ``path`` is a socket this user may connect to
    and can trust: the socket, its credential socket and their directory owned
    by root or by us, none a link, and the directory writable by nobody else
    (or sticky), so nobody else can put a socket there in its place."""
    directory = os.path.dirname(path) or "."
    try:
        st = _trusted(directory, f"socket's directory {directory}", want_socket=False)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UntrustedSocket(path, f"the socket's directory {directory} is writable by "
                                        "others; refusing to trust a socket there")
        _trusted(path, "socket", want_socket=True)
        cred = path + CRED_SUFFIX
        if os.path.lexists(cred):
            _trusted(cred, f"credential socket {cred}", want_socket=True)
    except UntrustedSocket:
        raise
    except OSError as exc:
        why = _os_reason(exc, "socket")
        if isinstance(exc, FileNotFoundError) and path != SYSTEM_SOCKET:
            # Said where the system daemon's would be too: between its restarts
            # neither exists, and the path above is then only this user's default.
            why = f"no such socket, nor the system daemon's {SYSTEM_SOCKET} — {_RUNNING_HINT}"
        raise DaemonUnreachable(path, why) from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise DaemonUnreachable(path, _GROUP_HINT)


def _connect_unix(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect a unix socket that has a timeout. Such a connect does not wait for
    room in a full listen queue (other clients, or someone holding connections
    open): it fails at once with EAGAIN, so try again until ``deadline``."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(CONNECT_RETRY)


def fetch_token(path: str) -> str:
    """Ask ``<path>.cred`` for a token; the daemon learns who we are from the kernel."""
    cred = path + CRED_SUFFIX
    data = b""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(CRED_TIMEOUT)
            _connect_unix(sock, cred, time.monotonic() + CRED_TIMEOUT)
            while len(data) <= MAX_TOKEN_BYTES:
                part = sock.recv(4096)
                if not part:
                    break
                data += part
    except OSError as exc:
        raise DaemonUnreachable(path, f"credential socket {cred}: "
                                      + _os_reason(exc, "credential socket")) from None
    line = data.decode("ascii", "replace").strip()
    if line.startswith("ERR"):
        msg = line[3:].strip() or "no reason given"
        raise CredentialError(f"elasticd refused a credential: {msg}")
    if not line or "\n" in line or len(data) > MAX_TOKEN_BYTES:
        raise DaemonUnreachable(path, f"credential socket {cred} gave no usable token "
                                      "(is it an elasticd socket?)")
    return line


def _is_token_rejected(exc: grpc.RpcError) -> bool:
    return isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


class Client:
    """One connection to elasticd's Control service."""

    def __init__(self, socket_path: str, *, timeout: float = UNARY_TIMEOUT):
        self.path = socket_path
        self.timeout = timeout
        self._channel: grpc.Channel | None = None
        self._stub: control_pb2_grpc.ControlStub | None = None

    def upcheck(self) -> None:
        """Check the socket and get a token; raise DaemonUnreachable if there is no daemon."""
        check_socket(self.path)
        self._token()
        if self._stub is None:
            self._channel = grpc.insecure_channel(f"unix:{self.path}")
            self._stub = control_pb2_grpc.ControlStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _token(self, refresh: bool = False) -> str:
        if refresh or self.path not in _tokens:
            _tokens[self.path] = fetch_token(self.path)
        return _tokens[self.path]

    def _metadata(self, refresh: bool = False) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self._token(refresh)),)

    def _method(self, name: str) -> Any:
        if self._stub is None:
            self.upcheck()
        return getattr(self._stub, name)

    def call(self, name: str, request: Any, *, wait: float = 0.0) -> Any:
        """A unary call; ``wait`` is how long the daemon may block on purpose."""
        method = self._method(name)
        deadline = self.timeout + wait
        try:
            return method(request, timeout=deadline, metadata=self._metadata())
        except grpc.RpcError as exc:
            if not _is_token_rejected(exc):
                raise self._map(exc) from None
        try:  # the cached token expired: fetch a new one, once
            return method(request, timeout=deadline, metadata=self._metadata(refresh=True))
        except grpc.RpcError as exc:
            raise self._map(exc) from None

    def stream(self, name: str, request: Any, *, timeout: float | None = None) -> Iterator[Any]:
        """A server stream; yields messages until the daemon ends it."""
        method = self._method(name)
        for attempt in (0, 1):
            call = method(request, timeout=timeout, metadata=self._metadata(refresh=attempt > 0))
            got_any = False
            try:
                for msg in call:
                    got_any = True
                    yield msg
                return
            except grpc.RpcError as exc:
                if attempt == 0 and not got_any and _is_token_rejected(exc):
                    continue
                raise self._map(exc) from None
            finally:
                call.cancel()

    def _map(self, exc: grpc.RpcError) -> Exception:
        """UNAVAILABLE means no daemon: DaemonUnreachable; other codes stay RpcErrors."""
        if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE:
            details = (exc.details() or "").strip()
            return DaemonUnreachable(self.path, f"{details or 'unavailable'} — {_RUNNING_HINT}")
        return exc

