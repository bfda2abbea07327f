"""How a rank of an ``--inprocess`` job finds its job's store: the one contract.

The daemon sets these in the ranks' environment; ``elasticd.inprocess``
reads them. Every key the ranks use lives under ``key_prefix()``, which
starts with the job's secret: 128 random bits made once per job at submit
(``new_secret``), carried in the job's environment (so every node's ranks
share it), never logged, never shown by ``status`` or ``events``.

A user who can connect to the store but does not know the secret cannot aim
at the job's keys by name. What the secret does not stop: torch's TCPStore
has no authentication, and its ``list_keys`` request shows every key (the
prefix with it) to whoever connects; see README "In-process restart: the
job store" for how to keep others from connecting at all.
"""
from __future__ import annotations

import secrets

ADDR = "ELASTICD_STORE_ADDR"
PORT = "ELASTICD_STORE_PORT"
SECRET = "ELASTICD_STORE_SECRET"
SECRET_BYTES = 16   # 128 bits


def new_secret() -> str:
    return secrets.token_hex(SECRET_BYTES)


def key_prefix(secret: str, rnd: str, attempt: str) -> str:
    """The ranks' key prefix for one round and process attempt."""
    return f"{secret}/elasticd/inprocess/r{rnd}a{attempt}/"
