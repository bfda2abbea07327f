"""The monitor thread of one iteration: watches the store for a fault reported by any
rank, and this rank's own progress beats, while the wrapped function runs.

On a fault it aborts the process group and raises ``RestartRequested`` in the main
thread; a main thread not back in Python within hard - soft seconds is stuck
outside it, and ``exit_stuck`` ends the process for the daemon to replace
(inprocess/wrapper.py says when and why).
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import sys
import threading
import time
import traceback

from ..hangs import timeouts as hang_timeouts
from ..workers import env as envnames
from ._beat import current_phase, last_beat, steps
from .coord import IterationStore
from .pgroup import abort_group
from .reporter import Reporter, say
from ..workers.inprocess_settings import InprocessSettings

log = logging.getLogger("elasticd.inprocess")

STUCK_EXIT_CODE = 75  # a rank stuck outside Python ends itself with this code
LIMITS_REREAD = 1.0   # seconds between reads of the daemon's learned limits


class RestartRequested(Exception):
    """Raised in the main thread when another rank's fault ends this iteration."""


class Monitor:
    """Watches the store for faults, and this rank's beats, while the function runs."""

    def __init__(self, coord: IterationStore, rank: int, s: InprocessSettings, main_tid: int,
                 report: "Reporter"):
        self.coord, self.rank, self.s, self.main_tid = coord, rank, s, main_tid
        self.report = report
        self._stop = threading.Event()
        self._lock = threading.Lock()  # held while the main thread may be interrupted
        self._armed = True
        self._thread = threading.Thread(target=self._run, name="elasticd-inprocess-monitor",
                                        daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._steps_at_start = steps()
        self._learned: dict[str, tuple[float, float]] = {}
        self._learned_at = float("-inf")
        self._thread.start()

    def limits(self) -> tuple[float, float]:
        """(soft, hard) for the phase this rank is in: the daemon's learned ones, bounded
        by the settings; the settings where it learned none."""
        now = time.monotonic()
        if now - self._learned_at >= LIMITS_REREAD:
            self._learned_at = now
            self._learned = hang_timeouts.read_limits_file(
                os.environ.get(hang_timeouts.LIMITS_FILE_ENV, ""))
        learned = self._learned.get(current_phase())
        if learned is None:
            return self.s.soft_timeout, self.s.hard_timeout
        soft = min(self.s.soft_timeout, learned[0])
        grace = min(self.s.hard_timeout - self.s.soft_timeout, learned[1] - learned[0])
        return soft, soft + grace

    def quiesce(self) -> None:
        """Stop watching; afterwards no RestartRequested is pending or can arrive."""
        while True:
            try:
                with self._lock:
                    self._armed = False
                self._stop.set()
                self._thread.join()
                # An interrupt sent but not yet delivered is dropped (NULL clears it).
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main_tid), None)
                return
            except RestartRequested:  # delivered while stopping: already counted as a fault
                continue

    def _run(self) -> None:
        while not self._stop.wait(self.s.monitor_interval):
            try:
                fault = self.coord.fault()
                if fault is None:
                    fault = self._own_stall()
            except Exception as exc:  # the store is gone: let the main thread find out
                log.warning("rank %d: in-process monitor stopped: %s", self.rank, exc)
                return
            if fault is not None:
                if self._interrupt(fault):
                    self._await_return(fault)
                return

    def _await_return(self, fault: str) -> None:
        """The main thread has hard - soft seconds to get back to Python (quiesce)."""
        soft, hard = self.limits()
        grace = hard - soft
        if not self._stop.wait(grace):
            exit_stuck(self.rank, self.main_tid, grace, fault, self.report)

    def _own_stall(self) -> str | None:
        beat = last_beat()
        if beat < self._started or steps() <= self._steps_at_start:
            return None  # no step yet this iteration: the first step has no limit here
        idle = time.monotonic() - beat
        soft, _ = self.limits()
        if idle < soft:
            return None
        how = "learned" if soft < self.s.soft_timeout else "inprocess.soft_timeout"
        return self.coord.report_fault(f"rank {self.rank}: no progress for {idle:.0f}s "
                                       f"(soft timeout {soft:g}s, {how}, phase "
                                       f"{current_phase()})")

    def _interrupt(self, fault: str) -> bool:
        """Abort the group and stop the function; False if it is already leaving."""
        with self._lock:
            if not self._armed:
                return False
            say(f"rank {self.rank}: {fault}; aborting this iteration")
            abort_group()
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.main_tid),
                                                       ctypes.py_object(RestartRequested))
            return True


def exit_stuck(rank: int, main_tid: int, grace: float, fault: str, report: "Reporter"):
    """End a process whose main thread cannot be reached: the daemon replaces it.

    Its stacks go to the rank's log; the reason goes to the daemon twice: as a
    ``stuck`` report (the cause is then a hang) and as torch's error file (the
    cause text and the main thread's stack in ``elasticctl status``).
    """
    why = (f"rank {rank}: hang: not back in Python {grace:g}s after the fault stopped its "
           f"function (stuck in C code or a blocked collective; hard - soft timeout); "
           f"ending the process so elasticd replaces it. The fault: {fault}")
    say(why)
    try:
        faulthandler.dump_traceback(all_threads=True)  # stderr: the rank's log
    except (OSError, ValueError, RuntimeError) as exc:
        say(f"rank {rank}: could not dump the stacks: {exc}")
    frame = sys._current_frames().get(main_tid)
    stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
    report.write({"kind": "stuck", "reason": why})
    write_error_file(why, stack)
    os._exit(STUCK_EXIT_CODE)


def write_error_file(message: str, stack: str) -> None:
    """torch's @record error file (TORCHELASTIC_ERROR_FILE), which the daemon reads."""
    path = os.environ.get(envnames.ERROR_FILE)
    if not path:
        return
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": stack,
                                      "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
    except OSError as exc:
        say(f"cannot write the error file {path}: {exc}")
