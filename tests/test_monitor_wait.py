"""agent/monitor_wait.py on real processes: the monitor's wait ends when a worker's
process ends (its pidfd) or the agent is poked, else after the interval; and
WorkerGroup.exit_fds gives the pidfd of a cold-started worker until it is reaped."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from elasticd.agent.monitor_wait import MonitorWait
from elasticd.workers.group import Worker, WorkerGroup


def _timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def test_a_process_ending_cuts_the_wait_short():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    fd = os.pidfd_open(proc.pid)
    waits = MonitorWait()
    try:
        took = _timed(lambda: waits.wait([fd], 30))
        assert took < 20, took       # the exit, not the 30 s interval, ended it
        assert proc.wait(5) == 0
    finally:
        os.close(fd)
        waits.close()


def test_a_poke_cuts_the_wait_short_even_one_made_before_it():
    waits = MonitorWait()
    try:
        waits.poke()
        assert _timed(lambda: waits.wait([], 30)) < 20
        threading.Timer(0.2, waits.poke).start()
        assert _timed(lambda: waits.wait([], 30)) < 20
        # Drained: with nothing to say, the wait is the whole interval.
        assert _timed(lambda: waits.wait([], 0.2)) >= 0.19
    finally:
        waits.close()
    waits.poke()     # after close: nothing written anywhere, no error


def test_exit_fds_hold_a_cold_workers_pidfd_until_it_is_reaped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    group = WorkerGroup.__new__(WorkerGroup)
    group.workers = [Worker(rank=0, local_rank=0, proc=proc, error_file=str(tmp_path / "e"))]
    try:
        fds = group.exit_fds()
        assert len(fds) == 1 and group.exit_fds() == fds   # opened once
        proc.kill()
        waits = MonitorWait()
        assert _timed(lambda: waits.wait(fds, 30)) < 20
        waits.close()
        proc.wait(5)
        group.poll()
        assert group.workers[0].returncode is not None
        assert group.exit_fds() == [] and group.workers[0].pidfd is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_group_leaves_no_pidfd_open(tmp_path):
    # A session of its own, as the daemon starts every worker: stop signals the group.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            start_new_session=True)
    group = WorkerGroup.__new__(WorkerGroup)
    group.workers = [Worker(rank=0, local_rank=0, proc=proc, error_file=str(tmp_path / "e"))]
    assert len(group.exit_fds()) == 1
    group.stop(grace=5)
    assert group.workers[0].returncode is not None and group.workers[0].pidfd is None
