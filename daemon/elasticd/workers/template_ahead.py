"""Worker templates started before any job asks: at the daemon's start, and on request.

Two ways a user's next job finds its template ready at the submit, each put
into the node's pool (workers/template_pool.py) as an idle template, bounded
like any other (``agent.template_idle_per_user``, ``template_idle_max``,
``template_idle_rss_max``) and ended after ``agent.template_idle_timeout``:

* ``restore``: at the daemon's start, the templates the pool knew of when the
  daemon last ran (workers/template_saved.py: written as they changed, so a
  crash loses nothing of it): a job's that ran then, and an idle one whose
  idle timeout, counted from its last use, has not passed; the most recent
  first, within the bounds (memory: what each last measured);
* ``warm``: ``elasticctl template warm -- python train.py`` from a local user
  who has not run a job here yet: a template made of that request as a
  submit's would be (checked by the same validator, the caller's uid and gid
  from the kernel, their directory and environment), as that user, for the
  job to come. At most ``agent.template_idle_per_user`` of a user's may be
  importing at once; one the same job would take already is named instead.

Their output goes to ``logs/JOB/template.log`` of the job they were last
made for, or ``logs/warm-UID/template.log`` (cut past 1 MiB) for one started
ahead.
"""
from __future__ import annotations

import logging
import os
import pwd
import time
from dataclasses import dataclass

from . import group as workers
from .round_place import RoundPlace
from .template import TemplateState, WorkerTemplate
from .template_key import TemplateKey, template_env
from .template_saved import SavedTemplate
from .. import errors
from ..logsetup import ctx

log = logging.getLogger("elasticd.workers.template_pool")

_WARM_LOG_MAX = 1 << 20


@dataclass(frozen=True)
class Warmed:
    """What `elasticctl template warm` is told."""
    pid: int
    key: str               # TemplateKey.digest
    state: str             # TemplateState: starting (importing), ready, stopped
    already: bool          # one that fits was idle already: nothing started


def spec_for(cfg, uid: int, gid: int, command: tuple, cwd: str, env: dict, nproc: int,
             cpus: tuple, log_job: str) -> workers.GroupSpec:
    """What a template is started from when no job asked for it."""
    return workers.GroupSpec(
        job_id=log_job, command=tuple(command), cwd=cwd, env=dict(env), uid=uid, gid=gid,
        nproc=nproc, restart_count=0, max_restarts=0, place=RoundPlace.before_any_round(nproc),
        log_dir=os.path.join(cfg.logs_dir, log_job), run_dir="", node_id=cfg.daemon.node_id,
        cpus=tuple(cpus))


def _new(cfg, job: str) -> WorkerTemplate:
    a = cfg.agent
    return WorkerTemplate(job, cfg.daemon.node_id, a.template_ready_timeout,
                          a.template_fork_timeout)


def warm(pool, cfg, uid: int, gid: int, command: tuple, cwd: str, env: dict,
         nproc: int) -> Warmed:
    """A template started now for a job of ``uid`` that has not come yet (a checked
    request of theirs: command, directory, environment, ranks per node), idle from now
    on in ``pool``; or the idle one such a job would take. errors.* say why none is."""
    a = cfg.agent
    why = "agent.worker_template is off" if not a.worker_template else pool.closed()
    if why:
        raise errors.FailedPrecondition(f"no worker template is kept idle here: {why}")
    job = f"warm-{uid}"
    spec = spec_for(cfg, uid, gid, command, cwd, env, nproc, (), job)
    key = TemplateKey.of(spec, a.warm_preload, (), a.template_key_env)
    if key is None:
        raise errors.InvalidArgument("command: a worker template runs only `python [-u|-B] "
                                     "SCRIPT ...` or `python [-u|-B] -m MODULE ...`")
    env = template_env(spec)
    there = pool.fitting(key, env)
    if there is not None:
        return Warmed(there.pid, key.digest, there.state.value, True)
    ahead = sum(1 for t in pool.idle() if t.uid == uid and t.origin == "ahead"
                and t.state == TemplateState.STARTING.value)
    if ahead >= a.template_idle_per_user:
        raise errors.ResourceExhausted(
            f"uid {uid} has {ahead} worker template(s) starting ahead already "
            f"(agent.template_idle_per_user {a.template_idle_per_user}); ask again once "
            "they are ready (elasticctl nodes)")
    _trim(os.path.join(spec.log_dir, "template.log"))
    t = _new(cfg, job)
    t.start(spec, key, env, spawn=pool.spawn)
    if t.state is not TemplateState.STARTING:
        raise errors.FailedPrecondition(f"the worker template did not start: {t.reason}")
    kept = pool.admit(t, "ahead")
    pool.save()
    log.info("%s: worker template pid %d of uid %d started ahead of its job (key %s), %s",
             ctx(node=cfg.daemon.node_id), t.pid, uid, key.digest,
             f"idle up to {a.template_idle_timeout:g} s" if kept else
             "ended at once: over the pool's limits")
    return Warmed(t.pid, key.digest, t.state.value, False)


def restore(pool, cfg, saved: list[SavedTemplate]) -> int:
    """Start again in ``pool`` what ``saved`` says (see the module docstring); returns
    how many started."""
    a = cfg.agent
    why = "agent.template_restore is off" if not a.template_restore else pool.closed()
    started, rss, now = 0, 0, time.time()
    for rec in sorted(saved, key=lambda r: (not r.in_use, -r.used_at)):
        idle_for = 0.0 if rec.in_use else max(0.0, now - rec.used_at)
        idle = pool.idle()
        mine = sum(1 for t in idle if t.uid == rec.key.uid)
        skip = why or (
            f"idle {idle_for:.0f} s (agent.template_idle_timeout)"
            if idle_for >= a.template_idle_timeout else
            "agent.template_idle_per_user" if mine >= a.template_idle_per_user else
            "agent.template_idle_max" if len(idle) >= a.template_idle_max else
            "agent.template_idle_rss_max" if rss + rec.rss_bytes > a.template_idle_rss_max
            else "" if _user_exists(rec.key.uid) else "no such user any more")
        if skip:
            log.info("%s: a recent worker template of uid %d (key %s) not started again: %s",
                     ctx(node=cfg.daemon.node_id), rec.key.uid, rec.key.digest, skip)
            continue
        t = _new(cfg, rec.log_job)
        t.start(spec_for(cfg, rec.key.uid, rec.key.gid, (rec.key.interpreter, *rec.boot),
                         rec.key.cwd, rec.env, 1, rec.key.cpus, rec.log_job),
                rec.key, rec.env, spawn=pool.spawn)
        if t.state is not TemplateState.STARTING or not pool.admit(t, "restored", idle_for):
            continue
        started, rss = started + 1, rss + rec.rss_bytes
        log.info("%s: worker template pid %d of uid %d started again, idle for the user's "
                 "next job with key %s (%s when the daemon last ran)",
                 ctx(node=cfg.daemon.node_id), t.pid, rec.key.uid, rec.key.digest,
                 "a job's" if rec.in_use else f"idle {idle_for:.0f} s")
    return started


def _user_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _trim(path: str) -> None:
    """Cut a template.log that passed _WARM_LOG_MAX (root's, in the state dir)."""
    try:
        if os.stat(path, follow_symlinks=False).st_size > _WARM_LOG_MAX:
            os.truncate(path, 0)
    except OSError:
        pass
