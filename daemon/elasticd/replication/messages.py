"""The replication channel's two JSON messages, typed: a slot file offered, and the
receiver's reply; each built from a decoded frame in one place and serialised in one.

A frame's JSON goes through values.py ``decode`` (size cap first) and each field
through fields.py, so a peer that holds the key but sends nonsense is a
``ValueError`` naming the field, never a wrong write.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from .. import fields as f
from ..values import BadValue, decode
from ..workers import snapshot_format as fmt

MAX_JSON_BYTES = 4096
MAX_RANK = (1 << 20) - 1
MAX_STEP = (1 << 62)
MAX_FILE_BYTES = 1 << 50
MAX_WHY = 500


def _doc(raw: bytes) -> dict:
    try:
        return decode(raw, max_bytes=MAX_JSON_BYTES)
    except BadValue as exc:
        raise ValueError(str(exc)) from None


def is_node_id(name) -> bool:
    """Whether ``name`` may name a node, as an offer's ``origin`` must."""
    return f.is_ident(name)


@dataclass(frozen=True)
class Offer:
    """One complete slot file of a rank of a job on the sending node: its own, or a
    replica it keeps of ``origin``'s, forwarded."""
    job_id: str
    rank: int
    slot: str            # "a" or "b": the name the file has on the sender
    step: int
    saved_at_ns: int
    size: int            # bytes of the file that follow (header, meta, data)
    origin: str = ""     # a forwarded replica: the node whose snapshot it is ("": the sender)

    def to_bytes(self) -> bytes:
        doc = asdict(self)
        if not self.origin:
            del doc["origin"]
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Offer":
        doc = _doc(raw)
        slot = doc.get("slot")
        if slot not in fmt.ALL_SLOTS:
            raise ValueError(f"slot: not one of {', '.join(fmt.ALL_SLOTS)}")
        return cls(job_id=f.ident(doc, "job_id"), rank=f.whole(doc, "rank", 0, MAX_RANK),
                   slot=slot, step=f.whole(doc, "step", 0, MAX_STEP),
                   saved_at_ns=f.whole(doc, "saved_at_ns", 0, MAX_STEP),
                   size=f.whole(doc, "size", fmt.HEADER_BYTES, MAX_FILE_BYTES),
                   origin=f.ident(doc, "origin") if "origin" in doc else "")

    @property
    def name(self) -> str:
        return fmt.slot_name(self.rank, self.slot)


@dataclass(frozen=True)
class Reply:
    ok: bool
    have: bool = False   # to an offer: the receiver holds this very snapshot already
    why: str = ""        # a refusal, said so that the sender's log can carry it

    def to_bytes(self) -> bytes:
        return json.dumps({"ok": self.ok, "have": self.have, "why": self.why[:MAX_WHY]}
                          ).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Reply":
        doc = _doc(raw)
        return cls(ok=f.flag(doc, "ok"), have=f.flag(doc, "have", False),
                   why=f.text(doc, "why", MAX_WHY, ""))


@dataclass(frozen=True)
class Ask:
    """A peer's question: this node's snapshot row of a job (for `status` there)."""
    job_id: str

    def to_bytes(self) -> bytes:
        return json.dumps({"job_id": self.job_id}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Ask":
        return cls(job_id=f.ident(_doc(raw), "job_id"))
