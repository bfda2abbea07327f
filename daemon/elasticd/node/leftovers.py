"""What a previous daemon left running of a job's workers, killed before this one serves.

``kill_leftover_workers`` SIGKILLs what is left of the workers a job's record
names (their process groups, checked by start time so a recycled pid is never
hit) and waits, at most ``LEFTOVER_GONE_WAIT`` seconds, for them to be gone.
"""
from __future__ import annotations

import signal
import time

import psutil

from ..jobs.records import WorkerRow
from ..workers.signals import group_processes

# Seconds a restarted daemon waits for what it SIGKILLed of its previous run's
# workers to be gone before it serves (SIGKILL lands when the process next runs).
LEFTOVER_GONE_WAIT = 5.0


def kill_leftover_workers(rows: list[WorkerRow]) -> int:
    """SIGKILL what is left of recorded workers' process groups.

    Each worker led its own process group (pgid == its pid). The leader may
    be gone while children it forked live on in the group, so every process
    in that group started no earlier than the recorded worker is killed; a
    recycled pid or pgid (an older start time can't be ours) is never hit.
    """
    wanted = {row.pid: row.create_time for row in rows if row.pid and row.create_time}
    if not wanted:
        return 0
    killed: list[psutil.Process] = []
    for proc, pgid in group_processes(wanted, ("pid", "create_time")):
        if proc.info["create_time"] < wanted[pgid] - 0.01:
            continue
        try:
            proc.send_signal(signal.SIGKILL)  # psutil checks it is still that process
            killed.append(proc)
        except psutil.Error:
            pass
    # SIGKILL takes effect when the process next runs: on a loaded node that can
    # be a while, and the daemon must not say it is back while they still run.
    deadline = time.monotonic() + LEFTOVER_GONE_WAIT
    while time.monotonic() < deadline and any(_running(p) for p in killed):
        time.sleep(0.02)
    return len(killed)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
