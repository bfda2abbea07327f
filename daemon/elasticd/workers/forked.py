"""A rank forked by a worker template, as the agent sees it: ``ForkedProcess``.

The template (workers/template.py) forks each rank and reports its exit on its
channel; this is the daemon's handle on one such rank, with the part of
``subprocess.Popen`` the agent uses, and ``pin_child``, which checks a pid the
template named before anything is signalled through it.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import time

import psutil

from .signals import group_processes, kill_group

log = logging.getLogger("elasticd.workers.template")


class ForkedProcess:
    """A rank forked by the template: the part of ``subprocess.Popen`` the agent uses.

    Its pid came from the template, a process of the job's user that runs the
    user's code (the preload): it is checked to be the template's child and
    the job's uid before it is kept, and signals go through a pidfd opened
    then, so they reach that process and never another that got its pid.
    Its exit is what the template reports; one that exited (the pidfd says
    so) with no report within the fork timeout reads as killed by SIGKILL."""

    def __init__(self, template, pid: int, pidfd: int | None):
        # template: its workers/template.WorkerTemplate (pump, fork_timeout, where, uid)
        self._template = template
        self.pid = pid
        self._pidfd = pidfd      # None: it was gone (reaped) before it could be opened
        self._gone_at: float | None = None
        self.returncode: int | None = None

    def exited(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _alive(self) -> bool:
        """Not yet exited (a zombie has exited); its pid is then still its own."""
        if self._pidfd is None:
            return False
        try:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def exit_fd(self) -> int | None:
        """What becomes readable when there is news of its end: its pidfd while it
        lives, then the template's channel, which says how it ended."""
        if self.returncode is not None:
            return None
        return self._pidfd if self._alive() else self._template.news_fd()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._template.pump(0)
        if self.returncode is None and not self._alive():
            now = time.monotonic()
            if self._gone_at is None:
                self._gone_at = now
            elif now - self._gone_at > self._template.fork_timeout:
                log.warning("%s: rank pid %d exited and its worker template never said how; "
                            "it reads as killed by SIGKILL", self._template.where(), self.pid)
                self.exited(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            self._template.pump(min(left, 0.5))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal the rank's process group (it leads one once it runs) and what it left
        there. While the rank has not been reaped its pid, and so its group's id, is
        its own; after, only processes of the job's uid in that group are signalled,
        each through a pidfd."""
        if self._alive():
            kill_group(self.pid, sig)  # no group yet (before its setsid): none hit
            self.send_signal(sig)
            return
        for proc, _ in group_processes({self.pid}, ("pid", "uids")):
            if proc.info["uids"] is None or proc.info["uids"].real != self._template.uid:
                continue
            try:
                fd = os.pidfd_open(proc.pid)
            except OSError:
                continue
            try:
                if os.getpgid(proc.pid) == self.pid:  # still in it, once pinned
                    signal.pidfd_send_signal(fd, sig)
            except OSError:
                pass
            finally:
                os.close(fd)


def pin_child(pid: int, parent: int, uid: int) -> tuple[int | None, str]:
    """A pidfd for ``pid`` if it is ``parent``'s child run by ``uid`` (None if it is
    gone already: its exit report says the rest), or (None, why it is not)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None, ""
    except OSError as exc:
        return None, f"cannot open a pidfd for it: {exc}"
    try:  # checked once pinned: the fd and what /proc says are the same process
        proc = psutil.Process(pid)
        ppid, owner = proc.ppid(), proc.uids().real
    except psutil.Error:
        os.close(fd)
        return None, ""  # reaped between the two: gone
    if ppid != parent or owner != uid:
        os.close(fd)
        return None, f"pid {pid} is not its child run by uid {uid}"
    return fd, ""
