"""Which rank of which world this process saves and restores as, and the ranks'
agreement on the newest step every one of them holds.

With torch.distributed initialized, the default group's rank and size; without,
$RANK and $WORLD_SIZE as torchrun sets them (0 and 1 when unset). The agreement
is an all_gather of each rank's complete steps (tensors, no pickling): the
newest step in all of them, the same answer on every rank, or none; and whether
some rank holds nothing while another holds something (then restore() waits
for a replica), with the fewest polls any rank's setting allows.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..workers import env as wenv
from .errors import SnapshotError

NONE = -1   # a slot without a complete step, in the exchange
EXCHANGED = 8   # steps each rank puts in the exchange: its four slots and four replicas


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isascii() or not raw.isdigit() or len(raw) > 9:
        raise SnapshotError(f"${name} must be a small whole number, not {raw[:20]!r}")
    return int(raw)


def identity() -> tuple[int, int]:
    """(rank, world size)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = _env_int(wenv.TORCHRUN_RANK, 0), _env_int(wenv.TORCHRUN_WORLD_SIZE, 1)
    if rank >= world:
        raise SnapshotError(f"${wenv.TORCHRUN_RANK}={rank} is not below "
                            f"${wenv.TORCHRUN_WORLD_SIZE}={world}")
    return rank, world


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    """Where the exchange's tensors live: the CPU when the default group's backend
    takes CPU tensors (gloo), else this rank's CUDA device (nccl)."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "mpi" in backend or "cpu:" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed on: the same on every rank."""
    step: int | None     # the newest step every rank holds; None: none in common
    # none failed, and a replica may still be on its way: some rank holds no snapshot
    # while another holds one, or no step is common while some rank holds replicas only
    # (they arrive one file at a time: the first ended the wait before the one in common)
    starved: bool
    polls: int           # the fewest polls any rank would wait for a replica (its setting)


def agree(steps: list[int], failed: bool = False, polls: int = 0,
          borrowed: bool = False) -> Agreement:
    """The newest step every rank holds, given this rank's complete steps (the newest
    EXCHANGED of them count), whether this rank's look failed, how many times it would
    poll again for a replica, and whether its steps all come from replicas (it took over
    a lost node's ranks). Every rank must call it."""
    dev = _device()
    mine = (sorted(steps, reverse=True) + [NONE] * EXCHANGED)[:EXCHANGED]
    local = torch.tensor([int(failed), polls, int(borrowed), *mine], dtype=torch.int64,
                         device=dev)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    common, empty, holding, any_failed, fewest = None, False, False, False, polls
    any_borrowed = False
    for t in gathered:
        row = t.tolist()
        any_failed |= bool(row[0])
        fewest = min(fewest, row[1])
        any_borrowed |= bool(row[2])
        held = {s for s in row[3:] if s != NONE}
        empty, holding = empty or not held, holding or bool(held)
        common = held if common is None else common & held
    waiting = (empty and holding) or (not common and any_borrowed)
    return Agreement(max(common) if common else None, waiting and not any_failed,
                     max(fewest, 0))


def all_ok(ok: bool) -> bool:
    """Whether every rank says ok (every rank must call it)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
