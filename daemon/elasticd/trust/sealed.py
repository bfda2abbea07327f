"""Records in etcd a daemon vouches for: sealed with the cluster key, opened by the others.

Every value a daemon writes under its prefix, but the job spec (sealed by
trust/specs.py under its own key), is stored as::

    e1.<seq>.<mac>.<body>

``body`` is the record's JSON, as the record serialised itself; ``seq`` its
writer's count, a decimal that rises across that daemon's writes (the
microseconds of its wall clock, at least one more than its last, and above
every count the daemon handed out before a restart: trust/seqmark.py), so a
reader holding a newer record of a key can refuse an older one put back;
``mac`` is hex HMAC-SHA256, under the records key (clusterkey: its own HKDF
label), over::

    DOMAIN | etcd prefix | NUL | full key name | NUL | seq | NUL | body

so a genuine record copied to another key (another job, round, node, kind)
or another cluster's prefix does not verify. The key name carries the job,
the round (joins, done marks) and the node; what else gives a record its
meaning (a round state's round) is in its body.

``open`` takes the key name and what etcd holds there and returns ``Opened``
(the body decoded by values.decode, and the seq) or raises
``Refused`` with a bounded ``Reason``; nothing else. The size cap comes before
any hashing, the MAC before any parsing. ``PlainRecords`` is the torchrun
adapter's: it runs without a cluster key under its users' own prefix, so
its records are the body alone, decoded the same way.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass

from ..values import BadValue, as_bytes, decode

VERSION = b"e1."
DOMAIN = b"elasticd/v1 etcd-record\0"
_MAC_HEX = 2 * hashlib.sha256().digest_size     # 64
_SEQ_DIGITS = 20
HEADER_MAX = len(VERSION) + _SEQ_DIGITS + 1 + _MAC_HEX + 1


class Kind(str, enum.Enum):
    """What a key under the daemons' prefix holds: the metric's ``kind`` label."""
    SPEC = "spec"            # /v1/jobs/<job>/spec (trust/specs.py)
    STATE = "state"          # /v1/rounds/<job>/state, and its copy /v1/jobs/<job>/state
    JOIN = "join"            # /v1/joins/<job>/round/<round>/<node>
    DECIDER = "decider"      # /v1/rounds/<job>/decider/<round>
    DONE = "done"            # /v1/joins/<job>/done/<round>/<node>
    WORKERS = "workers"      # /v1/workers/<job>/rows/<node>
    PHASES = "phases"        # /v1/phases/<job>/<node>
    NODE = "node"            # /v1/nodes/<node>
    DRAIN = "drain"          # /v1/drain/<node>
    FAULTS = "faults"        # /v1/faults/<node> (cluster/faults.py)
    EVENT = "event"          # /v1/events/<job>/<node>/<seq>
    WITNESS = "witness"      # /v1/witnesses/<slot> (cluster/witness.py)
    LOST = "lost"            # /v1/lost/<node> (cluster/witness.py)
    KEY = "key"              # a key no daemon writes


# The most bytes a body of each kind may have, as written and as read: a writer
# refuses to write more, a reader to read more (before any hashing).
MAX_BODY = {Kind.STATE: 1 << 20, Kind.JOIN: 4096, Kind.DECIDER: 512, Kind.DONE: 256,
            Kind.WORKERS: 512 * 1024, Kind.PHASES: 40 * 1024, Kind.NODE: 256 * 1024,
            Kind.DRAIN: 20 * 1024, Kind.EVENT: 64 * 1024, Kind.FAULTS: 48 * 1024,
            Kind.WITNESS: 512, Kind.LOST: 256 * 1024 + 1024}


class Reason(str, enum.Enum):
    """Why a record from etcd was refused: the metric's ``reason`` label."""
    UNSIGNED = "unsigned"        # not sealed: a forgery, or an older daemon's record
    BAD_MAC = "bad_mac"          # changed, moved to another key, or another cluster key's
    BAD_KEY = "bad_key"          # a key name no daemon writes
    TOO_LARGE = "too_large"
    NOT_TEXT = "not_text"
    NOT_JSON = "not_json"
    TOO_DEEP = "too_deep"
    BAD_NUMBER = "bad_number"
    WRONG_TYPE = "wrong_type"
    INVALID = "invalid"          # a field missing, of the wrong type or out of range
    REPLAYED = "replayed"        # genuine, but older than what this daemon holds
    ERROR = "error"              # handling it failed (a bug: logged with its traceback)

    @classmethod
    def of(cls, bad: BadValue) -> "Reason":
        return cls(bad.why.value)


class Refused(Exception):
    """One record refused; ``reason`` is the label, the message one line for a log."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Opened:
    doc: dict          # the body, decoded
    seq: int           # its writer's count (0: a plain record, no order known)


def _raw(value, cap: int) -> bytes:
    try:
        return as_bytes(value, cap)
    except BadValue as bad:
        raise Refused(Reason.of(bad), bad.detail) from None


def _decode(body: bytes, kind: Kind) -> dict:
    try:
        return decode(body, max_bytes=MAX_BODY[kind], want=dict)
    except BadValue as bad:
        raise Refused(Reason.of(bad), bad.detail) from None


class SealedRecords:
    """Seals what this daemon writes and opens what it reads (see the module doc)."""

    signed = True

    def __init__(self, key: bytes, domain: str, clock=time.time_ns, mark=None):
        """``mark`` (trust/seqmark.py's SeqMark, or None) keeps the writer's count above
        every count an earlier process of this daemon handed out."""
        if len(key) < 16:
            raise ValueError("the records key must have at least 128 bits")
        self._key = key
        self._domain = domain.encode("utf-8")
        self._clock = clock
        self._lock = threading.Lock()
        self._mark = mark
        self._last = mark.reserved if mark is not None else 0

    def __repr__(self) -> str:  # never the key in a log or a traceback
        return f"SealedRecords(domain={self._domain.decode()!r})"

    def _mac(self, key: str, seq: bytes, body: bytes) -> bytes:
        msg = b"".join((DOMAIN, self._domain, b"\0", key.encode("utf-8", "surrogatepass"),
                        b"\0", seq, b"\0", body))
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode("ascii")

    def next_seq(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, self._clock() // 1000)
            if self._mark is not None:
                self._mark.reach(self._last)
            return self._last

    def seal(self, kind: Kind, key: str, body: str) -> str:
        """The value to store at ``key`` for a record whose JSON is ``body``."""
        raw = body.encode("utf-8")
        if len(raw) > MAX_BODY[kind]:
            raise ValueError(f"a {kind.value} record holds at most {MAX_BODY[kind]} bytes, "
                             f"not {len(raw)}")
        if "\0" in key:
            raise ValueError("a key name holds no NUL")
        seq = str(self.next_seq()).encode("ascii")
        return (VERSION + seq + b"." + self._mac(key, seq, raw) + b"." + raw).decode("utf-8")

    def open(self, kind: Kind, key: str, value) -> Opened:
        """The record stored at ``key``, verified and decoded; Refused otherwise."""
        raw = _raw(value, MAX_BODY[kind] + HEADER_MAX)
        if not raw.startswith(VERSION):
            raise Refused(Reason.UNSIGNED, "not sealed with the cluster key (a forgery, or a "
                                           "record of an older elasticd)")
        seq, _, rest = raw[len(VERSION):].partition(b".")
        mac, dot, body = rest.partition(b".")
        if not dot or not 0 < len(seq) <= _SEQ_DIGITS or not seq.isdigit() \
                or len(mac) != _MAC_HEX:
            raise Refused(Reason.UNSIGNED, "not in the sealed format")
        if len(body) > MAX_BODY[kind]:
            raise Refused(Reason.TOO_LARGE, f"a body of {len(body)} bytes, over "
                                            f"{MAX_BODY[kind]}")
        if "\0" in key:
            raise Refused(Reason.BAD_KEY, "a key name with a NUL")
        if not hmac.compare_digest(mac, self._mac(key, seq, body)):
            raise Refused(Reason.BAD_MAC, "its MAC does not match (changed, moved from "
                                          "another key, or sealed with another cluster key)")
        return Opened(_decode(body, kind), int(seq))


class PlainRecords:
    """Records without a MAC (the torchrun adapter's prefix): decoded, never vouched for."""

    signed = False

    def seal(self, kind: Kind, key: str, body: str) -> str:
        if len(body.encode("utf-8")) > MAX_BODY[kind]:
            raise ValueError(f"a {kind.value} record holds at most {MAX_BODY[kind]} bytes")
        return body

    def open(self, kind: Kind, key: str, value) -> Opened:
        return Opened(_decode(_raw(value, MAX_BODY[kind]), kind), 0)


PLAIN = PlainRecords()
