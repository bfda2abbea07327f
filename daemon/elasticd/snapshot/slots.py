"""A rank's two slot files: which one a save overwrites, mapping it for the save
(pages kept between saves), writing its header, meta and data, and reading a
complete one back, where anything that does not match its header counts as absent.

A save writes the header WRITING first (the slot stops being a snapshot), then the
meta and data, and COMPLETE with the step last, so the other slot (the newest
complete snapshot) stays whole until the new one is. Tensors a restore returns
are a private copy-on-write mapping of their slot (the map lives as long as they do): changing them never changes the
slot, and a later save into that slot while they are alive writes a fresh file
(the old one goes when they do) instead of changing them underneath.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import time
import weakref
from dataclasses import dataclass

import torch

from ..workers import snapshot_format as fmt
from . import meta as metas
from .errors import NoSpace, SnapshotError
from .region import Region
from .structure import build


@dataclass(frozen=True)
class Complete:
    """A slot file holding a complete snapshot whose meta and size match its header."""
    name: str
    header: fmt.Header
    meta: metas.Meta


def read_header(fd: int) -> fmt.Header | None:
    try:
        return fmt.parse(os.pread(fd, fmt.HEADER_USED, 0))
    except fmt.BadHeader:
        return None


def probe(region: Region, name: str, rank: int, world: int) -> Complete | None:
    """Slot ``name`` if it holds a complete snapshot of this rank in a world of this
    size, with its meta intact and everything inside the file; else None."""
    fd = region.open_slot(name, writable=False)
    if fd is None:
        return None
    try:
        h = read_header(fd)
        if h is None or h.state != fmt.SlotState.COMPLETE or h.rank != rank \
                or h.world_size != world or h.total_bytes > os.fstat(fd).st_size:
            return None
        raw = os.pread(fd, h.meta_len, fmt.HEADER_BYTES)
        if len(raw) != h.meta_len:
            return None
        try:
            return Complete(name, h, metas.decode(raw, h.data_len))
        except metas.BadMeta:
            return None
    finally:
        os.close(fd)


def pick(completes: list, step: int, names: tuple) -> str:
    """The slot a save of ``step`` overwrites: not the one holding the newest complete
    snapshot older than ``step`` (a complete one of this step or later, left from a
    timeline a restore went back from, is overwritten first)."""
    older = [c for c in completes if c.header.step < step]
    if not older:
        held = {c.name: c.header.step for c in completes}
        return min(names, key=lambda n: (n in held, held.get(n, -1)))
    keep = max(older, key=lambda c: (c.header.step, c.header.saved_at_ns)).name
    return next(n for n in names if n != keep)


def retire(region: Region, c: Complete) -> None:
    """Make slot ``c`` absent (its header WRITING) if it still holds ``c``; its pages stay."""
    fd = region.open_slot(c.name, writable=True)
    try:
        if read_header(fd) == c.header:
            os.pwrite(fd, fmt.pack(dataclasses.replace(c.header, state=fmt.SlotState.WRITING)),
                      0)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- writing

@dataclass
class Mapped:
    """A slot file mapped for writing, kept between saves so its pages stay."""
    ino: int
    size: int
    mm: mmap.mmap


_mapped: dict = {}     # (region key, name) -> Mapped
_restored: dict = {}   # (region key, name) -> [weak refs to the private maps of restores]


def _in_use(key) -> bool:
    """Whether tensors from a restore still hold a mapping of this slot. The tensors
    hold their map; a map nobody holds is gone (unmapped) with its last tensor."""
    alive = [r for r in _restored.pop(key, []) if r() is not None]
    if alive:
        _restored[key] = alive
    return bool(alive)


def prepare(region: Region, name: str, size: int) -> Mapped:
    """Slot ``name`` of at least ``size`` bytes, allocated and mapped for writing.
    OverBudget / NoSpace before anything is changed when it would not fit."""
    key = (region.key, name)
    region.budget()    # a bad $ELASTICD_SNAPSHOT_BUDGET_BYTES fails every save, not only a growth
    with region.locked():
        st = region.stat_slot(name)
        held = _mapped.get(key)
        if held is not None and (st is None or st.st_ino != held.ino or st.st_size != held.size):
            _mapped.pop(key).mm.close()
            held = None
        if st is not None and _in_use(key):
            if held is not None:
                _mapped.pop(key).mm.close()
            region.unlink(name)        # the restored tensors keep the old file
            st = held = None
        if held is not None and held.size >= size:
            return held
        region.check_room(name, size)
        fd = region.open_slot(name, writable=True)
        assert fd is not None
        try:
            have = os.fstat(fd).st_size
            try:   # every page allocated now: a full tmpfs is ENOSPC here, not SIGBUS later
                os.posix_fallocate(fd, 0, max(have, size))
            except OSError as exc:
                raise NoSpace(f"allocating {size} bytes for {region.path}/{name}: "
                              f"{exc.strerror}") from None
            ino, got = os.fstat(fd).st_ino, max(have, size)
            mm = mmap.mmap(fd, got, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if held is not None:
            held.mm.close()
        _mapped[key] = Mapped(ino, got, mm)
        return _mapped[key]


def forget(region: Region, name: str) -> None:
    """Drop the writing map of a slot (after a save into it failed half way)."""
    held = _mapped.pop((region.key, name), None)
    if held is not None:
        held.mm.close()


def write_header(m: Mapped, h: fmt.Header) -> None:
    raw = fmt.pack(h)
    m.mm[0:len(raw)] = raw


def write_meta(m: Mapped, raw: bytes) -> None:
    m.mm[fmt.HEADER_BYTES:fmt.HEADER_BYTES + len(raw)] = raw


def _view(buf, at: int, spec: metas.TensorSpec) -> torch.Tensor:
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=spec.nbytes, offset=at + spec.offset)
    return flat.view(spec.dtype).view(spec.shape)


def fill(m: Mapped, meta: metas.Meta, meta_len: int, tensors) -> None:
    """Copy the state's tensors into the slot's data, each where the meta says."""
    at = fmt.data_offset(meta_len)
    with torch.no_grad():
        for spec, t in zip(meta.tensors, tensors):
            if spec.nbytes:
                _view(m.mm, at, spec).copy_(t)


def fill_from(m: Mapped, meta_len: int, staging: torch.Tensor) -> None:
    """Copy a staged copy of the data (one buffer, the slot's data layout) into the slot."""
    if staging.numel():
        dst = torch.frombuffer(m.mm, dtype=torch.uint8, count=staging.numel(),
                               offset=fmt.data_offset(meta_len))
        dst.copy_(staging)


def stage(meta: metas.Meta, tensors, staging: torch.Tensor) -> None:
    """Copy the state's tensors into ``staging`` (the slot's data layout); CUDA copies
    are waited for before this returns, so the caller may change its tensors."""
    devices = set()
    with torch.no_grad():
        for spec, t in zip(meta.tensors, tensors):
            if spec.nbytes:
                dst = staging[spec.offset:spec.offset + spec.nbytes].view(spec.dtype)
                if t.device.type == "cuda":
                    devices.add(t.device)
                dst.view(spec.shape).copy_(t, non_blocking=t.device.type == "cuda")
    for dev in devices:
        torch.cuda.synchronize(dev)


def complete_header(rank: int, world: int, step: int, meta_len: int, data_len: int,
                    state: fmt.SlotState) -> fmt.Header:
    return fmt.Header(state, rank, world, step, time.time_ns(), meta_len, data_len)


# ---------------------------------------------------------------- reading

def _device(saved: str) -> torch.device:
    dev = torch.device(saved)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SnapshotError(f"the snapshot's tensors were saved from {saved}; this process "
                                f"has no CUDA device")
        if dev.index is None or dev.index >= torch.cuda.device_count():
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def load(region: Region, c: Complete):
    """The state slot ``c`` holds, its tensors on the devices they were saved from
    (CPU tensors: a private copy-on-write map of the slot, no copy made)."""
    fd = region.open_slot(c.name, writable=False)
    if fd is None:
        return None
    try:
        size = c.header.total_bytes
        if os.fstat(fd).st_size < size or read_header(fd) != c.header:
            return None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    _restored.setdefault((region.key, c.name), []).append(weakref.ref(mm))
    at = c.header.data_offset
    tensors = []
    for spec in c.meta.tensors:
        dev = _device(spec.device)
        t = _view(mm, at, spec) if spec.nbytes else torch.empty(spec.shape, dtype=spec.dtype)
        tensors.append(t if dev.type == "cpu" else t.to(dev))
    return build(c.meta.tree, tensors)
