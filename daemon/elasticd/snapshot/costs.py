"""The in-worker record of what the last save and restore cost (read by benchmarks and
by a job that wants to log it); nothing is printed."""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace


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


def last() -> Timings:
    """What the last save and restore of this process cost."""
    return _last


def record(**fields) -> None:
    global _last
    with _lock:
        _last = replace(_last, **fields)
