"""The default process group of an iteration: what to import before the first one,
abort (connections closed, in-flight work failed), teardown, and torch's timeouts."""
from __future__ import annotations

import datetime
import logging

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

log = logging.getLogger("elasticd.inprocess")


def import_before_any_group() -> None:
    """Import what would otherwise pin the first process group in memory.

    Modules that the first optimizer construction imports (torch._dynamo and
    the torch.distributed parts it pulls in) take references to the default
    process group existing at their import. That group then outlives its
    abort, its connections stay open, and peers blocked in a collective with
    this rank wait for the hard timeout instead of failing at once.
    """
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:
        log.warning("could not import torch._dynamo ahead of the process group: %s", exc)


def abort_group() -> None:
    """Abort the default process group: connections closed, in-flight work failed."""
    if not dist.is_initialized():
        return
    abort = getattr(c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception as exc:
        log.warning("aborting the process group failed: %s", exc)


def close_group() -> None:
    """Destroy the default process group at a normal end (every rank returned): the
    graceful path, which lets the backend stop and join its threads before the
    interpreter exits, where ``teardown``'s abort is for leaving a failed group."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:
        log.warning("destroying the process group failed: %s", exc)
        teardown()


def teardown() -> None:
    abort_group()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.warning("destroying the process group failed: %s", exc)


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
