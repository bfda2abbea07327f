"""Learned preload: the modules a job's rank imported by its first step.

A rank of a job started by this daemon (local rank 0) gets
``ELASTICD_PRELOAD_REPORT``, a file in the job's run dir; at its first step
(optimizer step or ``heartbeat()``) the worker contract
(worker_site/elasticd_heartbeat.py) writes there the top-level names of the
non-standard-library modules it imported, one a line. The daemon reads it
once per job here (a file the job's user wrote: ``workerfiles.read``, no
links, capped), keeps the valid names (``valid_names``: the one validator),
and the job's next worker template imports them after ``agent.warm_preload``,
each tried in a throw-away child first (warmstart._preload_learned): one that
fails or starts a thread is skipped, never fatal.
"""
from __future__ import annotations

import os
import re

from . import env as envnames
from . import files as workerfiles

ENV = envnames.PRELOAD_REPORT
MAX_BYTES = 16 * 1024
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,99}\Z")


def report_path(run_dir: str) -> str:
    return os.path.join(run_dir, envnames.PRELOAD_REPORT_NAME)


def valid_names(names, limit: int, already=()) -> list[str]:
    """Top-level module names fit to import: identifiers, not private, no repeats,
    none of ``already``, at most ``limit``."""
    out: list[str] = []
    for name in names:
        name = str(name).strip()
        if _NAME.match(name) and name not in out and name not in already:
            out.append(name)
        if len(out) >= limit:
            break
    return out


def read_report(run_dir: str, uid: int, limit: int, already=()) -> list[str] | None:
    """The names a rank reported, or None when there is no (readable) report yet."""
    got = workerfiles.read(report_path(run_dir), uid, MAX_BYTES)
    if got.problem is not None:
        return None
    try:
        text = got.data.decode("ascii")
    except (UnicodeDecodeError, AttributeError):
        return []
    return valid_names(text.splitlines(), limit, already)
