"""The in-worker record of what the last save and restore cost, and its copy for the daemon.

``last()`` is this process's record (benchmarks and a job that wants to log it
read it; nothing is printed). ``publish`` writes what the daemon exports as
metrics beside the rank's slots, ``rank{rank}.costs`` (workers/snapshot_format.py
``RankCosts``): at every restore, and after a save at most once per
``PUBLISH_EVERY`` seconds, so a save per step costs no extra file write per
step. It is written whole (a temporary file renamed over it, 0600, never
through a link) and never raises: the costs are worth less than the training.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

from ..workers import snapshot_format as fmt
from .errors import SnapshotError
from .region import Region

PUBLISH_EVERY = 1.0   # seconds between two writes of the costs file after saves


@dataclass(frozen=True)
class Timings:
    save_step: int | None = None
    save_stall_s: float | None = None    # how long save() held the caller
    save_total_s: float | None = None    # until the snapshot was complete
    save_bytes: int | None = None        # tensor data written
    restore_step: int | None = None
    restore_s: float | None = None
    restore_source: str | None = None    # "local", "peer" (a buddy's replica) or "none"


_lock = threading.Lock()
_last = Timings()
_published = 0.0      # monotonic time of the last write after a save


def last() -> Timings:
    """What the last save and restore of this process cost."""
    return _last


def record(**fields) -> None:
    global _last
    with _lock:
        _last = replace(_last, **fields)


def publish(rank: int, restored: bool = False) -> None:
    """Write this rank's costs beside its slots, if due (see the module doc)."""
    global _published
    now = time.monotonic()
    with _lock:
        if not restored and now - _published < PUBLISH_EVERY:
            return
        _published = now
        t = _last
    body = fmt.RankCosts(t.save_stall_s, t.restore_s, t.restore_source).to_json().encode()
    name = fmt.COSTS_NAME.format(rank=rank)
    tmp = name + ".tmp"
    try:
        region = Region.open(create=False)
        if region is None:
            return
        with region:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=region.fd)
            try:
                os.write(fd, body[:fmt.COSTS_MAX])
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=region.fd, dst_dir_fd=region.fd)
    except (OSError, SnapshotError):
        pass
