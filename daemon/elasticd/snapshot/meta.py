"""A slot's meta: where each tensor lies in the data (dtype, shape, device, offset),
the state's tree, sealed with a CRC; encoded for a save, checked when read back.

The meta bytes are ``b"%08x\\n" % crc32(json) + json``: the header's CRC covers the
header only, so the meta carries its own. A meta that does not decode, does not
match its CRC, or places a tensor outside the data it describes is BadMeta, and
the slot counts as absent.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

import torch

from .. import values
from ..workers import snapshot_format as fmt
from .structure import MAX_DEPTH, Flat

ALIGN = 64            # each tensor's data starts at a multiple of this (data is page aligned)
META_VERSION = 1
_CRC_LEN = 9          # 8 hex digits and a newline


class BadMeta(ValueError):
    """A meta this module would not have written, or one that does not fit its slot."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple
    device: str       # as saved: "cpu", "cuda:0"
    offset: int       # from the start of the data
    nbytes: int


@dataclass(frozen=True)
class Meta:
    tree: list
    tensors: tuple    # of TensorSpec
    data_len: int


def plan(flat: Flat) -> Meta:
    """Where each of ``flat``'s tensors goes in the data."""
    specs, at = [], 0
    for t in flat.tensors:
        n = t.numel() * t.element_size()
        specs.append(TensorSpec(t.dtype, tuple(t.shape), str(t.device), at, n))
        at += (n + ALIGN - 1) // ALIGN * ALIGN
    return Meta(flat.tree, tuple(specs), at)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def encode(meta: Meta) -> bytes:
    doc = {"v": META_VERSION, "data_len": meta.data_len, "tree": meta.tree,
           "tensors": [[_dtype_name(s.dtype), list(s.shape), s.device, s.offset, s.nbytes]
                       for s in meta.tensors]}
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw = b"%08x\n" % zlib.crc32(body) + body
    if len(raw) > fmt.MAX_META_BYTES:
        raise ValueError(f"the state's structure takes {len(raw)} bytes to describe, over "
                         f"{fmt.MAX_META_BYTES}")
    return raw


def _dtype(name) -> torch.dtype:
    d = getattr(torch, name, None) if type(name) is str and name.isidentifier() else None
    if not isinstance(d, torch.dtype):
        raise BadMeta(f"dtype {name!r}")
    return d


def _whole(x, what: str) -> int:
    if type(x) is not int or x < 0:
        raise BadMeta(f"{what} {x!r}")
    return x


def decode(raw: bytes, data_len: int) -> Meta:
    """The meta in ``raw``, checked against its CRC and against ``data_len`` (the
    header's): every tensor inside the data, of the size its dtype and shape say."""
    if len(raw) < _CRC_LEN or raw[8:9] != b"\n":
        raise BadMeta("too short")
    body = raw[_CRC_LEN:]
    try:
        crc = int(raw[:8], 16)
    except ValueError:
        raise BadMeta("CRC is not hex") from None
    if crc != zlib.crc32(body):
        raise BadMeta("CRC does not match")
    try:
        doc = values.decode(body, max_bytes=fmt.MAX_META_BYTES, want=dict,
                            max_depth=3 * MAX_DEPTH + 8)
    except values.BadValue as exc:
        raise BadMeta(str(exc)) from None
    if doc.get("v") != META_VERSION or doc.get("data_len") != data_len \
            or type(doc.get("tensors")) is not list:
        raise BadMeta("version, data length or tensor list does not match")
    specs = []
    for item in doc["tensors"]:
        if type(item) is not list or len(item) != 5 or type(item[1]) is not list \
                or type(item[2]) is not str:
            raise BadMeta("a tensor entry")
        dtype = _dtype(item[0])
        shape = tuple(_whole(x, "dimension") for x in item[1])
        offset, nbytes = _whole(item[3], "offset"), _whole(item[4], "size")
        numel = 1
        for x in shape:
            numel *= x
        if nbytes != numel * dtype.itemsize or offset % ALIGN or offset + nbytes > data_len:
            raise BadMeta(f"tensor at {offset} of {nbytes} bytes does not fit {data_len}")
        specs.append(TensorSpec(dtype, shape, item[2], offset, nbytes))
    return Meta(doc.get("tree"), tuple(specs), data_len)
