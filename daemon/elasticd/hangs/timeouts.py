"""Hang timeouts learned from each job's own rhythm, per phase (no I/O but the file helpers).

A rank's beats (worker_site/elasticd_heartbeat.py, the worker contract) say
which phase it is in: ``train`` (optimizer steps, ``heartbeat()``),
``forward`` (forward passes with no step between them: evaluation),
``checkpoint`` (inside torch.save/load or torch.distributed.checkpoint),
``barrier`` (inside torch.distributed.barrier: e.g. waiting on other nodes
for a checkpoint that rank 0 writes) or ``section:<name>`` (inside
``elasticd_section(name)``). The silence between
two beats of a rank is a *gap* of the phase the rank was in during it; the
job keeps, per phase, how many gaps it saw and the longest (across its ranks
and its attempts: the agent carries them across restarts and the job record
across daemon restarts). A gap only counts once the rank made its first step
in its attempt: start-up, compiling and loading have their own allowance.

The rule (``phase_limit``), for a rank that made its first step:

* kill after ``max(floor, factor x longest gap of the phase)`` seconds of
  silence, and dump its stacks at ``dump_fraction`` of that, once the phase
  is *known*: a steady phase (train, forward) after ``warmup`` gaps, a
  bracketed phase (checkpoint, a section) after one (its whole run is
  usually one gap);
* the fixed ``agent.hang_soft_timeout`` / ``agent.hang_hard_timeout``
  while the phase is not known yet, and always as the upper bound. So the
  first long checkpoint or section of a job is allowed the fixed bound, and
  each later one ``factor`` times the longest before it.

A gap only ever grows the learned value, and only a gap that ended in
progress is learned: not one ended by the rank exiting or waiting (an
in-process restart after a fault: the rank then has the first-step
allowance again), nor one during which a rank of the job was killed for a
hang (its peers waited for it), nor, for a steady phase, one during which a
peer was in a checkpoint or section (the rank waited for that peer in a
collective: such a rank gets that phase's limits too, until it beats
again). A rank killed for a silence never reports it as a gap. The same
function serves the daemon (hangs/detector.py) and the in-process wrapper, which
reads the learned limits the daemon writes for it (``write_limits_file`` /
``read_limits_file``).
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass, replace

from ..values import BadValue, decode
from ..workers import env as envnames

STEADY_PHASES = ("train", "forward")
LIMITS_FILE_ENV = envnames.LIMITS_FILE
LIMITS_FILE_MAX = 64 * 1024
MAX_PHASES = 64     # per job: beyond that, new section names are not learned (bounded state)


def bracketed(phase: str) -> bool:
    """A phase with an entry and an exit (a checkpoint, a section, a barrier): usually
    one long gap, known after one. (``wait``, between in-process restarts, is not
    learned: a rank that waited has the first-step allowance again until its next step.)"""
    return phase in ("checkpoint", "barrier") or phase.startswith("section:")


def others_wait_for(phase: str) -> bool:
    """While a rank is in this phase, its peers wait for it in their next collective
    (a checkpoint or a section it runs alone); not a barrier, where it waits for them."""
    return phase == "checkpoint" or phase.startswith("section:")


@dataclass(frozen=True)
class HangLimits:
    """Seconds of silence before a rank's stacks are dumped (soft) and it is killed (hard);
    ``first_step``: the allowance before its first step (and while it exits)."""
    soft: float
    hard: float
    first_step: float

    @classmethod
    def from_settings(cls, agent_settings) -> "HangLimits":
        a = agent_settings
        return cls(a.hang_soft_timeout, a.hang_hard_timeout, a.first_step_timeout)


@dataclass(frozen=True)
class LearnSettings:
    floor: float
    factor: float
    warmup: int
    dump_fraction: float
    fixed: HangLimits

    @classmethod
    def from_settings(cls, agent_settings) -> "LearnSettings":
        a = agent_settings
        return cls(a.hang_learn_floor, a.hang_learn_factor, a.hang_learn_warmup,
                   a.hang_learn_dump_fraction, HangLimits.from_settings(a))

    def fixed_only(self) -> "LearnSettings":
        """Settings under which no phase counts as learned: ``phase_limit`` gives
        the fixed bounds (a floor at the fixed hard timeout)."""
        return replace(self, floor=self.fixed.hard)


@dataclass(frozen=True)
class PhaseRecord:
    """What the job saw of one phase: gaps counted and the longest, in seconds."""
    phase: str
    gaps: int = 0
    longest: float = 0.0

    def to_dict(self) -> dict:
        return {"phase": self.phase, "gaps": self.gaps, "longest": round(self.longest, 3)}

    @classmethod
    def from_dict(cls, data) -> "PhaseRecord | None":
        """From a job record (the daemon's own file): None when malformed."""
        try:
            phase, gaps, longest = str(data["phase"]), int(data["gaps"]), float(data["longest"])
        except (KeyError, TypeError, ValueError):
            return None
        if not phase or len(phase) > 64 or gaps < 0 or not 0 <= longest < 1e7:
            return None
        return cls(phase, gaps, longest)


def observe(rec: PhaseRecord | None, phase: str, gap: float) -> PhaseRecord:
    """The phase's record after one more gap of ``gap`` seconds."""
    if rec is None:
        return PhaseRecord(phase, 1, max(0.0, gap))
    return PhaseRecord(phase, rec.gaps + 1, max(rec.longest, gap))


@dataclass(frozen=True)
class PhaseLimit:
    """The limits a rank in ``phase`` gets, and where they come from."""
    phase: str
    soft: float
    hard: float
    learned: bool        # False: the fixed settings (phase not known yet, or learned above them)
    longest: float = 0.0
    gaps: int = 0

    def source(self, s: LearnSettings) -> str:
        """Which setting or rule set ``hard``: for events and ``elasticctl status``."""
        if not self.learned:
            return f"agent.hang_hard_timeout {self.hard:g}s"
        if self.hard <= s.floor:
            return f"learned {self.phase}: agent.hang_learn_floor {self.hard:g}s"
        return (f"learned {self.phase}: {s.factor:g} x longest gap {self.longest:.1f}s "
                f"= {self.hard:.1f}s")

    def to_dict(self) -> dict:
        return {"phase": self.phase, "soft": round(self.soft, 3), "hard": round(self.hard, 3),
                "learned": self.learned, "longest": round(self.longest, 3), "gaps": self.gaps}


def phase_limit(phase: str, rec: PhaseRecord | None, s: LearnSettings) -> PhaseLimit:
    """The limits for a rank in ``phase`` after its first step (see the module's rule)."""
    gaps = rec.gaps if rec else 0
    longest = rec.longest if rec else 0.0
    known = gaps >= (1 if bracketed(phase) else s.warmup)
    learned = max(s.floor, s.factor * longest)
    if not known or learned >= s.fixed.hard:
        return PhaseLimit(phase, s.fixed.soft, s.fixed.hard, False, longest, gaps)
    return PhaseLimit(phase, min(s.fixed.soft, learned * s.dump_fraction), learned, True,
                      longest, gaps)


def limits_table(records: dict[str, PhaseRecord], s: LearnSettings) -> list[PhaseLimit]:
    """Every phase seen, with its limits: what ``elasticctl status`` shows."""
    return [phase_limit(p, records[p], s) for p in sorted(records)]


# ---------------------------------------------------------------- the wrapper's file

def read_capped(path: str, cap: int) -> bytes | None:
    """Up to ``cap`` bytes of a regular file, never following a link, never blocking
    on a FIFO; None when it is missing or not a regular file. For files a worker
    (or its user) can touch."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, cap)
    except OSError:
        return None
    finally:
        os.close(fd)


def encode_limits(table: list[PhaseLimit]) -> bytes:
    """The limits file's content: the learned phases only (the others use the fixed ones)."""
    return json.dumps({"version": 1, "phases": {
        p.phase: [round(p.soft, 3), round(p.hard, 3)] for p in table if p.learned}}).encode()


def decode_limits(data: bytes | None) -> dict[str, tuple[float, float]]:
    """{phase: (soft, hard)} from the file; {} when missing or malformed."""
    if not data:
        return {}
    try:
        doc = decode(data, max_bytes=LIMITS_FILE_MAX)
    except BadValue:
        return {}
    phases = doc.get("phases") if doc.get("version") == 1 else None
    out: dict[str, tuple[float, float]] = {}
    for phase, pair in list(phases.items())[:MAX_PHASES] if isinstance(phases, dict) else ():
        if isinstance(pair, list) and len(pair) == 2 \
                and all(type(v) in (int, float) for v in pair) and 0 < pair[0] < pair[1] < 1e7:
            out[phase] = (float(pair[0]), float(pair[1]))
    return out


def write_limits_file(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` (0644). Its directory is the job user's: the file is
    built under a fresh random name (O_EXCL, no link followed), then renamed over."""
    tmp = f"{path}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_limits_file(path: str) -> dict[str, tuple[float, float]]:
    return decode_limits(read_capped(path, LIMITS_FILE_MAX)) if path else {}
