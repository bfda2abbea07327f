"""What makes a worker template fit for a job: ``TemplateKey``, built in one place.

A template (workers/template.py) is a process that imported torch and the
preload as the job's user would have at a cold start; a rank forked from it
keeps everything that import left behind. So two jobs may share one template
(workers/template_pool.py) only when everything that can shape those imports
is the same; the key is that, and two jobs share a template only if their
keys are equal:

* who: uid, gid and the supplementary groups the process runs with (a
  template is never shared across users, nor across group sets);
* what runs: the interpreter as the command names it, its flags (``-u``,
  ``-B``), and the entry (``-m``, or the script as written): with the
  working directory and PATH below they fix the executable exec resolves
  and the ``sys.path[0]`` a cold start gets, without the daemon resolving a
  path of the user's as root;
* where: the working directory (a relative PYTHONPATH entry, ``-m`` and a
  relative script resolve against it) and the CPUs it is bound to (a forked
  rank inherits them);
* the environment it imports under: ALL of the job's worker environment
  (the submitter's, plus what elasticd adds to every worker: PYTHONPATH with
  the worker site first, PYTHONUNBUFFERED, OMP_NUM_THREADS for several
  ranks) except ``PER_JOB_ENV``, names known to differ from one submit to
  the next and read by no import (the shell's PWD/OLDPWD/SHLVL/_ and the
  job's in-process store secret). Naming what may differ, not what may
  matter, is the safe way round: PYTHONPATH, PYTHONHOME, PYTHONNOUSERSITE,
  PYTHONSAFEPATH, PYTHONUSERBASE, LD_LIBRARY_PATH, LD_PRELOAD, OMP_*/MKL_*,
  TORCH_* and whatever else a library reads at import are all in;
* the preload: ``agent.warm_preload`` and the job's learned modules, in order.

The template is started from its key alone (its environment is ``env`` plus
elasticd's preload variables), so a template is what its key says,
whichever job started it. A forked rank still gets exactly its own job's
environment, directory, argv and log (warmstart._become_rank).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pwd
from dataclasses import dataclass

from . import group as workers

# Differ between two submits from the same shell; nothing imports them.
PER_JOB_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "ELASTICD_STORE_SECRET"})
_FLAGS = ("-u", "-B")
_SALT = os.urandom(16)  # TemplateKey.digest


def entry_part(args) -> tuple:
    """(flags, entry) of the arguments after the interpreter: the entry is "-m" for a
    module (any module: ``sys.path[0]`` is the cwd either way) or the script as written."""
    args = list(args)
    flags = []
    while args and args[0] in _FLAGS:
        flags.append(args.pop(0))
    entry = "" if not args else ("-m" if args[0] == "-m" else args[0])
    return tuple(flags), entry


def _groups(uid: int, gid: int) -> tuple[int, ...]:
    """The groups a process of ``uid`` runs with: as workers.as_user_kwargs gives them
    when it switches, this daemon's own when it does not."""
    if (uid, gid) == (os.geteuid(), os.getegid()):
        return tuple(sorted(set(os.getgroups())))
    try:
        return tuple(sorted(set(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))))
    except KeyError:
        return (gid,)


@dataclass(frozen=True)
class TemplateKey:
    uid: int
    gid: int
    groups: tuple[int, ...]
    interpreter: str
    flags: tuple[str, ...]
    entry: str
    cwd: str
    cpus: tuple[int, ...]
    env: tuple[tuple[str, str], ...]   # sorted (name, value)
    preload: tuple[str, ...]           # agent.warm_preload
    learned: tuple[str, ...]           # the job's learned preload (workers/preload.py)

    @classmethod
    def of(cls, spec: workers.GroupSpec, warm_preload, learned=()) -> "TemplateKey | None":
        """The key of ``spec``'s job, or None when its command is not one a template runs
        (not ``python [-u|-B] SCRIPT`` / ``python [-u|-B] -m MODULE``)."""
        args = workers.warm_args(spec.command)
        if args is None:
            return None
        flags, entry = entry_part(args)
        env = workers.base_env(spec)
        return cls(uid=spec.uid, gid=spec.gid, groups=_groups(spec.uid, spec.gid),
                   interpreter=spec.command[0], flags=flags, entry=entry, cwd=spec.cwd,
                   cpus=tuple(sorted(spec.cpus)),
                   env=tuple(sorted((k, v) for k, v in env.items() if k not in PER_JOB_ENV)),
                   preload=tuple(warm_preload), learned=tuple(learned))

    @property
    def digest(self) -> str:
        """A short name for logs, events and ``elasticctl nodes`` (which every user may
        run): keyed with this daemon's own random salt, so it tells equal keys apart
        and nothing of the environment behind them, not even to a guess."""
        return hmac.new(_SALT, repr(self).encode(), hashlib.sha256).hexdigest()[:10]


def key_to_record(key: TemplateKey) -> dict:
    """The key as JSON-able data (workers/template_pool.py keeps the idle ones' over a
    daemon restart, in the state dir: 0600, root's, like the job records)."""
    return {"uid": key.uid, "gid": key.gid, "groups": list(key.groups),
            "interpreter": key.interpreter, "flags": list(key.flags), "entry": key.entry,
            "cwd": key.cwd, "cpus": list(key.cpus), "env": [list(kv) for kv in key.env],
            "preload": list(key.preload), "learned": list(key.learned)}


def key_from_record(rec) -> TemplateKey:
    """``key_to_record``'s inverse; ValueError naming what is wrong with a record that
    is not one (the file is root's, but a half-written one is not trusted either)."""
    if not isinstance(rec, dict):
        raise ValueError("not an object")

    def ints(name):
        v = rec.get(name)
        if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
            raise ValueError(f"{name}: not a list of ids")
        return tuple(v)

    def strs(name):
        v = rec.get(name)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{name}: not a list of strings")
        return tuple(v)

    for name in ("uid", "gid"):
        if not isinstance(rec.get(name), int) or rec[name] < 0:
            raise ValueError(f"{name}: not an id")
    for name in ("interpreter", "entry", "cwd"):
        if not isinstance(rec.get(name), str) or not rec[name]:
            raise ValueError(f"{name}: not a string")
    env = rec.get("env")
    if not isinstance(env, list) or not all(
            isinstance(kv, list) and len(kv) == 2 and all(isinstance(x, str) for x in kv)
            for kv in env):
        raise ValueError("env: not a list of [name, value]")
    flags = strs("flags")
    if any(f not in _FLAGS for f in flags):
        raise ValueError("flags: only -u and -B")
    return TemplateKey(uid=rec["uid"], gid=rec["gid"], groups=ints("groups"),
                       interpreter=rec["interpreter"], flags=flags, entry=rec["entry"],
                       cwd=rec["cwd"], cpus=ints("cpus"),
                       env=tuple(sorted((k, v) for k, v in env)), preload=strs("preload"),
                       learned=strs("learned"))
