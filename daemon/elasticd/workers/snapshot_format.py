"""The snapshot slot file's header: the one layout the worker library and the daemon share.

A rank's snapshots live in four slot files in the job's snapshot dir
(``env.SNAPSHOT_DIR``), two pairs: ``rank{rank}.p0`` / ``.p1`` take the saves of
a step on the pin grid (a multiple of ``env.SNAPSHOT_PIN_EVERY``: ``pinned``),
``rank{rank}.a`` / ``.b`` every other save. Within its pair a save overwrites the
slot that does not hold the pair's newest complete snapshot, so the newest stays
whole until the new one is complete, and the two newest grid steps stay however
often a rank saves (the daemon replicates only those: they are what the ranks of
a lost node and the survivors still hold in common). A slot file is

    [header: HEADER_BYTES][meta: meta_len bytes of JSON][pad to DATA_ALIGN][tensor data]

The header is written twice per save: first with ``state=WRITING`` (the slot
is no longer a snapshot from then on), last with ``state=COMPLETE`` and the
step. Its CRC covers every field before it, so a header torn by a crash reads
as no snapshot at all. The meta JSON (structure, dtypes, shapes, offsets) is
the worker library's (elasticd.snapshot); the daemon reads only headers, to
show the newest step, its age and size.

Beside its slots each rank keeps ``rank{rank}.costs``: what its last save held
the caller and what its last restore took and where from (``RankCosts``, a
JSON object of at most ``COSTS_MAX`` bytes), which the daemon exports as
metrics. The library writes it (``RankCosts.to_json``); the daemon reads it as
it reads any file a worker can write and parses it with ``RankCosts.from_doc``.

Stdlib only, imports nothing of the daemon's: elasticd.snapshot (worker side)
and the daemon both import it.
"""
from __future__ import annotations

import enum
import json
import math
import re
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"ELSNAP01"
VERSION = 1
HEADER_BYTES = 4096          # the header's room; data after it stays page aligned
DATA_ALIGN = 4096            # tensor data starts at a multiple of this
SLOTS = ("a", "b")           # the pair of saves off the pin grid
PIN_SLOTS = ("p0", "p1")     # the pair of saves on it
ALL_SLOTS = SLOTS + PIN_SLOTS
SLOT_NAME = "rank{rank}.{slot}"
# fullmatch: a slot file's name (rank, slot); the one pattern the library, the
# daemon's status reader and the replica forwarder all take a slot file by
SLOT_FILE = re.compile(r"rank(0|[1-9][0-9]{0,8})\.(%s)" % "|".join(ALL_SLOTS))

# magic, version, state, rank, world_size, step, saved_at_ns, meta_len, data_len, crc32
_LAYOUT = struct.Struct("<8sIIiiqqQQ")
_CRC = struct.Struct("<I")
HEADER_USED = _LAYOUT.size + _CRC.size

MAX_META_BYTES = 64 << 20    # a structure description larger than this is refused
COSTS_NAME = "rank{rank}.costs"
COSTS_FILE = re.compile(r"rank(0|[1-9][0-9]{0,8})\.costs")   # fullmatch: a costs file's name
COSTS_MAX = 512              # bytes of a rank's costs file, as written and as read
RESTORE_SOURCES = ("local", "peer", "none")
_MAX_SECONDS = 1e6


@dataclass(frozen=True)
class RankCosts:
    """What a rank's last save and restore cost (``rank{rank}.costs``)."""
    save_stall_s: float | None = None     # how long its last save held the caller
    restore_s: float | None = None        # how long its last restore() took
    restore_source: str | None = None     # where that restore found its step

    def to_json(self) -> str:
        return json.dumps({"save_stall_s": self.save_stall_s, "restore_s": self.restore_s,
                           "restore_source": self.restore_source}, allow_nan=False)

    @classmethod
    def from_doc(cls, doc) -> "RankCosts":
        """From the decoded file; ValueError for anything but what ``to_json`` writes."""
        if not isinstance(doc, dict) or set(doc) != {"save_stall_s", "restore_s",
                                                      "restore_source"}:
            raise ValueError("not a rank's costs")
        for key in ("save_stall_s", "restore_s"):
            v = doc[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not math.isfinite(v) or not 0 <= v <= _MAX_SECONDS):
                raise ValueError(f"{key} out of range")
        src = doc["restore_source"]
        if src is not None and src not in RESTORE_SOURCES:
            raise ValueError("unknown restore source")
        if (src is None) != (doc["restore_s"] is None):
            raise ValueError("a restore time without its source, or the other way")
        return cls(doc["save_stall_s"], doc["restore_s"], src)


class SlotState(enum.IntEnum):
    WRITING = 1
    COMPLETE = 2


class BadHeader(ValueError):
    """A slot file whose header is not a complete, intact snapshot header."""


@dataclass(frozen=True)
class Header:
    state: SlotState
    rank: int
    world_size: int
    step: int
    saved_at_ns: int
    meta_len: int
    data_len: int

    @property
    def data_offset(self) -> int:
        return data_offset(self.meta_len)

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.data_len


def data_offset(meta_len: int) -> int:
    """Where tensor data starts for a meta of ``meta_len`` bytes."""
    end = HEADER_BYTES + meta_len
    return (end + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN


def slot_name(rank: int, slot: str) -> str:
    if slot not in ALL_SLOTS:
        raise ValueError(f"slot must be one of {ALL_SLOTS}, not {slot!r}")
    return SLOT_NAME.format(rank=rank, slot=slot)


def pinned(step: int, pin_every: int) -> bool:
    """Whether a save of ``step`` goes into the pin pair (``pin_every`` 0: never)."""
    return pin_every > 0 and step % pin_every == 0


def pair(step: int, pin_every: int) -> tuple:
    """The two slots a save of ``step`` may write."""
    return PIN_SLOTS if pinned(step, pin_every) else SLOTS


def pack(h: Header) -> bytes:
    """The header's bytes (HEADER_USED of them; the rest of HEADER_BYTES stays zero)."""
    body = _LAYOUT.pack(MAGIC, VERSION, int(h.state), h.rank, h.world_size, h.step,
                        h.saved_at_ns, h.meta_len, h.data_len)
    return body + _CRC.pack(zlib.crc32(body))


def parse(raw: bytes) -> Header:
    """The header at the start of ``raw``; BadHeader when it is short, foreign
    or torn. Field ranges are checked, so a parsed header never points outside
    what its numbers promise."""
    if len(raw) < HEADER_USED:
        raise BadHeader("shorter than a header")
    body = raw[:_LAYOUT.size]
    (crc,) = _CRC.unpack_from(raw, _LAYOUT.size)
    if zlib.crc32(body) != crc:
        raise BadHeader("checksum does not match (torn or foreign)")
    magic, version, state, rank, world, step, saved, meta_len, data_len = _LAYOUT.unpack(body)
    if magic != MAGIC:
        raise BadHeader("not a snapshot slot")
    if version != VERSION:
        raise BadHeader(f"format version {version}, this build reads {VERSION}")
    try:
        st = SlotState(state)
    except ValueError:
        raise BadHeader(f"unknown state {state}") from None
    if rank < 0 or world < 1 or rank >= world:
        raise BadHeader(f"rank {rank} of world {world}")
    if step < 0 or saved < 0:
        raise BadHeader("negative step or time")
    if meta_len > MAX_META_BYTES:
        raise BadHeader(f"meta of {meta_len} bytes")
    return Header(st, rank, world, step, saved, meta_len, data_len)
