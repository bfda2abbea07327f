"""Authenticated records in the job store: what a rank writes, only ranks can forge.

torch's TCPStore lets anyone who connects list, read, overwrite and delete
every key. So every value the ranks act on (barrier markers, done markers,
fault reports) is sealed with HMAC-SHA256 under the job's record key (see
``jobstore_env.record_key``), a key that never reaches the store, and read
back through ``open``, which ignores anything that does not verify.

The MAC covers the record's full logical name (store prefix, round,
process attempt, iteration, key) and its payload, so a genuine record
copied to another key (the next iteration's, another rank's, another
job's) fails too. A sealed value is

    b"v1." + hex(HMAC-SHA256(key, b"elasticd-inprocess-record\\0" + name + b"\\0" + payload))
           + b"." + payload

and a value longer than ``MAX_VALUE`` is refused before any hashing.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections import Counter
from typing import Callable

log = logging.getLogger("elasticd.inprocess")

VERSION = b"v1."
DOMAIN = b"elasticd-inprocess-record\0"
MAX_PAYLOAD = 2048                            # a fault reason is cut to 500 characters
_TAG_HEX = 2 * hashlib.sha256().digest_size   # 64
MAX_VALUE = len(VERSION) + _TAG_HEX + 1 + MAX_PAYLOAD


class RecordSealer:
    """Seals and opens the records under one scope (a key-name prefix) of a job's store.

    ``within(suffix)`` gives the sealer of a sub-scope (an iteration); all of
    them share one count of rejected records per kind, and each kind is
    logged once, the first time (never the value: it may be anyone's).
    """

    def __init__(self, key: bytes, scope: str, label: str = "",
                 rejected: Counter | None = None,
                 on_first_reject: Callable[[str], None] | None = None):
        if len(key) < 16:
            raise ValueError("the job-store record key must have at least 128 bits")
        self._key = key
        self.scope = scope
        self._label = label              # what to name in logs: no secret-derived prefix
        self.rejected = Counter() if rejected is None else rejected
        self._on_first_reject = on_first_reject   # told the kind, once per kind

    def within(self, suffix: str) -> "RecordSealer":
        return RecordSealer(self._key, self.scope + suffix, self._label + suffix, self.rejected,
                            self._on_first_reject)

    def seal(self, name: str, payload: bytes) -> bytes:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(f"a job-store record holds at most {MAX_PAYLOAD} bytes")
        return VERSION + self._tag(name, payload) + b"." + payload

    def open(self, name: str, value, kind: str) -> bytes | None:
        """The payload of a genuine record stored at ``name``; None (counted) otherwise."""
        if isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape")
        if isinstance(value, (bytes, bytearray)) and len(value) <= MAX_VALUE \
                and value.startswith(VERSION):
            value = bytes(value)
            tag, dot, payload = value[len(VERSION):].partition(b".")
            if dot and hmac.compare_digest(tag, self._tag(name, payload)):
                return payload
        self.rejected[kind] += 1
        if self.rejected[kind] == 1:
            log.warning("ignored a job-store record that failed authentication (%s at %s%s): "
                        "someone other than this job's ranks wrote to its store; it is never "
                        "acted on (logged once per kind)", kind, self._label, name)
            if self._on_first_reject is not None:
                self._on_first_reject(kind)
        return None

    def _tag(self, name: str, payload: bytes) -> bytes:
        msg = DOMAIN + (self.scope + name).encode("utf-8") + b"\0" + payload
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode("ascii")
