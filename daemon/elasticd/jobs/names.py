"""Which job a name stands for, for one caller: names are per user (no I/O).

A job's name is unique among its user's live jobs (``JobRegistry.create``);
another user may have a live job of the same name. ``stands_for`` picks, among
the jobs of a name that the caller may see (their own; root: everyone's),
the live one, else the only finished one; several are ``AmbiguousName``, whose
message lists them (id, state, when: newest first) and says to give the id.
Another user's jobs are never among them, so a name tells nothing of them.
"""
from __future__ import annotations

import time


class AmbiguousName(ValueError):
    """A name that stands for several jobs the caller may see. ``ids``: theirs, newest
    first; ``live``: whether they are live ones (only root sees several of those)."""

    MAX_LISTED = 10

    def __init__(self, name: str, jobs: list, live: bool):
        jobs = sorted(jobs, key=lambda j: j.created_at, reverse=True)
        owners = {j.uid for j in jobs}

        def one(j) -> str:
            who = f"{j.user or j.uid}'s " if len(owners) > 1 else ""
            ended = "" if j.live else f", ended {_when(j.finished_at or j.state_since)}"
            return f"{who}{j.id} {j.state.value} (submitted {_when(j.created_at)}{ended})"
        listed = "; ".join(one(j) for j in jobs[:self.MAX_LISTED])
        more = f"; and {len(jobs) - self.MAX_LISTED} more" if len(jobs) > self.MAX_LISTED else ""
        kind = "live jobs" if live else "finished jobs (none live)"
        super().__init__(f"the name {name!r} stands for {len(jobs)} {kind}: {listed}{more}; "
                         "give the job id")
        self.ids = [j.id for j in jobs]
        self.live = live


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def stands_for(name: str, jobs, may_see):
    """The job of ``jobs`` (records with ``name``, ``uid``, ``live``) that ``name``
    stands for, among those whose uid ``may_see(uid)`` allows, or None;
    AmbiguousName when it stands for several."""
    named = [j for j in jobs if j.name == name and may_see(j.uid)]
    live = [j for j in named if j.live]
    if len(live) > 1 or (not live and len(named) > 1):
        raise AmbiguousName(name, live or named, bool(live))
    return (live or named or [None])[0]
