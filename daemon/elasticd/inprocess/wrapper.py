"""``Wrapper``: re-run a distributed training function in the same processes after a fault.

One restart iteration, on every rank:

1. meet every rank at the iteration's start barrier in the job's store (a
   ``torch.distributed.TCPStore`` the daemon hosts outside the ranks; see
   jobstore/server.py), then build the default process group on a store prefix of
   its own (``it<N>/pg/``), with the hard timeout as its collective timeout;
2. call the function (with ``iteration=N`` if it takes that argument) while
   a monitor thread watches the store for a fault reported by any rank, and
   this rank's own progress beats (optimizer steps, ``heartbeat()``);
3. it returned on every rank: tear down the group, return its value. A
   fault anywhere: tear down the group and go round again, N + 1.

The store is open to anyone who can connect (torch's TCPStore has no
authentication): every record the ranks act on is sealed with a key derived
from the job's secret (ELASTICD_STORE_SECRET, required), which never reaches
the store, and one that does not verify is ignored (coord.py, jobs/records.py).

A fault is: the function raised on some rank; or, after this rank's first
step of the iteration, no beat for the soft timeout. The soft timeout, and
the grace (hard - soft) below, are those the daemon learned for the phase
the rank is in (train, forward, checkpoint, a section: see
elasticd/hangs/timeouts.py), read from the file ELASTICD_HANG_LIMITS_FILE
names about once a second, when it learned them; else the settings below,
which always bound them. The rank that hits it
reports it to the store, then aborts its process group, which closes its
connections, so peers blocked in a collective with it fail at once (a gloo
collective is not interrupted by a local abort: the peer's closing is what
ends it; NCCL's abort ends it locally too). The monitor of every other rank
sees the report, aborts its own group the same way and raises
``RestartRequested`` in the main thread, which stops the function at its
next Python instruction. A main thread that is not back in Python within
``hard_timeout - soft_timeout`` seconds of that (asleep in C code, a
dead-locked extension, a collective on a peer that neither returns nor
closes) cannot be stopped from inside: the monitor dumps every thread's
stack into the rank's log, tells the daemon (a ``stuck`` report and torch's
error file) and ends the process, which the daemon replaces (below).

A rank whose process died (``os._exit``, a signal, the OOM killer, stuck
as above, or killed by the daemon's hang detection) is replaced by the
daemon: a new process, started with
``ELASTICD_INPROCESS_REPLACES`` saying why, reports the fault in the
iteration the dead rank was in (waking the others) and joins the next one.
It has none of the dead rank's memory: the function must be able to start
from what the others hold or from a checkpoint.

Fallbacks to the next layer (the process exits non-zero after telling the
daemon, which restarts the node's worker group, ``agent.max_restarts``): a
barrier not reached by every rank within the barrier timeout, more than
``max_restarts`` in-process restarts, ``repeat_limit`` faults within
``repeat_window`` seconds (a fault that keeps coming back may be state that
only a fresh process clears), or a ``BaseException`` (SystemExit,
KeyboardInterrupt) in the function.

Every iteration after the first, and every give-up, is reported as a JSON
line to ``ELASTICD_INPROCESS_REPORT`` (see elasticd/workers/inprocess_reports.py),
which the daemon turns into events, metrics and the job's restart ladder.

Settings (constructor argument, else the environment variable the daemon
sets from its ``[inprocess]`` config, else the default); soft < hard <
barrier is enforced:

    soft_timeout      ELASTICD_INPROCESS_SOFT_TIMEOUT      60 s
    hard_timeout      ELASTICD_INPROCESS_HARD_TIMEOUT      90 s
    barrier_timeout   ELASTICD_INPROCESS_BARRIER_TIMEOUT  240 s
    monitor_interval  ELASTICD_INPROCESS_MONITOR_INTERVAL  0.1 s
    max_restarts      ELASTICD_INPROCESS_MAX_RESTARTS       8
    repeat_limit      ELASTICD_INPROCESS_REPEAT_LIMIT       3
    repeat_window     ELASTICD_INPROCESS_REPEAT_WINDOW     30 s
    backoff           ELASTICD_INPROCESS_BACKOFF            0 s

Without ELASTICD_STORE_ADDR (run by torchrun, or submitted without
``--inprocess``) the wrapper initialises the process group from the usual
torchrun environment and calls the function once: the script still runs,
and faults are handled by process restarts.

The monitor thread is monitor.py; the process group's import, abort and teardown
pgroup.py; the reports to the daemon reporter.py.
"""
from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from ..workers import env as envnames, inprocess_reports
from ..jobstore import address as jobstore_env
from ._beat import keepalive
from .coord import BarrierTimeout, IterationStore, latest_iteration
from .monitor import Monitor, RestartRequested
from .pgroup import close_group, import_before_any_group, td, teardown
from .records import RecordSealer
from .reporter import Reporter, say
from ..workers.inprocess_settings import (  # noqa: F401
    ENV_PREFIX, InprocessSettings, from_env, problems)

log = logging.getLogger("elasticd.inprocess")


class RestartAbandoned(RuntimeError):
    """In-process restart gave up; the daemon's process restart takes over."""


@dataclass(frozen=True)
class InProcessSettings(InprocessSettings):
    """The daemon's [inprocess] settings (workers/inprocess_settings.py), checked on
    construction."""

    def __post_init__(self):
        bad = problems(self)
        if bad:
            raise ValueError("elasticd.inprocess settings: "
                             + "; ".join(f"{p.field}: {p.message}" for p in bad))

    @classmethod
    def resolve(cls, env=None, **given) -> "InProcessSettings":
        """Given values, else ``ELASTICD_INPROCESS_<NAME>`` from ``env``, else defaults."""
        return from_env(cls, os.environ if env is None else env, given)


class Wrapper:
    """Decorator: run the function with in-process restarts (see the module's doc)."""

    def __init__(self, *, backend: str = "gloo", soft_timeout: float | None = None,
                 hard_timeout: float | None = None, barrier_timeout: float | None = None,
                 monitor_interval: float | None = None, max_restarts: int | None = None,
                 repeat_limit: int | None = None, repeat_window: float | None = None,
                 backoff: float | None = None):
        self.backend = backend
        self.settings = InProcessSettings.resolve(
            soft_timeout=soft_timeout, hard_timeout=hard_timeout,
            barrier_timeout=barrier_timeout, monitor_interval=monitor_interval,
            max_restarts=max_restarts, repeat_limit=repeat_limit, repeat_window=repeat_window,
            backoff=backoff)

    def __call__(self, fn):
        takes_iteration = "iteration" in inspect.signature(fn).parameters

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            return _Run(self, fn, takes_iteration).run(args, kwargs)
        return wrapped


class _Run:
    """One call of a wrapped function, with all its restart iterations."""

    def __init__(self, wrapper: Wrapper, fn, takes_iteration: bool):
        self.w = wrapper
        self.s = wrapper.settings
        self.fn = fn
        self.takes_iteration = takes_iteration
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.report = Reporter(os.environ.get(inprocess_reports.ENV, ""), self.rank)
        self.faults: collections.deque[float] = collections.deque()  # monotonic fault times

    def run(self, args, kwargs):
        if dist.is_initialized():
            raise RuntimeError("elasticd.inprocess.Wrapper builds the process group itself; "
                               "do not call init_process_group before the wrapped function")
        addr = os.environ.get(jobstore_env.ADDR)
        if not addr:
            log.warning("rank %d: no ELASTICD_STORE_ADDR (not submitted with --inprocess): "
                        "running once, faults restart the processes", self.rank)
            import_before_any_group()
            dist.init_process_group(self.w.backend, timeout=td(self.s.hard_timeout))
            try:
                value = self._call(args, kwargs, 0)
            except BaseException:
                teardown()
                raise
            close_group()
            return value
        import_before_any_group()
        base = dist.TCPStore(addr, int(os.environ[jobstore_env.PORT]), is_master=False,
                             timeout=td(self.s.barrier_timeout), wait_for_workers=False)
        # One prefix per round and process attempt: a store that outlives a round (its
        # node stays the first member) never hands a new group an old group's keys.
        attempt = os.environ.get(envnames.TORCHRUN_RESTART_COUNT, "0")
        rnd = os.environ.get(envnames.ROUND, "0")
        # ... under a prefix derived from the job's secret, every record sealed with a key
        # derived from it too: whoever connects can see keys but cannot forge records.
        secret = os.environ.get(jobstore_env.SECRET, "")
        if not jobstore_env.valid_secret(secret):
            raise RuntimeError(f"{jobstore_env.SECRET} is missing or shorter than 128 bits: "
                               "in-process restart needs the secret elasticd gives the ranks")
        prefix = jobstore_env.key_prefix(secret, rnd, attempt)
        root = dist.PrefixStore(prefix, base)
        self.sealer = RecordSealer(jobstore_env.record_key(secret), prefix,
                                   label=f"r{rnd}a{attempt}/", on_first_reject=lambda kind:
                                   self.report.write({"kind": "forged", "record": kind}))
        iteration, fault, fault_time = 0, "", 0.0
        replaces = os.environ.get(envnames.INPROCESS_REPLACES, "")
        if replaces:
            iteration, fault = self._join_point(root, replaces)
            fault_time = time.time()
        while True:
            if iteration > self.s.max_restarts:
                self._give_up(f"{self.s.max_restarts} in-process restarts used; last fault: "
                              f"{fault}", None)
            store = dist.PrefixStore(f"it{iteration}/", root)
            coord = self._coord(root, iteration, min(0.02, self.s.monitor_interval))
            coord.enter()
            try:
                outcome = self._iteration(coord, store, iteration, args, kwargs,
                                          (fault, fault_time))
            except BarrierTimeout as exc:
                self._give_up(str(exc), exc)
            if outcome.done:
                return outcome.value
            fault, fault_time = outcome.fault, time.time()
            self._count_fault(outcome)
            iteration += 1
            say(f"rank {self.rank}: fault in iteration {iteration - 1} ({outcome.fault}); "
                f"restarting in-process as iteration {iteration}")
            _pause(self.s.backoff)

    def _join_point(self, root, replaces: str) -> tuple[int, str]:
        """The iteration a replacement rank joins, and the fault it replaces.

        ``latest`` is the newest iteration any rank entered. If its start
        barrier has opened, the dead rank was in it: report the fault there
        (the others may not have noticed yet) and join the next one; if not,
        the others wait at that barrier for us.
        """
        latest = latest_iteration(lambda n: dist.PrefixStore(f"it{n}/", root), self.sealer,
                                  self.rank, self.world_size, self.s.max_restarts + 1)
        fault = f"rank {self.rank}: {replaces}; replaced by pid {os.getpid()}"
        coord = self._coord(root, latest, 0.02)
        if not coord.opened("start"):
            return latest, fault
        return latest + 1, coord.report_fault(fault[:500])

    def _coord(self, root, iteration: int, poll: float) -> IterationStore:
        return IterationStore(dist.PrefixStore(f"it{iteration}/", root), self.rank,
                              self.world_size, poll=poll, beat=keepalive,
                              sealer=self.sealer.within(f"it{iteration}/"))

    def _count_fault(self, outcome: "_Outcome") -> None:
        """Give up when faults keep coming: repeat_limit of them within repeat_window."""
        now = time.monotonic()
        self.faults.append(now)
        while self.faults and now - self.faults[0] > self.s.repeat_window:
            self.faults.popleft()
        if len(self.faults) >= self.s.repeat_limit:
            self._give_up(f"{len(self.faults)} faults within {self.s.repeat_window:g}s "
                          f"(inprocess.repeat_limit {self.s.repeat_limit}); last fault: "
                          f"{outcome.fault}", outcome.error)

    def _give_up(self, why: str, cause: BaseException | None):
        self.report.write({"kind": "abandoned", "reason": why})
        say(f"rank {self.rank}: in-process restart gives up: {why}")
        raise RestartAbandoned(f"rank {self.rank}: {why}") from cause

    def _iteration(self, coord: IterationStore, store, iteration: int, args, kwargs,
                   after: tuple[str, float]) -> "_Outcome":
        waited = coord.barrier("start", self.s.barrier_timeout)
        dist.init_process_group(self.w.backend, store=dist.PrefixStore("pg/", store),
                                rank=self.rank, world_size=self.world_size,
                                timeout=td(self.s.hard_timeout))
        ready = time.time()
        say(f"INPROCESS_ITERATION {iteration} rank={self.rank} pid={os.getpid()} "
            f"t={ready:.6f} barrier_wait={waited:.3f}s")
        if iteration:
            self.report.write({"kind": "restart", "iteration": iteration, "fault": after[0],
                               "fault_time": after[1], "ready_time": ready})
        monitor = Monitor(coord, self.rank, self.s, threading.get_ident(), self.report)
        monitor.start()
        try:
            value, error = self._call(args, kwargs, iteration), None
        except BaseException as exc:  # sorted out below, once nothing can interrupt us
            value, error = None, exc
        monitor.quiesce()
        clean = False
        try:
            if error is None:
                fault = coord.finish(self.s.barrier_timeout)
                if fault is None:
                    clean = True
                    return _Outcome(True, value=value)
            elif isinstance(error, RestartRequested):
                fault = coord.fault() or "restart requested"
            elif isinstance(error, Exception):
                text = str(error).splitlines()[0] if str(error) else ""
                what = f"rank {self.rank}: {type(error).__name__}: {text}"
                fault = coord.report_fault(what[:500])
                if fault.startswith(f"rank {self.rank}:"):
                    log.error("rank %d: the wrapped function raised", self.rank,
                              exc_info=error)
            else:
                # Exit or interrupt: not ours to restart from; the others must not wait for us.
                coord.report_fault(f"rank {self.rank}: {type(error).__name__}")
                raise error
        finally:
            if error is not None:
                # The traceback's frames hold the function's locals, which can keep the
                # process group (and its connections) alive; it was logged above.
                error.__traceback__ = None
            if clean:
                close_group()   # every rank returned: nobody waits on us, end it gracefully
            else:
                teardown()  # closes our connections: peers still blocked in a collective fail now
        return _Outcome(False, fault=fault, error=error)

    def _call(self, args, kwargs, iteration: int):
        if self.takes_iteration:
            kwargs = dict(kwargs, iteration=iteration)
        return self.fn(*args, **kwargs)


@dataclass
class _Outcome:
    done: bool
    value: object = None
    fault: str = ""
    error: BaseException | None = None


def _pause(seconds: float) -> None:
    """Wait between iterations, still beating (the daemon must not take us for hung)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        keepalive()
        time.sleep(min(left, 1.0))
