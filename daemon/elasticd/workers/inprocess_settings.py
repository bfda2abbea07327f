"""The in-process restart settings: one definition for the daemon's ``[inprocess]``
config section (config/) and the worker-side wrapper (inprocess/wrapper.py), part of
the workers' contract as their environment carries them.

``InprocessSettings`` holds the 8 fields, their defaults, help and bounds (the
field metadata of settingfield.py, which config/ documents and checks); the daemon
sends each field to the workers as ``ELASTICD_INPROCESS_<NAME>``
(workers/env.py). ``problems`` is the wrapper's rule check and ``from_env``
its parsing of those variables. Stdlib only, no torch: config/ imports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..settingfield import setting as _setting
from . import env as envnames

ENV_PREFIX = envnames.INPROCESS_PREFIX


@dataclass(frozen=True)
class SettingProblem:
    """One broken rule: the field it is reported on and what is wrong, for a person."""
    field: str
    message: str


@dataclass(frozen=True)
class InprocessSettings:
    """The first rung of the restart ladder (elasticd.inprocess.Wrapper, ``--inprocess`` jobs).

    Each field reaches the workers as ELASTICD_INPROCESS_<NAME> (a job's own
    ``--env`` wins), where the wrapper reads it; the daemon uses the budget
    to decide whether a dead rank is replaced in place or the group restarts.
    """
    soft_timeout: float = _setting(60.0, "seconds without a progress beat before a rank reports "
                                         "itself stalled and every rank restarts in-process",
                                   min=0, exclusive_min=True, max=86400)
    hard_timeout: float = _setting(90.0, "seconds a collective may block before it fails (the "
                                         "process group's timeout); a rank not back in Python "
                                         "hard - soft seconds after its function was stopped "
                                         "ends itself (stacks in its log) and is replaced",
                                   min=0, exclusive_min=True, max=86400)
    barrier_timeout: float = _setting(240.0, "seconds the ranks wait for each other (a replaced "
                                             "rank included) at the start of an iteration "
                                             "before falling back to a process restart",
                                      min=0, exclusive_min=True, max=86400)
    monitor_interval: float = _setting(0.1, "seconds between a rank's looks for a fault "
                                            "reported by another rank",
                                       min=0.005, max=60)
    max_restarts: int = _setting(8, "in-process restarts (iterations) per process attempt, "
                                    "replaced ranks included, before a process restart",
                                 min=0, max=1_000_000)
    repeat_limit: int = _setting(3, "faults within repeat_window that make in-process restart "
                                    "give up for a process restart (a fault that keeps "
                                    "coming back may be state a fresh process clears)",
                                 min=1, max=1_000_000)
    repeat_window: float = _setting(30.0, "seconds over which repeat_limit faults are counted",
                                    min=0, max=86400)
    backoff: float = _setting(0.0, "seconds every rank waits before re-entering the training "
                                   "function after a fault", min=0, max=3600)


def problems(s: InprocessSettings) -> list[SettingProblem]:
    """What breaks the wrapper's rules (empty: none). config/rules.py reports these under
    ``inprocess.<field>``, the wrapper under the field's name."""
    bad = []
    if not 0 < s.soft_timeout < s.hard_timeout < s.barrier_timeout:
        bad.append(SettingProblem("soft_timeout", "need 0 < soft_timeout < hard_timeout < "
                                  f"barrier_timeout, got {s.soft_timeout:g} / "
                                  f"{s.hard_timeout:g} / {s.barrier_timeout:g}"))
    if not 0 < s.monitor_interval < s.soft_timeout:
        bad.append(SettingProblem("monitor_interval", "must be > 0 and below soft_timeout, "
                                  f"got {s.monitor_interval:g} (soft_timeout "
                                  f"{s.soft_timeout:g})"))
    if s.max_restarts < 0:
        bad.append(SettingProblem("max_restarts", f"must be >= 0, got {s.max_restarts}"))
    if s.repeat_limit < 1:
        bad.append(SettingProblem("repeat_limit", f"must be >= 1, got {s.repeat_limit}"))
    for name in ("repeat_window", "backoff"):
        if getattr(s, name) < 0:
            bad.append(SettingProblem(name, f"must be >= 0, got {getattr(s, name):g}"))
    return bad


def from_env(cls, env: Mapping[str, str], given: Mapping[str, Any]):
    """``cls`` from given values, else ``ELASTICD_INPROCESS_<NAME>`` from ``env``, else
    defaults."""
    values = {}
    for name, f in cls.__dataclass_fields__.items():
        if given.get(name) is not None:
            values[name] = given[name]
            continue
        raw = env.get(ENV_PREFIX + name.upper())
        if raw:
            try:
                values[name] = int(raw) if f.type in ("int", int) else float(raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{name.upper()}: not a number: {raw!r}") \
                    from None
    return cls(**values)
