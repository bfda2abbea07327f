"""The cluster key: one secret shared by every daemon of a cluster.

``/etc/elasticd/cluster.key`` (``cluster.key_file``) holds 32 random bytes
as hex. ``generate`` writes a fresh one (``elasticd keygen``): created with
O_EXCL and mode 0600 given to open(), then fchmod'ed, never left to the
umask. ``load`` refuses a key that is not a regular file owned by this
daemon's user, or that its group or others may read: a key anyone can read
vouches for nothing. Four keys are derived from it with HKDF-SHA256 under
distinct labels, one to sign job specs, one to encrypt their secrets
(trust/specs.py), one to vouch for every other record a daemon writes
to etcd (trust/sealed.py) and one for the daemon-to-daemon replication
channel (replication/channel.py), so no use weakens another.
"""
from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
_MAX_FILE_BYTES = 4096
_MAC_INFO = b"elasticd/v1 job-spec hmac-sha256"
_ENC_INFO = b"elasticd/v1 job-spec aes-256-gcm"
_RECORDS_INFO = b"elasticd/v1 etcd-record hmac-sha256"
_REPLICATION_INFO = b"elasticd/v1 replication-channel"
HOW_TO_MAKE = ("make one with `elasticd keygen` and copy that same file (root-owned, mode "
               "0600) to every node")


class ClusterKeyError(Exception):
    """The key file is missing, unreadable, unsafe or malformed; the message says how
    to fix it."""


@dataclass(frozen=True)
class DerivedKeys:
    mac: bytes      # HMAC-SHA256 key for job specs
    enc: bytes      # AES-256-GCM key for the secret fields of job specs
    records: bytes  # HMAC-SHA256 key for rounds, joins, node records, phases, events
    replication: bytes = b""  # the replication channel's handshake and session keys

    def __repr__(self) -> str:  # never in a log or a traceback
        return "DerivedKeys(<secret>)"


def derive(master: bytes) -> DerivedKeys:
    def one(info: bytes) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(master)
    return DerivedKeys(mac=one(_MAC_INFO), enc=one(_ENC_INFO), records=one(_RECORDS_INFO),
                       replication=one(_REPLICATION_INFO))


def ephemeral() -> DerivedKeys:
    """Keys for a standalone daemon: its records never leave its memory."""
    return derive(secrets.token_bytes(KEY_BYTES))


def generate(path: str, force: bool = False) -> None:
    """Write a fresh random key to ``path`` (0600). An existing file is an error
    unless ``force``; then the new key replaces it atomically."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.lexists(path) and not force:
        raise ClusterKeyError(f"{path} already exists; every node must keep the same key. "
                              "Pass --force to replace it (then copy it to every node again)")
    os.makedirs(directory, mode=0o755, exist_ok=True)
    target = path if not force else os.path.join(
        directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(target, flags, 0o600)
    except FileExistsError:
        raise ClusterKeyError(f"{path} already exists; pass --force to replace it") from None
    except OSError as exc:
        raise ClusterKeyError(f"cannot create {target}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secrets.token_bytes(KEY_BYTES).hex() + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(target)
        raise
    os.close(fd)
    if target != path:
        os.replace(target, path)


def load(path: str) -> DerivedKeys:
    """The derived keys of the key file at ``path``, after checking the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ClusterKeyError(f"no cluster key at {path} (cluster.key_file): a daemon on etcd "
                              f"signs and checks every job with it; {HOW_TO_MAKE}") from None
    except OSError as exc:
        raise ClusterKeyError(f"cannot open the cluster key {path}: {exc.strerror} "
                              "(a symlink is refused; run elasticd as root)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ClusterKeyError(f"the cluster key {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise ClusterKeyError(f"the cluster key {path} is owned by uid {st.st_uid}, not "
                                  f"by this daemon's uid {os.geteuid()}: chown it")
        if st.st_mode & 0o077:
            raise ClusterKeyError(f"the cluster key {path} has mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}; others could read it. "
                                  f"chmod 0600 {path} (and if it was readable for long, "
                                  "make a new one everywhere)")
        raw = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_FILE_BYTES:
        raise ClusterKeyError(f"the cluster key {path} is too large to be one")
    try:
        master = bytes.fromhex(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise ClusterKeyError(f"the cluster key {path} is not hex; {HOW_TO_MAKE}") from None
    if len(master) < KEY_BYTES:
        raise ClusterKeyError(f"the cluster key {path} has {len(master)} bytes, at least "
                              f"{KEY_BYTES} are needed; {HOW_TO_MAKE}")
    return derive(master)
