"""Hang detection: watch each rank's progress beats; dump stacks, then kill.

Workers beat without any change to the training script: elasticd puts
``worker_site/`` first on their PYTHONPATH, whose ``sitecustomize`` makes
every ``torch.optim`` optimizer step touch the rank's heartbeat file
(``ELASTICD_HEARTBEAT_FILE``) and makes SIGUSR1 dump all Python stacks into
the rank's log. Scripts without an optimizer call
``elasticd_heartbeat.heartbeat()`` (or ``elasticd.inprocess.heartbeat()``).

The agent calls ``ProgressTracker.check(group)`` once per monitor tick. A
beat is a change of the heartbeat file's mtime seen by the daemon, timed on
the daemon's monotonic clock (the worker's clock and wall-clock steps do not
matter). Per rank, ``judge()`` decides:

* A job is only watched once it has shown that it beats: some rank beat in
  this attempt, or in an earlier attempt of the same job. A script that
  never beats (no optimizer, no ``heartbeat()``; ``python -I``; not Python
  at all) is never killed for hanging.
* A watched rank that has beaten in this attempt: no beat for
  ``agent.hang_soft_timeout`` -> SIGUSR1 once (stacks into its log, an event);
  for ``agent.hang_hard_timeout`` -> SIGKILL of its process group, and the
  failure's cause says ``hang``.
* A watched rank with no beat yet in this attempt (starting up, loading a
  checkpoint, compiling, or stuck in ``init_process_group``): the same,
  measured from its start, with ``agent.first_step_timeout`` as the hard
  limit and the dump the same margin (hard - soft) before it.
* A rank whose process said it is exiting (the heartbeat module's atexit
  hook, run once its non-daemon threads have ended): the same long
  allowance, measured from that word, for the interpreter's shutdown.

A kill always follows a dump by at least one tick, so the stacks are
written before the process dies.
"""
from __future__ import annotations

import enum
import logging
import os
import signal
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from . import workerfiles
from .logsetup import ctx

log = logging.getLogger("elasticd.progress")

WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_site")
HEARTBEAT_ENV = "ELASTICD_HEARTBEAT_FILE"


# ---------------------------------------------------------------- worker env

def site_env(env: dict) -> dict[str, str]:
    """PYTHONPATH with worker_site/ first: what every worker (and spare) gets."""
    rest = env.get("PYTHONPATH", "")
    parts = [WORKER_SITE] + [p for p in rest.split(os.pathsep) if p and p != WORKER_SITE]
    return {"PYTHONPATH": os.pathsep.join(parts)}


def heartbeat_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"heartbeat-rank{rank}")


def rank_env(run_dir: str, rank: int) -> dict[str, str]:
    """What one rank's environment adds: where it beats."""
    return {HEARTBEAT_ENV: heartbeat_file(run_dir, rank)}


# ---------------------------------------------------------------- the decision

class HangAction(enum.Enum):
    NONE = "none"                # progressing, not watched, or already dumped
    DUMP_STACKS = "dump_stacks"  # soft limit passed: SIGUSR1 (once per idle spell)
    KILL = "kill"                # hard limit passed: SIGKILL the rank


@dataclass(frozen=True)
class HangLimits:
    soft: float
    hard: float
    first_step: float

    @classmethod
    def from_settings(cls, agent_settings) -> "HangLimits":
        a = agent_settings
        return cls(a.hang_soft_timeout, a.hang_hard_timeout, a.first_step_timeout)


class Verdict(NamedTuple):
    action: HangAction
    idle: float   # seconds since the last beat (or since the start, before one)


def judge(now: float, started: float, last_beat: float | None, watched: bool,
          dumped: bool, limits: HangLimits, exiting: bool = False) -> Verdict:
    """What to do about one live rank, from its times (no I/O).

    ``dumped``: its stacks were already dumped in this idle spell; a kill
    needs that first, so the stacks are in the log before the process dies.
    ``exiting``: its last beat said the process is shutting down.
    """
    idle = now - (started if last_beat is None else last_beat)
    if last_beat is None or exiting:
        hard = limits.first_step
        soft = limits.first_step - (limits.hard - limits.soft)
    else:
        hard, soft = limits.hard, limits.soft
    if not watched or idle < soft:
        return Verdict(HangAction.NONE, idle)
    if idle >= hard and dumped:
        return Verdict(HangAction.KILL, idle)
    if not dumped:
        return Verdict(HangAction.DUMP_STACKS, idle)
    return Verdict(HangAction.NONE, idle)


# ---------------------------------------------------------------- OS calls

class ProcessOps:
    """The OS calls the tracker makes; tests swap in a fake."""

    clock: Callable[[], float] = staticmethod(time.monotonic)

    @staticmethod
    def beat_mark(path: str) -> int | None:
        """The heartbeat file's mtime in ns, or None; never follows a link."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        return st.st_mtime_ns if stat.S_ISREG(st.st_mode) else None

    @staticmethod
    def read_beat(path: str, uid: int) -> tuple[int | None, bool]:
        """(pid, exiting) from a heartbeat file: ``PID`` or ``PID exiting``.

        The worker (as ``uid``) wrote it, so it is untrusted: read with
        ``workerfiles.read``; the pid is checked by the caller.
        """
        got = workerfiles.read(path, uid, 64, whole=False)
        if not got.ok:
            return None, False
        words = got.data.decode("ascii", "replace").split()
        pid = int(words[0]) if words and words[0].isdigit() and len(words[0]) < 9 else None
        return pid, words[1:2] == ["exiting"]

    @staticmethod
    def pgid(pid: int) -> int | None:
        try:
            return os.getpgid(pid)
        except OSError:
            return None

    @staticmethod
    def catches(pid: int, sig: int) -> bool:
        """Whether ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("SigCgt:"):
                        return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
        except (OSError, ValueError, IndexError):
            pass
        return False

    @staticmethod
    def kill(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def killpg(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------- the tracker

@dataclass
class _Rank:
    pid: int                    # the worker process (leader of its process group)
    started: float              # daemon monotonic time it was first seen
    mark: int | None            # heartbeat mtime last seen (ns); a change is a beat
    last_beat: float | None = None
    dumped: bool = False
    exiting: bool = False       # its process said it is shutting down


@dataclass
class _Killed:
    rank: int
    idle: float
    at: float


@dataclass
class ProgressTracker:
    """Per job, owned by its agent thread: watches beats, dumps stacks, kills hung ranks."""
    job_id: str
    settings: object            # AgentSettings
    registry: object            # JobRegistry: .event(job_id, kind, reason, rank=)
    node_id: str = ""
    ops: ProcessOps = field(default_factory=ProcessOps)
    on_beat: object = None      # called (no arguments) when any rank beats: metrics
    _group: object = None
    _ranks: dict = field(default_factory=dict)
    _killed: dict = field(default_factory=dict)
    _job_beats: bool = False    # some rank beat in some attempt: the job uses beats

    def check(self, group) -> list[str]:
        """Look at every live rank of ``group`` once; returns what was done (sentences)."""
        if not self.settings.hang_detection:
            return []
        if group is not self._group:
            self._group, self._ranks, self._killed = group, {}, {}
        now = self.ops.clock()
        limits = HangLimits.from_settings(self.settings)
        run_dir = group.spec.run_dir
        live = []
        for w in group.workers:
            if w.returncode is not None or w.stopped_by_us:
                continue
            path = heartbeat_file(run_dir, w.rank)
            mark = self.ops.beat_mark(path)
            r = self._ranks.get(w.rank)
            if r is None or r.pid != w.pid:  # new, or respawned alone: a fresh start
                r = self._ranks[w.rank] = _Rank(pid=w.pid, started=now, mark=mark)
            elif mark is not None and mark != r.mark:
                r.mark, r.last_beat, r.dumped = mark, now, False
                r.exiting = self.ops.read_beat(path, group.spec.uid)[1]
                self._job_beats = True
                if self.on_beat is not None:
                    self.on_beat()
            live.append((w, r, path))
        watched = self._job_beats
        done = []
        for w, r, path in live:
            if w.rank in self._killed:
                continue
            verdict = judge(now, r.started, r.last_beat, watched, r.dumped, limits, r.exiting)
            if verdict.action is HangAction.DUMP_STACKS:
                r.dumped = True
                done.append(self._dump(w, path, group.spec.uid, verdict.idle, _since(r)))
            elif verdict.action is HangAction.KILL:
                self.ops.killpg(w.pid, signal.SIGKILL)
                self._killed[w.rank] = _Killed(w.rank, verdict.idle, now)
                done.append(self._record(w.rank, f"rank {w.rank}: no progress for "
                                         f"{verdict.idle:.0f}s{_since(r)}; killed "
                                         f"(agent.{_hard_name(r)} {_hard(r, limits):g}s)"))
        return done

    def forget(self, rank: int) -> None:
        """The rank's process was replaced: watch its successor from its start."""
        self._ranks.pop(rank, None)
        self._killed.pop(rank, None)

    def explain(self, failure: dict) -> dict:
        """The failure record, its cause naming the hang if a rank was killed for one."""
        if not self._killed:
            return failure
        k = self._killed.get(failure.get("rank"))
        if k is None:  # a peer failed first as a consequence; blame the hung rank
            k = min(self._killed.values(), key=lambda k: (k.at, k.rank))
        cause = (f"rank {k.rank} hang: no progress for {k.idle:.0f}s; killed by elasticd "
                 f"(its Python stacks are in its log)")
        return dict(failure, rank=k.rank, exit_code=-1, signal=int(signal.SIGKILL),
                    cause=cause, kind="hang", traceback="" if k.rank != failure.get("rank")
                    else failure.get("traceback", ""))

    # -- actions -------------------------------------------------------------
    def _dump(self, w, path: str, uid: int, idle: float, since: str) -> str:
        target = self.ops.read_beat(path, uid)[0]
        if target is None or self.ops.pgid(target) != w.pid:
            target = w.pid  # only a process of this rank's own group is ever signalled
        what = f"rank {w.rank}: no progress for {idle:.0f}s{since}"
        # SIGUSR1's default action is to terminate: only a process that handles it gets it.
        if self.ops.catches(target, signal.SIGUSR1):
            self.ops.kill(target, signal.SIGUSR1)
            return self._record(w.rank, f"{what}; stacks dumped to its log (pid {target})")
        return self._record(w.rank, f"{what}; stacks not dumped: pid {target} has no SIGUSR1 "
                                    "handler (started without elasticd's sitecustomize, or "
                                    "shutting down)")

    def _record(self, rank: int, sentence: str) -> str:
        log.warning("%s: %s", ctx(job=self.job_id, node=self.node_id, rank=rank), sentence)
        try:
            self.registry.event(self.job_id, "hang", sentence, rank=rank)
        except Exception:  # an event that cannot be written must not stop the watch
            log.exception("%s: could not record hang event", ctx(job=self.job_id))
        return sentence


def _since(r: _Rank) -> str:
    if r.last_beat is None:
        return " since it started (no first step yet)"
    return " since it began to exit" if r.exiting else ""


def _hard_name(r: _Rank) -> str:
    return "first_step_timeout" if r.last_beat is None or r.exiting else "hang_hard_timeout"


def _hard(r: _Rank, limits: HangLimits) -> float:
    return limits.first_step if r.last_beat is None or r.exiting else limits.hard
