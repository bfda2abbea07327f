"""The node's recent worker templates, kept in the state dir over a daemon restart.

workers/template_pool.py writes here, each time the set changes, what every
template it knows of was made of: those idle in the pool and those a job
uses now (``SavedTemplate``: key, environment, command, log, when last used,
resident memory). The file survives a clean stop and a crash alike, so the
next start of the daemon starts the recent ones again before any submit
(``agent.template_restore``). It holds environments: 0600, root's, in the
state dir, like the job records; written whole to a temporary file and
renamed over the old one, so a reader sees one version or the other; removed
when there is nothing to keep. A file that is not what this daemon writes
(a link, a FIFO, garbage, a record that does not check) is skipped and said.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from . import files, group as workers
from .template_key import TemplateKey, entry_part, key_from_record, key_to_record
from .. import statedir
from .. import values

SAVED_NAME = "idle-templates.json"
VERSION = 2
MAX_BYTES = 16 << 20
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
ORIGINS = ("job", "restored", "ahead")  # how it came to be: see template_pool.py


@dataclass(frozen=True)
class SavedTemplate:
    key: TemplateKey
    env: dict            # what it imports under (template_key.template_env)
    boot: tuple          # what follows the interpreter: flags and entry
    log_job: str         # whose logs/JOB/template.log has its output
    origin: str          # ORIGINS
    used_at: float       # wall clock: its last job ended (or it was started ahead) then
    in_use: bool         # a job had it when this was written
    rss_bytes: int       # resident memory when this was written (0: not known)


def of(template, origin: str, used_at: float, in_use: bool) -> SavedTemplate | None:
    """What ``template`` (workers/template.WorkerTemplate) was made of, or None when it
    was never started."""
    t = template
    if t.key is None or not t.boot_args:
        return None
    return SavedTemplate(t.key, dict(t.env), tuple(t.boot_args), t.log_job, origin, used_at,
                         in_use, t.rss_bytes())


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, SAVED_NAME)


def _to_record(t: SavedTemplate) -> dict:
    return {"key": key_to_record(t.key, t.env), "boot": list(t.boot), "log_job": t.log_job,
            "origin": t.origin, "used_at": t.used_at, "in_use": t.in_use,
            "rss_bytes": t.rss_bytes}


def _from_record(rec, key_env) -> SavedTemplate:
    """One record, checked; ValueError naming what is wrong."""
    if not isinstance(rec, dict):
        raise ValueError("not an object")
    key, env = key_from_record(rec.get("key"), key_env)
    boot, job = rec.get("boot"), rec.get("log_job")
    if not isinstance(boot, list) or not all(isinstance(a, str) for a in boot) \
            or workers.warm_args([key.interpreter, *boot]) is None \
            or entry_part(boot) != (key.flags, key.entry):
        raise ValueError("its command is not one a template runs")
    if not isinstance(job, str) or not _JOB_ID.match(job):
        raise ValueError("not a job id")
    if rec.get("origin") not in ORIGINS:
        raise ValueError("origin: not one of " + ", ".join(ORIGINS))
    used, rss = rec.get("used_at"), rec.get("rss_bytes")
    if type(used) not in (int, float) or not 0 <= used < float("inf"):
        raise ValueError("used_at: not a time")
    if type(rss) is not int or rss < 0 or type(rec.get("in_use")) is not bool:
        raise ValueError("rss_bytes, in_use: not a size and a flag")
    return SavedTemplate(key, env, tuple(boot), job, rec["origin"], float(used),
                         rec["in_use"], rss)


def write(state_dir: str, saved: list[SavedTemplate]) -> None:
    """Replace the file with ``saved`` (remove it when empty); OSError if it cannot."""
    path = path_in(state_dir)
    if not saved:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    tmp = path + ".tmp"
    fd = statedir.open_private(tmp, os.O_WRONLY | os.O_TRUNC)
    with open(fd, "w") as fh:
        json.dump({"version": VERSION, "templates": [_to_record(t) for t in saved]}, fh)
    os.replace(tmp, path)


def read(state_dir: str, key_env=()) -> tuple[list[SavedTemplate], list[str]]:
    """(the records that check, what was wrong: one line each); ([], []) when there is
    no file. The keys' variables are ``key_env``'s now (``agent.template_key_env``)."""
    path = path_in(state_dir)
    got = files.read(path, os.geteuid(), MAX_BYTES)  # never a link, FIFO or giant
    if got.problem is files.Problem.MISSING:
        return [], []
    if not got.ok:
        return [], [f"{path} is {got.problem.value}"]
    try:
        doc = values.decode(got.data, max_bytes=MAX_BYTES)
    except values.BadValue as exc:
        return [], [f"{path} is not what this daemon wrote: {exc}"]
    records = doc.get("templates")
    if doc.get("version") != VERSION or not isinstance(records, list):
        return [], [f"{path} is not what this daemon wrote (version {VERSION})"]
    out, problems = [], []
    for rec in records:
        try:
            out.append(_from_record(rec, key_env))
        except ValueError as exc:
            problems.append(f"a saved worker template skipped: {exc}")
    return out, problems
