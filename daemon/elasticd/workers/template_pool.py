"""This node's worker templates between a user's jobs: kept idle, taken by the next.

A job's agent asks the pool for its template (``acquire``) as the job
arrives. When an idle template's key (workers/template_key.py: the same uid,
gid and groups, interpreter, flags, entry, cwd, CPUs, environment and
preload) equals the job's, the job takes it and its first ranks are forked
at once, with no interpreter start and no ``import torch`` after the submit;
otherwise a new template starts. When the job ends here its agent hands the
template back (``release``): a template that is ready and has no rank left
waits, idle, for the next job of that key, up to ``agent.template_idle_timeout``
(0: none is kept; each ends with its job). Idle templates are bounded per
user (``agent.template_idle_per_user``, the user's share of this node) and
per node (``agent.template_idle_max``): the longest idle goes first.

Threads: the pool's own thread (one owner, a stop event, bounded waits)
starts every template's process (``spawn``), so that each template's
PDEATHSIG is tied to a thread that lives as long as the daemon: a template
outlives the agent of the job that started it, never the daemon. The same
thread ends idle templates whose time is up or that died. A template is used
by one thread at a time: the agent that acquired it, or the pool while it
idles (every look at an idle one is made under the pool's lock).

Nothing of one job passes to the next but what the key says is equal: a
forked rank gets its own job's environment, directory, argv and log
(warmstart._become_rank); the template's own output stays in the log of the
job that started it.
"""
from __future__ import annotations

import json
import logging
import os
import pwd
import queue
import re
import subprocess
import threading
import time
from dataclasses import dataclass

from . import files, group as workers
from .signals import kill_group
from .template import TemplateState, WorkerTemplate
from .template_key import TemplateKey, entry_part, key_from_record, key_to_record
from .. import statedir
from ..logsetup import ctx
from ..trust.values import BadValue, decode

log = logging.getLogger("elasticd.workers.template_pool")

SAVED_NAME = "idle-templates.json"   # in the state dir, between a stop and the next start
_SAVED_MAX = 16 << 20
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


def _saved(rec) -> tuple[TemplateKey, list, str]:
    """(key, boot arguments, job whose log it writes to) of one saved template, checked."""
    if not isinstance(rec, dict):
        raise ValueError("not an object")
    key = key_from_record(rec.get("key"))
    boot, job = rec.get("boot"), rec.get("log_job")
    if not isinstance(boot, list) or not all(isinstance(a, str) for a in boot) \
            or workers.warm_args([key.interpreter, *boot]) is None \
            or entry_part(boot) != (key.flags, key.entry):
        raise ValueError("its command is not one a template runs")
    if not isinstance(job, str) or not _JOB_ID.match(job):
        raise ValueError("not a job id")
    return key, list(boot), job


@dataclass(frozen=True)
class Acquired:
    """A job's template, and whether it came from the pool (idle how long)."""
    template: WorkerTemplate
    reused: bool = False
    idle_seconds: float = 0.0

    def sentence(self) -> str:
        t = self.template
        if self.reused:
            return (f"worker template reused from the pool (idle {self.idle_seconds:.0f} s, "
                    f"pid {t.pid}, key {t.key.digest}): " +
                    ("no import after the submit" if t.state is TemplateState.READY else
                     "started again at the daemon's start, still importing"))
        return ""


@dataclass(frozen=True)
class IdleTemplate:
    """One idle template, as status and metrics show it."""
    uid: int
    pid: int
    key: str               # TemplateKey.digest
    last_job: str
    idle_seconds: float
    rss_bytes: int


@dataclass
class _Idle:
    template: WorkerTemplate
    since: float


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


class TemplatePool:
    def __init__(self, cfg):
        self._cfg = cfg
        self._agent = cfg.agent
        self._lock = threading.Lock()
        self._idle: list[_Idle] = []
        self._requests: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reuses = 0     # jobs that took an idle template (metrics)

    # -- for the agents ------------------------------------------------------
    def acquire(self, job_id: str, spec: workers.GroupSpec, learned=()) -> Acquired:
        """The template for ``spec``'s job: an idle one with an equal key, else a new
        one, starting (its state says how it went; OFF: the command takes none)."""
        a = self._agent
        key = TemplateKey.of(spec, a.warm_preload, learned)
        if key is not None:
            while True:
                entry = self._take(key)
                if entry is None:
                    break
                t = entry.template
                if t.state is TemplateState.STARTING or t.settle(0):  # (restored: importing)
                    t.job_id = job_id
                    with self._lock:
                        self.reuses += 1
                    got = Acquired(t, True, time.monotonic() - entry.since)
                    log.info("%s: %s", ctx(job=job_id, node=self._cfg.daemon.node_id),
                             got.sentence())
                    return got
                t.stop()  # it died while idle: the next, or a new one
        t = WorkerTemplate(job_id, self._cfg.daemon.node_id, a.template_ready_timeout,
                           a.template_fork_timeout)
        t.start(spec, key, spawn=self.spawn)
        return Acquired(t)

    def release(self, template: WorkerTemplate | None, keep: bool = True) -> str:
        """The template of a job that ended here: kept idle for the user's next job
        with an equal key (when ``keep``, wanted, ready with no rank left, and the
        pool still runs), else stopped. One sentence saying which."""
        if template is None or template.state not in (TemplateState.STARTING,
                                                      TemplateState.READY):
            return ""
        a = self._agent
        why = ("the daemon is stopping" if self._stop.is_set() or not keep else
               "agent.template_idle_timeout is 0" if a.template_idle_timeout <= 0 else
               "agent.template_idle_per_user is 0" if a.template_idle_per_user <= 0 else
               "agent.template_idle_max is 0" if a.template_idle_max <= 0 else
               "it is not ready, or a rank of it is still alive"
               if template.key is None or not template.settle(1.0) else "")
        if why:
            template.stop()
            return f"worker template stopped ({why})"
        uid = template.key.uid
        with self._lock:
            self._idle.append(_Idle(template, time.monotonic()))
            evicted = self._evict(uid)
        self._ensure_thread()
        for e in evicted:
            self._end(e, "the longest idle over the pool's limits "
                         "(agent.template_idle_per_user / template_idle_max)")
        log.info("%s: worker template pid %d kept idle for uid %d's next job with the same "
                 "key %s (up to %g s)", ctx(job=template.job_id, node=self._cfg.daemon.node_id),
                 template.pid, uid, template.key.digest, self._agent.template_idle_timeout)
        return (f"worker template kept idle for this user's next job with the same "
                f"interpreter, directory and environment (pid {template.pid}, up to "
                f"{self._agent.template_idle_timeout:g} s: agent.template_idle_timeout)")

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

    # -- what there is -------------------------------------------------------
    def idle(self) -> list[IdleTemplate]:
        now = time.monotonic()
        with self._lock:
            return [IdleTemplate(e.template.key.uid, e.template.pid, e.template.key.digest,
                                 e.template.job_id, now - e.since, e.template.rss_bytes())
                    for e in self._idle]

    # -- life ----------------------------------------------------------------
    def stop(self, timeout: float = 5.0) -> None:
        """End the pool's thread and every idle template (the daemon is stopping)."""
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
        with self._lock:
            idle, self._idle = self._idle, []
        if self._agent.template_restore:
            self._save(idle)
        for e in idle:
            self._end(e, "the daemon is stopping")

    # -- over a daemon restart (agent.template_restore) ----------------------------
    @property
    def _saved_path(self) -> str:
        return os.path.join(self._cfg.daemon.state_dir, SAVED_NAME)

    def _save(self, idle: list[_Idle]) -> None:
        """What the idle templates were made of, for the next start (``restore``)."""
        records = [{"key": key_to_record(e.template.key), "boot": e.template.boot_args,
                    "log_job": e.template.log_job} for e in idle
                   if e.template.key is not None and e.template.boot_args]
        if not records:
            return
        path = self._saved_path
        try:
            tmp = path + ".tmp"
            fd = statedir.open_private(tmp, os.O_WRONLY | os.O_TRUNC)
            with open(fd, "w") as fh:
                json.dump({"version": 1, "templates": records}, fh)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("%s: could not keep the idle worker templates for the next start: %s",
                        ctx(node=self._cfg.daemon.node_id), exc)

    def restore(self) -> int:
        """Start again the templates that were idle when the daemon last stopped, so that
        each user's next job is warm from the first submit after a restart; each waits
        a full ``agent.template_idle_timeout``. The saved file is read once and removed.
        Returns how many started."""
        path = self._saved_path
        got = files.read(path, os.geteuid(), _SAVED_MAX)  # never a link, FIFO or giant
        if got.problem is files.Problem.MISSING:
            return 0
        try:
            os.unlink(path)
        except OSError:
            pass
        if not self._agent.template_restore or self._agent.template_idle_timeout <= 0:
            return 0
        try:
            records = decode(got.data, max_bytes=_SAVED_MAX).get("templates") if got.ok \
                else None
        except BadValue:
            records = None
        if not isinstance(records, list):
            log.warning("%s: idle worker templates not restored: %s is %s",
                        ctx(node=self._cfg.daemon.node_id), path,
                        got.problem.value if got.problem else "not what this daemon wrote")
            return 0
        started = 0
        for rec in records[:self._agent.template_idle_max]:
            try:
                key, boot, job = _saved(rec)
            except ValueError as exc:
                log.warning("%s: a saved idle worker template skipped: %s",
                            ctx(node=self._cfg.daemon.node_id), exc)
                continue
            try:
                pwd.getpwuid(key.uid)
            except KeyError:
                log.info("%s: a saved idle worker template of uid %d skipped: no such user "
                         "any more", ctx(node=self._cfg.daemon.node_id), key.uid)
                continue
            with self._lock:
                mine = sum(1 for e in self._idle if e.template.key.uid == key.uid)
                if mine >= self._agent.template_idle_per_user \
                        or len(self._idle) >= self._agent.template_idle_max:
                    continue
            a = self._agent
            t = WorkerTemplate(job, self._cfg.daemon.node_id, a.template_ready_timeout,
                               a.template_fork_timeout)
            t.start(self._restore_spec(key, boot, job), key, spawn=self.spawn)
            if t.state is not TemplateState.STARTING:
                continue
            with self._lock:
                self._idle.append(_Idle(t, time.monotonic()))
            started += 1
            log.info("%s: worker template pid %d of uid %d started again, idle for the "
                     "user's next job with key %s (it was idle when the daemon stopped)",
                     ctx(node=self._cfg.daemon.node_id), t.pid, key.uid, key.digest)
        return started

    def _restore_spec(self, key: TemplateKey, boot: list, job: str) -> workers.GroupSpec:
        return workers.GroupSpec(
            job_id=job, command=(key.interpreter, *boot), cwd=key.cwd, env={}, uid=key.uid,
            gid=key.gid, nproc=1, restart_count=0, max_restarts=0, round=0, group_rank=0,
            group_world_size=1, world_size=1, rank_offset=0, master_addr="", master_port=0,
            log_dir=os.path.join(self._cfg.logs_dir, job), run_dir="",
            node_id=self._cfg.daemon.node_id, cpus=key.cpus)

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
                log.exception("%s: could not look at the idle worker templates",
                              ctx(node=self._cfg.daemon.node_id))

    def _expire(self) -> None:
        now = time.monotonic()
        ended: list[tuple[_Idle, str]] = []
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
        for e, why in ended:
            self._end(e, why)

    # -- under the lock ------------------------------------------------------
    def _take(self, key: TemplateKey) -> _Idle | None:
        with self._lock:
            for e in reversed(self._idle):  # the most recently idle first
                if e.template.key == key:
                    self._idle.remove(e)
                    return e
        return None

    def _evict(self, uid: int) -> list[_Idle]:
        out = []
        mine = [e for e in self._idle if e.template.key.uid == uid]
        while len(mine) > self._agent.template_idle_per_user:
            e = mine.pop(0)
            self._idle.remove(e)
            out.append(e)
        while len(self._idle) > self._agent.template_idle_max:
            out.append(self._idle.pop(0))
        return out

    def _end(self, e: _Idle, why: str) -> None:
        t = e.template
        log.info("%s: idle worker template pid %d of uid %d ended: %s",
                 ctx(node=self._cfg.daemon.node_id), t.pid, t.key.uid, why)
        t.stop()
