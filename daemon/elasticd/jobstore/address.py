"""How a rank of an ``--inprocess`` job finds its job's store: the one contract.

The daemon sets these in the ranks' environment; ``elasticd.inprocess``
reads them. The job's secret (``SECRET``: 128 random bits made once per job
at submit by ``new_secret``, carried in the job's environment so every
node's ranks share it, never logged, never shown by ``status`` or
``events``) never reaches the store itself. Two values are derived from it
(HMAC-SHA256 as a keyed one-way function, so neither gives away the other
or the secret):

* ``key_prefix``: every key the ranks use lives under it, so a user who can
  connect to the store but does not know it cannot aim at the job's keys by
  name;
* ``record_key``: the key that seals every record the ranks act on
  (``elasticd.inprocess.records``).

torch's TCPStore has no authentication: its ``list_keys`` shows every key,
the prefix with it, to whoever connects, and such a user can overwrite or
delete keys. The prefix is then no secret, but the record key still is: a
planted or replayed record fails verification and is ignored. What such a
user can still do is delay or deny (docs/restarts.md, "Layer 1: in-process"),
never make the ranks act on a record they did not write.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

from ..workers import env as envnames

ADDR = envnames.STORE_ADDR
PORT = envnames.STORE_PORT
SECRET = envnames.STORE_SECRET
SECRET_BYTES = 16   # 128 bits


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def valid_secret(secret: str) -> bool:
    """At least 128 bits in hex, as ``new_secret`` makes them."""
    try:
        return len(secret) >= 2 * SECRET_BYTES and bool(bytes.fromhex(secret))
    except ValueError:
        return False


def _derive(secret: str, purpose: bytes) -> bytes:
    return hmac.new(secret.encode("ascii"), b"elasticd job store\0" + purpose,
                    hashlib.sha256).digest()


def store_id(secret: str) -> str:
    """The job's name in its store (what ``list_keys`` shows), derived from the secret."""
    return _derive(secret, b"key prefix").hex()[:2 * SECRET_BYTES]


def record_key(secret: str) -> bytes:
    """The HMAC key of the ranks' records; never written anywhere."""
    return _derive(secret, b"record key")


def key_prefix(secret: str, rnd: str, attempt: str) -> str:
    """The ranks' key prefix for one round and process attempt."""
    return f"{store_id(secret)}/elasticd/inprocess/r{rnd}a{attempt}/"
