"""The replication channel's wire: a handshake that proves both daemons hold the cluster's
replication key, then length-prefixed frames sealed with AES-256-GCM.

Handshake (``client_hello`` / ``server_accept``): each side sends the magic, its
node id and 32 fresh random bytes; the server answers with an HMAC-SHA256 under
the replication key (trust/clusterkey.py) over a label, the domain (the etcd
prefix), both ids and both nonces; the client checks it and answers with its own
HMAC under another label. Neither MAC can stand for the other, and the fresh
nonces make every session's MACs new, so a recorded session proves nothing.
Each direction then gets its own AES-256-GCM key, HKDF'd from the replication
key with both nonces as salt and the ids and direction in the info; a frame's
nonce is its number in that direction (never reused: a key lives one session),
and its 4-byte length is the associated data.

A frame is ``[length: 4 bytes big-endian][ciphertext of (kind: 1 byte, payload)]``.
Every read is bounded before it is made (``max_frame``) and waits at most the
socket's timeout; whatever is wrong ends the connection with a ``ChannelError``
naming one ``Refusal``, for the caller to count.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..fields import is_ident

MAGIC = b"ELREPL01"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_ID_BYTES = 253
_LEN = struct.Struct(">I")
_TAG = 16
_SERVER_LABEL = b"elasticd/v1 replication server-proof"
_CLIENT_LABEL = b"elasticd/v1 replication client-proof"
_SESSION_LABEL = b"elasticd/v1 replication session"


class Refusal(str, enum.Enum):
    """Why a connection was dropped (the metric's ``reason`` label)."""
    GARBAGE = "garbage"        # not our magic, a bad id, a frame that does not parse
    MAC = "mac"                # a handshake MAC or a frame's tag that does not verify
    TOO_LARGE = "too_large"    # a frame over replication_max_frame
    TIMEOUT = "timeout"        # silent longer than replication_timeout
    CLOSED = "closed"          # the peer hung up mid-way
    BUSY = "busy"              # replication_max_peers connections already served
    REFUSED = "refused"        # the peer's offer was refused (a job not here, over budget)


class ChannelError(Exception):
    def __init__(self, why: Refusal, detail: str = ""):
        super().__init__(f"{why.value}: {detail}" if detail else why.value)
        self.why = why


class Kind(enum.IntEnum):
    OFFER = 1   # JSON: a slot file the client would send (messages.Offer)
    REPLY = 2   # JSON: the server's answer to an offer or an END (messages.Reply)
    CHUNK = 3   # raw bytes of the offered file, in order
    END = 4     # the file is whole (empty payload)
    ABORT = 5   # the file changed while it was read: drop what came
    ASK = 6     # JSON: a peer asks for this node's snapshot row of a job (messages.Ask)
    ROW = 7     # JSON: the answer (messages.SnapshotRow)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (each read waits at most the socket's timeout)."""
    got, n = 0, len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except socket.timeout:
            raise ChannelError(Refusal.TIMEOUT, "the peer stayed silent") from None
        except OSError as exc:
            raise ChannelError(Refusal.CLOSED, exc.strerror or str(exc)) from None
        if not k:
            raise ChannelError(Refusal.CLOSED, "the peer closed the connection")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _send(sock: socket.socket, data) -> None:
    try:
        sock.sendall(data)
    except socket.timeout:
        raise ChannelError(Refusal.TIMEOUT, "the peer does not read") from None
    except OSError as exc:
        raise ChannelError(Refusal.CLOSED, exc.strerror or str(exc)) from None


def _hello(node_id: str, nonce: bytes) -> bytes:
    raw = node_id.encode()
    return MAGIC + bytes([len(raw)]) + raw + nonce


def _read_hello(sock: socket.socket) -> tuple[str, bytes]:
    if _recv_exact(sock, len(MAGIC)) != MAGIC:
        raise ChannelError(Refusal.GARBAGE, "not a replication peer (bad magic)")
    n = _recv_exact(sock, 1)[0]
    raw = _recv_exact(sock, n)
    try:
        node_id = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ChannelError(Refusal.GARBAGE, "a node id that is not ASCII") from None
    if not is_ident(node_id):
        raise ChannelError(Refusal.GARBAGE, "not a node id")
    return node_id, _recv_exact(sock, NONCE_BYTES)


def _transcript(domain: str, client: str, server: str, nc: bytes, ns: bytes) -> bytes:
    parts = [domain.encode(), client.encode(), server.encode(), nc, ns]
    return b"".join(_LEN.pack(len(p)) + p for p in parts)


def _mac(key: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, label + transcript, hashlib.sha256).digest()


def _session_key(key: bytes, salt: bytes, transcript: bytes, direction: bytes) -> AESGCM:
    info = _SESSION_LABEL + b" " + direction + b" " + hashlib.sha256(transcript).digest()
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=salt,
                       info=info).derive(key))


class Channel:
    """One authenticated, encrypted connection; ``peer`` is the other daemon's node id.

    A frame is sealed into, and opened from, buffers the channel keeps and grows to
    the largest frame it has carried: a chunk of a slot file costs one copy into the
    plaintext buffer and the cipher's own pass, never a fresh allocation per frame
    (fresh pages for every megabyte cost more CPU than the AES-GCM itself). What
    ``recv`` returns is a view of such a buffer: valid until the next ``recv``."""

    def __init__(self, sock: socket.socket, peer: str, send_key: AESGCM, recv_key: AESGCM,
                 max_frame: int):
        self.sock, self.peer, self.max_frame = sock, peer, max_frame
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._got = 0
        self.bytes_sent = self.bytes_got = 0
        self._plain_out = self._sealed = self._sealed_in = self._plain_in = bytearray()

    def send(self, kind: Kind, payload=b"") -> None:
        """Seal and send one frame; ``payload`` is any bytes-like object."""
        n = len(payload)
        if n > self.max_frame:
            raise ValueError(f"a frame of {n} bytes, over {self.max_frame}")
        size = 1 + n + _TAG
        if len(self._sealed) < _LEN.size + size:
            self._plain_out = bytearray(1 + n)
            self._sealed = bytearray(_LEN.size + size)
        plain, sealed = memoryview(self._plain_out), memoryview(self._sealed)
        plain[0] = kind
        plain[1:1 + n] = payload
        _LEN.pack_into(sealed, 0, size)
        self._send_key.encrypt_into(self._sent.to_bytes(12, "big"), plain[:1 + n],
                                    sealed[:_LEN.size], sealed[_LEN.size:_LEN.size + size])
        self._sent += 1
        _send(self.sock, sealed[:_LEN.size + size])
        self.bytes_sent += _LEN.size + size

    def recv(self) -> tuple[Kind, memoryview]:
        """The next frame's kind and payload (a view, valid until the next ``recv``)."""
        head = _recv_exact(self.sock, _LEN.size)
        (size,) = _LEN.unpack(head)
        if size > self.max_frame + 1 + _TAG:
            raise ChannelError(Refusal.TOO_LARGE, f"a frame of {size} bytes, over "
                               f"{self.max_frame} (snapshot.replication_max_frame)")
        if size < 1 + _TAG:
            raise ChannelError(Refusal.GARBAGE, "a frame too short to be one")
        if len(self._sealed_in) < size:
            self._sealed_in, self._plain_in = bytearray(size), bytearray(size - _TAG)
        sealed, plain = memoryview(self._sealed_in)[:size], memoryview(self._plain_in)
        _recv_into(self.sock, sealed)
        try:
            self._recv_key.decrypt_into(self._got.to_bytes(12, "big"), sealed, head,
                                        plain[:size - _TAG])
        except InvalidTag:
            raise ChannelError(Refusal.MAC, "a frame that does not verify") from None
        self._got += 1
        self.bytes_got += len(head) + size
        try:
            return Kind(plain[0]), plain[1:size - _TAG]
        except ValueError:
            raise ChannelError(Refusal.GARBAGE, f"unknown frame kind {plain[0]}") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def client_hello(sock: socket.socket, key: bytes, domain: str, me: str, expect: str,
                 max_frame: int) -> Channel:
    """Authenticate to the server at the other end of ``sock`` (which must be node
    ``expect``); the channel, or ChannelError."""
    nc = os.urandom(NONCE_BYTES)
    _send(sock, _hello(me, nc))
    server, ns = _read_hello(sock)
    if server != expect:
        raise ChannelError(Refusal.GARBAGE, f"the listener is node {server}, not {expect}")
    t = _transcript(domain, me, server, nc, ns)
    if not hmac.compare_digest(_recv_exact(sock, MAC_BYTES), _mac(key, _SERVER_LABEL, t)):
        raise ChannelError(Refusal.MAC, f"node {server} does not hold this cluster's key")
    _send(sock, _mac(key, _CLIENT_LABEL, t))
    return Channel(sock, server, _session_key(key, nc + ns, t, b"c2s"),
                   _session_key(key, nc + ns, t, b"s2c"), max_frame)


def server_accept(sock: socket.socket, key: bytes, domain: str, me: str,
                  max_frame: int) -> Channel:
    """Authenticate the client at the other end of ``sock``; the channel, or ChannelError."""
    client, nc = _read_hello(sock)
    ns = os.urandom(NONCE_BYTES)
    t = _transcript(domain, client, me, nc, ns)
    _send(sock, _hello(me, ns) + _mac(key, _SERVER_LABEL, t))
    if not hmac.compare_digest(_recv_exact(sock, MAC_BYTES), _mac(key, _CLIENT_LABEL, t)):
        raise ChannelError(Refusal.MAC, f"the client calling itself {client} does not hold "
                           "this cluster's key")
    return Channel(sock, client, _session_key(key, nc + ns, t, b"s2c"),
                   _session_key(key, nc + ns, t, b"c2s"), max_frame)
