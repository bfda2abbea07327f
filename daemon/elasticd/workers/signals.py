"""Signals to the processes of a job's ranks and helpers: one place, one set of checks.

A rank leads its own process group (its own session), so a group signal
reaches what it started too. A rank the worker template forked is
signalled through its pidfd (workers/forked.ForkedProcess.signal_group):
its pid came from a process of the job's user.
"""
from __future__ import annotations

import os
from typing import Iterator

import psutil


def kill_group(pgid: int, sig: int) -> None:
    """Signal a process group; one that is gone (or not ours) is left alone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_rank_group(proc, sig: int) -> None:
    """Signal a rank's process group, and what it left there: ``proc`` is the
    rank's ``subprocess.Popen`` (the daemon's own child), or a forked rank's
    stand-in, whose ``signal_group`` does its own checks."""
    group = getattr(proc, "signal_group", None)
    if group is not None:
        group(sig)
    else:
        kill_group(proc.pid, sig)


def group_processes(pgids, attrs=("pid",)) -> Iterator[tuple[psutil.Process, int]]:
    """Every process now in one of the process groups ``pgids``, with its group
    (``attrs`` read into ``proc.info`` as it is listed)."""
    for proc in psutil.process_iter(list(attrs)):
        try:
            pgid = os.getpgid(proc.pid)
        except OSError:
            continue
        if pgid in pgids:
            yield proc, pgid
