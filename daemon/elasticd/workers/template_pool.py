"""This node's worker templates between a user's jobs: kept idle, taken by the next.

A job's agent asks the pool for its template (``acquire``) as the job
arrives. When an idle template's key (workers/template_key.py: the same uid,
gid and groups, interpreter, flags, entry, cwd, CPUs, preload and
import-shaping variables) equals the job's, and every variable its imports
read has the same value in the job's environment (``EnvReads``), the job
takes it and its first ranks are forked at once, with no interpreter start
and no ``import torch`` after the submit; otherwise a new template starts,
never one whose imports saw something else. When the job ends here its
agent hands the template back (``release``): a template that is ready and
has no rank left waits, idle, for the next job that fits it, up to
``agent.template_idle_timeout`` (0: none is kept; each ends with its job).
Idle templates are bounded per user (``agent.template_idle_per_user``), per
node (``agent.template_idle_max``) and in resident memory, all together
(``agent.template_idle_rss_max``): the longest idle goes first.

Ready before the submit: what every template the pool knows of (idle, or a
job's now) was made of is written to the state dir whenever that changes
(workers/template_saved.py); workers/template_ahead.py starts the recent ones
again at the daemon's next start, after a clean stop or a crash, and one
ahead of a user's first job on request (``elasticctl template warm``), each
idle in the pool from then on. A job that finds one still importing under
its very environment takes it at once (it fits whatever its imports read) and
waits for it after its round is joined, as for its own; one importing under
another environment is waited for first (its reads are known once it is
ready), a wait the job's cancel or end cuts short.

Threads: the pool's own thread (one owner, a stop event, bounded waits)
starts every template's process (``spawn``), so that each template's
PDEATHSIG is tied to a thread that lives as long as the daemon: a template
outlives the agent of the job that started it, never the daemon. The same
thread ends idle templates whose time is up, that died, or that pass the
memory bound. A template is used by one thread at a time: the agent that
acquired it, or the pool while it idles (every look at an idle one is made
under the pool's lock).

A forked rank gets its own job's environment, directory, argv and log
(warmstart._become_rank); the template's output stays in its first job's log.
"""
from __future__ import annotations

import bisect
import logging
import queue
import subprocess
import threading
import time
from dataclasses import dataclass

from . import group as workers, template_ahead, template_saved
from .signals import kill_group
from .template import TemplateState, WorkerTemplate
from .template_key import TemplateKey, template_env
from .template_saved import SavedTemplate
from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.template_pool")

_HOW = {"restored": "started again at the daemon's start",
        "ahead": "started ahead (elasticctl template warm)"}


@dataclass(frozen=True)
class Acquired:
    """A job's template, and whether it came from the pool (idle how long, made how)."""
    template: WorkerTemplate
    reused: bool = False
    idle_seconds: float = 0.0
    origin: str = "job"

    def sentence(self) -> str:
        how, t = _HOW.get(self.origin, ""), self.template
        gain = ("still importing, started before the job came"
                if t.state is TemplateState.STARTING else "no import after the submit")
        return "" if not self.reused else (
            f"worker template reused from the pool (idle {self.idle_seconds:.0f} s, pid "
            f"{t.pid}, key {t.key.digest}{', ' + how if how else ''}): {gain}")


@dataclass(frozen=True)
class IdleTemplate:
    """One idle template, as status and metrics show it."""
    uid: int
    pid: int
    key: str               # TemplateKey.digest
    last_job: str
    idle_seconds: float
    rss_bytes: int
    origin: str            # template_saved.ORIGINS
    state: str             # TemplateState: starting (importing) or ready


@dataclass(eq=False)
class _Entry:
    template: WorkerTemplate
    since: float           # monotonic: idle since (a job's: taken then)
    origin: str
    used_at: float         # the wall clock at ``since``


def _since(e: _Entry) -> float:
    return e.since


class _Spawn:
    """One process start asked of the pool's thread."""

    def __init__(self, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        self.done = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.lock = threading.Lock()

    def run(self) -> None:
        try:
            proc = workers.start_job_process(*self.args, **self.kwargs)
        except BaseException as exc:  # SpawnError, or a bug: the asker sees it
            self.error = exc
            self.done.set()
            return
        with self.lock:
            if self.abandoned:  # the asker gave up waiting: nobody would own it
                kill_group(proc.pid, 9)
                proc.wait()
            else:
                self.proc = proc
        self.done.set()


class _AnySet:
    """Set when any of its events is (None: never): one stop for ``WorkerTemplate.ready``."""

    def __init__(self, *events: threading.Event | None):
        self._events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)


class TemplatePool:
    def __init__(self, cfg):
        self._cfg = cfg
        self._agent = cfg.agent
        self._lock = threading.Lock()
        self._idle: list[_Entry] = []            # longest idle first
        self._busy: dict[int, _Entry] = {}       # id(template) -> entry: jobs' templates
        self._parked: list[SavedTemplate] = []   # jobs' templates the daemon's stop ended
        self._save_lock = threading.Lock()
        self._saved_last = False                 # the stop wrote the file: no more writes
        self._requests: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reuses = 0     # jobs that took an idle template (metrics)

    def _where(self, job: str | None = None) -> str:
        return ctx(job=job, node=self._cfg.daemon.node_id)

    # -- for the agents ------------------------------------------------------
    def acquire(self, job_id: str, spec: workers.GroupSpec, learned=(),
                stop: threading.Event | None = None) -> Acquired:
        """The template for ``spec``'s job: an idle one it fits, else a new one, starting
        (its state says how it went; OFF: the command takes none, or ``stop`` was set,
        by a cancel or the job's end, while it waited for an idle one's imports)."""
        a = self._agent
        key = TemplateKey.of(spec, a.warm_preload, learned, a.template_key_env)
        env = template_env(spec)
        got = self._reuse(job_id, key, env, stop) if key is not None else None
        if got is None:
            t = WorkerTemplate(job_id, self._cfg.daemon.node_id, a.template_ready_timeout,
                               a.template_fork_timeout)
            if stop is None or not stop.is_set():  # set: OFF, none is started
                t.start(spec, key, env, spawn=self.spawn)
            got = Acquired(t)
        if got.template.state in (TemplateState.STARTING, TemplateState.READY):
            with self._lock:
                self._busy[id(got.template)] = _Entry(got.template, time.monotonic(),
                                                      got.origin, time.time())
            self.save()
        return got

    def _reuse(self, job_id: str, key: TemplateKey, env: dict,
               stop: threading.Event | None) -> Acquired | None:
        """An idle template ``key`` and ``env`` fit, taken out of the pool, or None."""
        passed: list[_Entry] = []  # importing when taken; then what they read differed
        try:
            while True:
                e = self._take(job_id, key, env)
                if e is None:
                    return None
                t = e.template
                if t.state is TemplateState.STARTING and t.env == env:
                    # Importing under the job's very environment: it fits whatever its
                    # imports read. Taken at once; the agent waits for it (as for its
                    # own) only after its round is joined, where a cancel, a peer's word
                    # or the job's end still reach it.
                    return self._taken(job_id, e)
                if t.state is TemplateState.STARTING:
                    # What its imports read is known once it is ready; a cancel or the
                    # job's end (``stop``) cuts the wait short: it goes back, idle.
                    log.info("%s: waiting for idle worker template pid %d's imports (%s, "
                             "another environment) to know whether the job may take it",
                             self._where(job_id), t.pid, _HOW.get(e.origin, "a job's"))
                    t.ready(stop=_AnySet(self._stop, stop))
                    if t.state is TemplateState.STARTING:
                        passed.append(e)
                        return None
                if not t.settle(0):
                    self._end(e, f"it died while idle: {t.reason or t.state.value}")
                    continue
                if not t.fits(env):
                    self._passed(job_id, t)
                    passed.append(e)
                    continue
                return self._taken(job_id, e)
        finally:
            with self._lock:
                for e in passed:
                    bisect.insort(self._idle, e, key=_since)

    def _taken(self, job_id: str, e: _Entry) -> Acquired:
        """``e``'s template, out of the pool, now ``job_id``'s."""
        t = e.template
        t.job_id = job_id
        with self._lock:
            self.reuses += 1
        got = Acquired(t, True, time.monotonic() - e.since, e.origin)
        log.info("%s: %s", self._where(job_id), got.sentence())
        return got

    def release(self, template: WorkerTemplate | None, keep: bool = True) -> str:
        """The template of a job that ended here: kept idle for the user's next job that
        fits it (when ``keep``, wanted, ready with no rank left, and the pool still
        runs), else stopped. One sentence saying which. ``keep`` is False only when
        the daemon stops: what the template was made of is then kept for the next
        start (``restore``)."""
        if template is None:
            return ""
        with self._lock:
            entry = self._busy.pop(id(template), None)
        if template.state not in (TemplateState.STARTING, TemplateState.READY):
            self.save()
            return ""
        why = "the daemon is stopping" if not keep else self.closed() or (
            "it is not ready, or a rank of it is still alive"
            if template.key is None or not template.settle(1.0) else "")
        if why:
            if not keep and entry is not None:
                saved = template_saved.of(template, entry.origin, time.time(), True)
                if saved is not None:
                    with self._lock:
                        self._parked.append(saved)
            template.stop()
            self.save()
            return f"worker template stopped ({why})"
        uid = template.key.uid
        e = _Entry(template, time.monotonic(), "job", time.time())
        evicted = self._admit(e)
        self.save()
        if e in evicted:
            return ("worker template stopped (over the pool's limits: "
                    "agent.template_idle_per_user, template_idle_max, template_idle_rss_max)")
        log.info("%s: worker template pid %d kept idle for uid %d's next job with the same "
                 "key %s (up to %g s)", self._where(template.job_id), template.pid, uid,
                 template.key.digest, self._agent.template_idle_timeout)
        return (f"worker template kept idle for this user's next job with the same "
                f"interpreter, directory and import-shaping environment (pid {template.pid}, "
                f"up to {self._agent.template_idle_timeout:g} s: agent.template_idle_timeout)")

    def spawn(self, *args, **kwargs) -> subprocess.Popen:
        """``workers.start_job_process(*args, **kwargs)``, run on the pool's thread (see
        the module docstring); waits up to ``agent.template_ready_timeout``."""
        self._ensure_thread()
        if self._stop.is_set():
            raise workers.SpawnError("the daemon is stopping")
        req = _Spawn(args, kwargs)
        self._requests.put(req)
        if not req.done.wait(self._agent.template_ready_timeout):
            with req.lock:
                req.abandoned = True
                proc = req.proc
            if proc is None:
                raise workers.SpawnError("the template pool's thread did not start it in "
                                         f"{self._agent.template_ready_timeout:g} s")
        if req.error is not None:
            raise req.error
        if req.proc is None:
            raise workers.SpawnError("the daemon is stopping")
        return req.proc

    # -- before any job asks (workers/template_ahead.py: restore, warm) -----------
    def restore(self) -> int:
        """At the daemon's start: see template_ahead.restore."""
        saved, problems = template_saved.read(self._cfg.daemon.state_dir,
                                              self._agent.template_key_env)
        for problem in problems:
            log.warning("%s: recent worker templates not restored: %s", self._where(), problem)
        started = template_ahead.restore(self, self._cfg, saved)
        self.save()  # the file now says what runs
        return started

    def closed(self) -> str:
        """Why no template may be kept idle here, or ""."""
        a = self._agent
        return ("the daemon is stopping" if self._stop.is_set() else
                "agent.template_idle_timeout is 0" if a.template_idle_timeout <= 0 else
                "agent.template_idle_per_user is 0" if a.template_idle_per_user <= 0 else
                "agent.template_idle_max is 0" if a.template_idle_max <= 0 else
                "agent.template_idle_rss_max is 0" if a.template_idle_rss_max <= 0 else "")

    def fitting(self, key: TemplateKey, env: dict) -> WorkerTemplate | None:
        """An idle template a job of ``key`` and ``env`` would take (or one of the same
        environment still importing), left in the pool."""
        with self._lock:
            for e in reversed(self._idle):
                t = e.template
                if t.key == key and (t.env == env or t.fits(env)):
                    return t
        return None

    def admit(self, template: WorkerTemplate, origin: str, idle_for: float = 0.0) -> bool:
        """Put a template no job has into the pool, idle for ``idle_for`` s already;
        False when the pool's bounds ended it at once."""
        e = _Entry(template, time.monotonic() - idle_for, origin, time.time() - idle_for)
        return e not in self._admit(e)

    # -- what there is -------------------------------------------------------
    def idle(self) -> list[IdleTemplate]:
        now = time.monotonic()
        with self._lock:
            return [IdleTemplate(e.template.key.uid, e.template.pid, e.template.key.digest,
                                 e.template.job_id, now - e.since, e.template.rss_bytes(),
                                 e.origin, e.template.state.value)
                    for e in self._idle]

    # -- life ----------------------------------------------------------------
    def stop(self, timeout: float = 5.0) -> None:
        """End the pool's thread and every idle template (the daemon is stopping), once
        what they were made of is written for the next start."""
        self._stop.set()
        self._requests.put(None)
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        while True:  # asks that came too late: nothing starts any more
            try:
                req = self._requests.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                req.error = workers.SpawnError("the daemon is stopping")
                req.done.set()
        self.save(last=True)
        with self._lock:
            idle, self._idle = self._idle, []
        for e in idle:
            self._end(e, "the daemon is stopping")

    # -- over a daemon restart (agent.template_restore) ----------------------------
    def save(self, last: bool = False) -> None:
        """Write what the pool knows of (idle, jobs', parked) for the next start."""
        with self._save_lock:
            if self._saved_last:
                return
            self._saved_last = last
            with self._lock:  # (a job's that died is forgotten here)
                self._busy = {k: e for k, e in self._busy.items() if e.template.state in (
                    TemplateState.STARTING, TemplateState.READY)}
                saved = [] if not self._agent.template_restore else [
                    s for s in [template_saved.of(e.template, e.origin, e.used_at, False)
                                for e in reversed(self._idle)] +
                    [template_saved.of(e.template, e.origin, time.time(), True)
                     for e in self._busy.values()] + self._parked if s]
            try:
                template_saved.write(self._cfg.daemon.state_dir, saved)
            except OSError as exc:
                log.warning("%s: could not keep the worker templates: %s", self._where(), exc)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="template-pool",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                req = self._requests.get(timeout=self._agent.template_idle_check_interval)
            except queue.Empty:
                req = None
            if req is not None and not self._stop.is_set():
                req.run()
            elif req is not None:
                req.error = workers.SpawnError("the daemon is stopping")
                req.done.set()
            try:
                self._expire()
            except Exception:
                log.exception("%s: could not look at the idle worker templates", self._where())

    def _expire(self) -> None:
        now = time.monotonic()
        ended: list[tuple[_Entry, str]] = []
        with self._lock:
            for e in list(self._idle):
                if now - e.since >= self._agent.template_idle_timeout:
                    ended.append((e, f"idle for {now - e.since:.0f} s "
                                     "(agent.template_idle_timeout)"))
                elif not e.template.ready(0) and e.template.state is not TemplateState.STARTING:
                    ended.append((e, f"it died while idle: {e.template.reason}"))
                else:
                    continue
                self._idle.remove(e)
            ended += [(e, "the longest idle over agent.template_idle_rss_max")
                      for e in self._over_memory()]
        for e, why in ended:
            self._end(e, why)
        if ended:
            self.save()

    # -- under the lock ------------------------------------------------------
    def _take(self, job_id: str, key: TemplateKey, env: dict) -> _Entry | None:
        """The most recently idle template of ``key`` that ``env`` fits, else one of
        ``key`` still importing (whether it fits is known once it is ready)."""
        with self._lock:
            starting = None
            for e in reversed(self._idle):
                t = e.template
                if t.key != key:
                    continue
                if t.fits(env):
                    self._idle.remove(e)
                    return e
                if t.state is TemplateState.READY:
                    self._passed(job_id, t)
                elif starting is None and t.state is TemplateState.STARTING:
                    starting = e
            if starting is not None:
                self._idle.remove(starting)
            return starting

    def _admit(self, e: _Entry) -> list[_Entry]:
        """Put ``e`` in the pool and end what passes its bounds (maybe ``e``): the
        longest idle first. Returns what it ended."""
        with self._lock:
            bisect.insort(self._idle, e, key=_since)
            evicted = self._evict(e.template.key.uid)
        self._ensure_thread()
        for old in evicted:
            self._end(old, "the longest idle over the pool's limits "
                           "(agent.template_idle_per_user / template_idle_max / "
                           "template_idle_rss_max)")
        return evicted

    def _evict(self, uid: int) -> list[_Entry]:
        out = []
        mine = [e for e in self._idle if e.template.key.uid == uid]
        while len(mine) > self._agent.template_idle_per_user:
            e = mine.pop(0)
            self._idle.remove(e)
            out.append(e)
        while len(self._idle) > self._agent.template_idle_max:
            out.append(self._idle.pop(0))
        return out + self._over_memory()

    def _over_memory(self) -> list[_Entry]:
        sizes = [e.template.rss_bytes() for e in self._idle]
        out = []
        while self._idle and sum(sizes) > self._agent.template_idle_rss_max:
            sizes.pop(0)
            out.append(self._idle.pop(0))
        return out

    def _passed(self, job_id: str, t: WorkerTemplate) -> None:
        log.info("%s: idle worker template pid %d (key %s) not taken: a variable its imports "
                 "read (%s) differs", self._where(job_id), t.pid, t.key.digest,
                 t.env_reads.describe() if t.env_reads else "?")

    def _end(self, e: _Entry, why: str) -> None:
        t = e.template
        log.info("%s: idle worker template pid %d of uid %d ended: %s", self._where(), t.pid,
                 t.uid, why)
        t.stop()
