"""What makes a worker template fit for a job: ``TemplateKey`` and ``EnvReads``, built here.

A template (workers/template.py) is a process that imported torch and the
preload as the job's user would have at a cold start; a rank forked from it
keeps everything that import left behind. So two jobs may share one template
(workers/template_pool.py) only when everything that can shape those imports
is the same. That is two things:

``TemplateKey``, known at the submit; two jobs share a template only if
their keys are equal:

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
* the preload: ``agent.warm_preload`` and the job's learned modules, in order;
* of the worker environment (the submitter's, plus what elasticd adds to
  every worker: PYTHONPATH with the worker site first, PYTHONUNBUFFERED,
  OMP_NUM_THREADS for several ranks), the variables that can shape an
  import without the template seeing it read them (``IMPORT_ENV_PREFIXES``,
  ``IMPORT_ENV_NAMES``, plus ``agent.template_key_env``): what the
  interpreter reads as it starts, before anything can be recorded (PYTHON*,
  PATH, HOME, LANG/LC_*, SETUPTOOLS_USE_DISTUTILS of setuptools' .pth file);
  what the dynamic loader and C libraries read through getenv() as they load
  (LD_*, MALLOC_*, GLIBC_TUNABLES, TZ, the thread pools of OpenMP, MKL,
  OpenBLAS, BLIS and oneDNN, CUDA, cuBLAS, cuDNN, NCCL, gloo, NVIDIA_*); and,
  though their reads are recorded too, the Python libraries preloaded most
  (TORCH*, PYTORCH_*, HF_*, TRANSFORMERS_*, XDG_*, TMPDIR), so that their
  most common variables never rest on the recording alone.

``EnvReads``, known once the template is ready: the names its imports read
through ``os.environ`` (``[]``, ``get``, ``in``, ``os.getenv``; warmstart
records them while the preload runs and lists them in its ready message).
A job fits a template with an equal key only if each of those names has the
same value, or is unset in both, in the job's environment and the one the
template imported under; if the imports walked the whole environment (or the
list is missing or malformed: the template runs the user's code), only a job
with the very same environment fits. Any other variable (a run name, a seed,
an output dir) may differ: no import saw it.

A template starts with the environment of the job that asked for it, less
``PER_JOB_ENV`` (``template_env``), so that its imports see what that job's
cold start would. A forked rank still gets exactly its own job's
environment, directory, argv and log (warmstart._become_rank).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pwd
import re
from dataclasses import dataclass

from . import group as workers

# Differ between two submits from the same shell; nothing imports them.
PER_JOB_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "ELASTICD_STORE_SECRET"})
# In the key by name or prefix (see the module docstring for why each).
IMPORT_ENV_PREFIXES = (
    "PYTHON", "LC_", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_",
    "BLIS_", "DNNL_", "ONEDNN_", "CUDA", "CUBLAS", "CUDNN_", "NCCL_", "GLOO_", "NVIDIA_",
    "TORCH", "PYTORCH_", "HF_", "TRANSFORMERS_", "XDG_")
IMPORT_ENV_NAMES = frozenset({"PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
                              "GLIBC_TUNABLES", "SETUPTOOLS_USE_DISTUTILS"})
# agent.template_key_env: a variable's name, or a prefix and "*".
KEY_ENV_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\*?\Z")
# The ready message's list of names read (workers/warmstart.py sends it): bounds.
READ_NAMES_MAX = 2048
_READ_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}\Z")
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


def template_env(spec: workers.GroupSpec) -> dict[str, str]:
    """The environment a template for ``spec``'s job imports under: the job's worker
    environment (what its cold start's imports would see) less ``PER_JOB_ENV``."""
    return {k: v for k, v in workers.base_env(spec).items() if k not in PER_JOB_ENV}


def import_env(env: dict, key_env=()) -> tuple[tuple[str, str], ...]:
    """The variables of ``env`` in a key: the listed ones and ``key_env``'s (names, or
    prefixes ending in "*"), sorted."""
    names = IMPORT_ENV_NAMES.union(e for e in key_env if not e.endswith("*"))
    prefixes = IMPORT_ENV_PREFIXES + tuple(e[:-1] for e in key_env if e.endswith("*"))
    return tuple(sorted((k, v) for k, v in env.items()
                        if k in names or k.startswith(prefixes)))


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
    env: tuple[tuple[str, str], ...]   # import_env: sorted (name, value)
    preload: tuple[str, ...]           # agent.warm_preload
    learned: tuple[str, ...]           # the job's learned preload (workers/preload.py)

    @classmethod
    def of(cls, spec: workers.GroupSpec, warm_preload, learned=(),
           key_env=()) -> "TemplateKey | None":
        """The key of ``spec``'s job, or None when its command is not one a template runs
        (not ``python [-u|-B] SCRIPT`` / ``python [-u|-B] -m MODULE``). ``key_env``:
        ``agent.template_key_env``."""
        args = workers.warm_args(spec.command)
        if args is None:
            return None
        flags, entry = entry_part(args)
        return cls(uid=spec.uid, gid=spec.gid, groups=_groups(spec.uid, spec.gid),
                   interpreter=spec.command[0], flags=flags, entry=entry, cwd=spec.cwd,
                   cpus=tuple(sorted(spec.cpus)), env=import_env(template_env(spec), key_env),
                   preload=tuple(warm_preload), learned=tuple(learned))

    @property
    def digest(self) -> str:
        """A short name for logs, events and ``elasticctl nodes`` (which every user may
        run): keyed with this daemon's own random salt, so it tells equal keys apart
        and nothing of the environment behind them, not even to a guess."""
        return hmac.new(_SALT, repr(self).encode(), hashlib.sha256).hexdigest()[:10]


@dataclass(frozen=True)
class EnvReads:
    """What a template's imports read of its environment (see the module docstring):
    ``names`` through ``os.environ``, or, when ``whole``, maybe all of it."""
    names: frozenset = frozenset()
    whole: bool = True

    @classmethod
    def of_message(cls, value) -> "EnvReads":
        """From the ``env_read`` of a template's ready message, which the user's code in
        it could have written: a list of at most READ_NAMES_MAX variable names; "*",
        or anything else, reads as the whole environment."""
        if not isinstance(value, list) or len(value) > READ_NAMES_MAX \
                or not all(isinstance(n, str) and _READ_NAME.match(n) for n in value):
            return cls()
        return cls(frozenset(value), False)

    def fit(self, made_with: dict, job_env: dict) -> bool:
        """Whether imports under ``job_env`` (a job's ``template_env``) would have read
        what they read under ``made_with`` (the template's)."""
        if self.whole:
            return made_with == job_env
        return all(made_with.get(n) == job_env.get(n) for n in self.names)

    def describe(self) -> str:
        return "the whole environment" if self.whole else f"{len(self.names)} variable(s)"


def key_to_record(key: TemplateKey, env: dict) -> dict:
    """A template's key and the environment it started with, as JSON-able data
    (workers/template_saved.py keeps the recent ones' over a daemon restart, in the
    state dir: 0600, root's, like the job records)."""
    return {"uid": key.uid, "gid": key.gid, "groups": list(key.groups),
            "interpreter": key.interpreter, "flags": list(key.flags), "entry": key.entry,
            "cwd": key.cwd, "cpus": list(key.cpus), "env": sorted(map(list, env.items())),
            "preload": list(key.preload), "learned": list(key.learned)}


def key_from_record(rec, key_env=()) -> tuple[TemplateKey, dict]:
    """``key_to_record``'s inverse: (key, environment), the key's variables those of
    ``key_env`` now (``agent.template_key_env``); ValueError naming what is wrong with
    a record that is not one (the file is root's, but a half-written one is not
    trusted either)."""
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
    env = dict(env)
    flags = strs("flags")
    if any(f not in _FLAGS for f in flags):
        raise ValueError("flags: only -u and -B")
    key = TemplateKey(uid=rec["uid"], gid=rec["gid"], groups=ints("groups"),
                      interpreter=rec["interpreter"], flags=flags, entry=rec["entry"],
                      cwd=rec["cwd"], cpus=ints("cpus"), env=import_env(env, key_env),
                      preload=strs("preload"), learned=strs("learned"))
    return key, env
