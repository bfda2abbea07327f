"""Warm spares: pre-started interpreters of a job, torch imported, waiting to become ranks.

A spare is ``python workers/warmstart.py ARGS`` started through the workers'
own spawn path (workers/launch.start_process: the job's user, a session of
its own, stdin a pipe from the daemon); it imports the job's preload, then
waits on stdin for one line, the identity of the worker it becomes
(warmstart.main). The agent keeps them while its job has no usable worker
template (workers/template.py), so that a restart skips the interpreter
start and the torch import.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess

from . import env as envnames
from .group import (WARMSTART, GroupSpec, SpawnError, as_user_kwargs, base_env,
                    start_process, warm_args)
from .signals import kill_group
from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.spares")


class SparePool:
    """Pre-started interpreters, one per local rank, with torch already imported.

    Owned by the job's agent thread (their PDEATHSIG is tied to it). A
    restart hands each new worker's identity to a spare instead of starting
    a fresh interpreter, which saves the interpreter start and torch import.

    The fallback of the worker template (workers/template.py): the agent starts
    spares only while a job has no usable template. They stay because a spare
    never forks: it is the warm path left when the template is unsafe to fork
    (a thread or CUDA context started by the job's own sitecustomize or
    preload), could not be made, or is turned off (agent.worker_template).
    """

    def __init__(self) -> None:
        self._spares: dict[int, subprocess.Popen] = {}
        self._ranks: dict[int, int] = {}     # local rank -> the global rank its log is

    def fill(self, spec: GroupSpec, preload: list, nice: int = 0) -> int:
        """Start a spare for each local rank that has none; returns how many started.

        ``nice``: the spares' niceness while they import and wait, so that their
        imports yield the CPU to the running workers (agent.warm_spare_nice); set
        back to 0 when one becomes a worker. Only a root daemon can set it back,
        so only a root daemon sets it."""
        args = warm_args(spec.command)
        if args is None:
            return 0
        user_kwargs = as_user_kwargs(spec.uid, spec.gid)
        env = dict(base_env(spec), **{envnames.WARM_PRELOAD: ",".join(preload)})
        started = 0
        for local_rank in range(spec.nproc):
            spare = self._spares.get(local_rank)
            if spare is not None and spare.poll() is None:
                continue
            try:
                self._ranks[local_rank] = spec.place.rank_offset + local_rank
                self._spares[local_rank] = start_process(  # it sets sys.path[0] from args
                    spec, [spec.command[0], WARMSTART, *args], spec.place.rank_offset + local_rank,
                    env, user_kwargs, stdin=subprocess.PIPE)
                if nice and os.geteuid() == 0:
                    _renice(self._spares[local_rank].pid, nice)
                started += 1
            except SpawnError as exc:
                log.warning("%s: no warm spare: %s", ctx(job=spec.job_id), exc)
                return started
        return started

    def ready(self) -> int:
        """How many spares are alive, waiting for a worker's identity."""
        return sum(1 for spare in self._spares.values() if spare.poll() is None)

    def imported(self) -> int:
        """How many spares finished their imports: blocked reading their stdin, where
        the worker's identity comes (warmstart.main). A spare still importing counts
        in ready() but not here."""
        return sum(1 for spare in self._spares.values()
                   if spare.poll() is None and _reading_stdin(spare.pid))

    def take(self, local_rank: int, rank: int) -> subprocess.Popen | None:
        """The spare for a local rank, if alive and its output goes to ``rank``'s log.

        A spare's stdout is the log of the rank it was started for; when a new
        round moved this node's ranks (a node lost, one joined), it is retired
        and the worker starts cold, so each rank's log stays its own."""
        spare = self._spares.pop(local_rank, None)
        if spare is not None and self._ranks.pop(local_rank, None) != rank:
            kill_group(spare.pid, signal.SIGKILL)
            spare.wait()
            return None
        if spare is not None and spare.poll() is not None:
            return None
        if spare is not None and os.geteuid() == 0:
            _renice(spare.pid, 0)
        return spare

    @staticmethod
    def hand_over(spare: subprocess.Popen, env: dict, cwd: str, args: list,
                  cpus: tuple = ()) -> subprocess.Popen | None:
        """Give a spare from ``take`` its worker's identity (and, for a job bound to
        CPUs, those CPUs); None if it is not there any more."""
        if cpus:
            _bind_cpus(spare.pid, cpus)
        line = json.dumps({"env": env, "cwd": cwd, "args": args}) + "\n"
        try:
            spare.stdin.write(line.encode())
            spare.stdin.close()
            return spare
        except (BrokenPipeError, ValueError, OSError):
            kill_group(spare.pid, signal.SIGKILL)
            spare.wait()
            return None

    def clear(self) -> None:
        for spare in self._spares.values():
            kill_group(spare.pid, signal.SIGKILL)
        for spare in self._spares.values():
            try:
                spare.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if spare.stdin:
                spare.stdin.close()
        self._spares.clear()
        self._ranks.clear()


# The number of read(2) on this machine's architecture, as /proc/PID/syscall shows it.
_READ_SYSCALL = {"x86_64": "0", "aarch64": "63", "riscv64": "63", "ppc64le": "3",
                 "s390x": "3"}.get(os.uname().machine)


def _reading_stdin(pid: int) -> bool:
    """Whether process ``pid`` is blocked in read(0, ...), from /proc/PID/syscall (the
    daemon's own child: readable by it). Unknown architecture: alive counts as ready."""
    if _READ_SYSCALL is None:
        return True
    try:
        with open(f"/proc/{pid}/syscall", "rb") as fh:
            fields = fh.read(256).split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] == _READ_SYSCALL.encode() and fields[1] == b"0x0"


def _threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (Linux: affinity and niceness are per thread); just
    ``pid`` when its task list cannot be read."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _bind_cpus(pid: int, cpus: tuple) -> None:
    """Bind every thread of a running process (a spare taking a worker's place) to
    ``cpus``; a thread gone meanwhile is skipped."""
    for tid in _threads(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def _renice(pid: int, nice: int) -> None:
    """Set the niceness of every thread of ``pid`` (Linux: setpriority is per thread)."""
    for tid in _threads(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:  # gone, or not ours to change
            pass
