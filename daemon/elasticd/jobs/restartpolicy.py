"""How long to wait before a process restart, and how restarts are budgeted.

Backoff is for crash loops, not for a job that trains well and is hit again
later. After each failed attempt the agent asks ``plan_restart()`` (pure,
no I/O) with what the attempt did (``AttemptProgress``: progress beats the
daemon saw, seconds it ran) and how many attempts in a row before it made no
progress; it returns a ``RestartPlan``:

* ``RestartRule.AT_ONCE``: the attempt made progress (at least
  ``agent.progress_min_beats`` beats, or it ran ``agent.progress_min_runtime``
  seconds: scripts that never beat); restart now, the backoff starts over.
* ``RestartRule.BACKOFF``: no progress; the k-th such attempt in a row waits
  ``restart_delay(k)``: ``restart_backoff_initial``, then + ``restart_backoff_step``
  doubling (0, 0.5, 1, 2, ... s) up to ``restart_backoff_max``.

``CrashLoop`` ends a job whose attempts keep failing the same way before any
progress. ``RestartPlan.sentence()`` is the one place its words are built (the restart
event, `elasticctl status`); ``to_dict``/``from_dict`` the one place it is
serialised into the job record.

The budget over a window (``RestartWindow``) is counted cluster-wide in the
round state (rendezvous/protocol.py ``reopen``): the times of the restarts
within ``agent.restart_window`` seconds ride along with the restart count.
``plan_forgotten`` decides, with the same budgets, whether a job the store
forgot (a standalone daemon restarted) starts again (node/resume.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class RestartRule(enum.Enum):
    AT_ONCE = "at_once"    # the failed attempt made progress: no wait, backoff reset
    BACKOFF = "backoff"    # no progress: wait, longer with each such attempt in a row


@dataclass(frozen=True)
class BackoffSettings:
    initial: float          # wait before the first restart without progress
    step: float             # added before each further one, doubling
    maximum: float          # longest wait
    min_beats: int          # beats that show an attempt made progress
    min_runtime: float      # seconds of running that count as progress (scripts that never beat)

    @classmethod
    def from_settings(cls, a) -> "BackoffSettings":
        return cls(a.restart_backoff_initial, a.restart_backoff_step, a.restart_backoff_max,
                   a.progress_min_beats, a.progress_min_runtime)


@dataclass(frozen=True)
class AttemptProgress:
    """What one process attempt did before it failed, as the daemon saw it."""
    beats: int          # progress beats of its ranks on this node (optimizer steps)
    ran_for: float      # seconds from its workers' start to the fault


@dataclass(frozen=True)
class RestartPlan:
    rule: RestartRule
    delay: float        # seconds to wait before rejoining
    streak: int         # attempts in a row without progress, this one included (0: progress)
    beats: int
    ran_for: float

    def sentence(self) -> str:
        if self.rule is RestartRule.AT_ONCE:
            return (f"restart at once: {self.beats} progress beats in {self.ran_for:.0f}s "
                    "since the last restart")
        attempts = "attempt" if self.streak == 1 else f"{self.streak} attempts"
        what = f"backing off {self.delay:g}s" if self.delay else "restart at once"
        return f"{what}: no progress in the last {attempts}"

    def to_dict(self) -> dict:
        return {"rule": self.rule.value, "delay": self.delay, "streak": self.streak,
                "beats": self.beats, "ran_for": round(self.ran_for, 3)}

    @classmethod
    def from_dict(cls, data: dict) -> "RestartPlan":
        return cls(RestartRule(data["rule"]), float(data["delay"]), int(data["streak"]),
                   int(data["beats"]), float(data["ran_for"]))


def made_progress(progress: AttemptProgress, s: BackoffSettings) -> bool:
    return progress.beats >= s.min_beats or progress.ran_for >= s.min_runtime


def restart_delay(number: int, initial: float, step: float, maximum: float) -> float:
    """Wait before the ``number``-th (1-based) restart in a row: initial, then +step doubling."""
    if number <= 1:
        return min(initial, maximum)
    # The exponent is capped: past 2**60 the maximum has long been reached.
    return min(maximum, initial + step * 2.0 ** min(number - 2, 60))


def plan_restart(progress: AttemptProgress, streak_before: int,
                 s: BackoffSettings) -> RestartPlan:
    """The wait before restarting after ``progress``, ``streak_before`` attempts
    without progress having come before it (no I/O)."""
    if made_progress(progress, s):
        return RestartPlan(RestartRule.AT_ONCE, 0.0, 0, progress.beats, progress.ran_for)
    streak = streak_before + 1
    return RestartPlan(RestartRule.BACKOFF, restart_delay(streak, s.initial, s.step, s.maximum),
                       streak, progress.beats, progress.ran_for)


def spares_due(now: float, started: float, first_beat: float | None, started_warm: bool,
               first_start_delay: float, after_beat_delay: float) -> bool:
    """Whether to refill an attempt's spares now (monotonic times; no I/O).

    Spares import torch: started while the attempt's workers start up, they
    slow that start. Workers that started cold import torch themselves, so
    their spares wait ``agent.warm_spare_delay`` after the start. Workers that
    took spares start without that import; their spares come back
    ``agent.warm_spare_restart_delay`` after the attempt's first progress beat
    (its start-up done), so the next fault finds the warm path ready, however
    soon it comes; an attempt that never beats waits ``warm_spare_delay``."""
    if started_warm and first_beat is not None and now >= first_beat + after_beat_delay:
        return True
    return now >= started + first_start_delay


# ---------------------------------------------------------------- crash loops

@dataclass
class CrashLoop:
    """Attempts in a row that failed the same way without progress (one agent's).

    A job that fails before it does anything, the same way each time (a
    missing module, a bad path, a wrong flag), will not get better by being
    restarted: after ``limit`` such attempts (``agent.crash_loop_limit``; 0:
    never) the job fails at once, with that failure as its reason, instead of
    spending its restart budgets and their backoff. ``signature`` is what
    makes two failures the same (agent/failures.signature); an attempt that
    made progress, or failed another way, starts the count over. No I/O."""
    limit: int
    signature: tuple = ()
    count: int = 0

    def note(self, signature: tuple, progressed: bool) -> bool:
        """Count one failed attempt; True when it completes a crash loop."""
        if progressed or not self.limit:
            self.signature, self.count = (), 0
            return False
        if signature == self.signature:
            self.count += 1
        else:
            self.signature, self.count = signature, 1
        return self.count >= self.limit

    def saved(self) -> list:
        """What the job record keeps of the count (JobRecord.crash_loop)."""
        return [self.count, *self.signature] if self.count else []

    @classmethod
    def resumed(cls, limit: int, saved) -> "CrashLoop":
        """The count a job record kept (``saved()``); anything else there (a record
        an older release wrote, or cut short) starts the count over."""
        if isinstance(saved, list) and len(saved) == 5 and isinstance(saved[0], int) \
                and not isinstance(saved[0], bool) and 0 < saved[0] < 1 << 20:
            code, sig, kind, cause = saved[1:]
            if all(v is None or (isinstance(v, int) and not isinstance(v, bool))
                   for v in (code, sig)) and isinstance(kind, str) and isinstance(cause, str):
                return cls(limit, (code, sig, kind, cause), saved[0])
        return cls(limit)

    def sentence(self) -> str:
        return (f"crash loop: it failed the same way in {self.count} attempts in a row "
                f"without progress (agent.crash_loop_limit {self.limit}); not restarting")


# ---------------------------------------------------------------- the window budget

@dataclass(frozen=True)
class RestartWindow:
    """At most ``limit`` counted restarts within any ``seconds`` (limit -1: no such budget)."""
    limit: int
    seconds: float

    @property
    def on(self) -> bool:
        return self.limit >= 0

    def recent(self, times, now: float) -> tuple[float, ...]:
        """The restart times still inside the window, oldest first, bounded in number."""
        if not self.on:
            return ()
        kept = sorted(t for t in times if now - self.seconds < t <= now + self.seconds)
        return tuple(kept[-(self.limit + 1):])

    def admit(self, times, now: float) -> tuple[bool, tuple[float, ...]]:
        """Whether one more restart at ``now`` fits; the window's times with it."""
        if not self.on:
            return True, ()
        after = self.recent(tuple(times) + (now,), now)
        return len(after) <= self.limit, after

    def describe(self, used: int) -> str:
        """``2 in the last hour of 10 allowed``."""
        if not self.on:
            return "no budget over a window"
        return f"{used} in the last {window_text(self.seconds)} of {self.limit} allowed"


def window_text(seconds: float) -> str:
    """``hour``, ``2 hours``, ``10 min``, ``30 s``: a window in words."""
    for unit, name, plural in ((86400, "day", "days"), (3600, "hour", "hours"),
                               (60, "min", "min")):
        if seconds >= unit and seconds % unit == 0:
            n = int(seconds // unit)
            return name if n == 1 and name != "min" else f"{n} {plural}"
    return f"{seconds:g} s"


# ---------------------------------------------------------------- a forgotten job

@dataclass(frozen=True)
class ForgottenPlan:
    """Whether a job the store forgot starts again, and as which restart."""
    fits: bool                  # False: no restarts left; ``reason`` says which budget
    counted: bool               # it had started: starting again is a restart
    restarts: int               # the job's restart count once started again
    times: tuple[float, ...]    # the window's restart times once started again
    reason: str = ""


def plan_forgotten(started: bool, restarts: int, max_restarts: int, window: RestartWindow,
                   restart_times, now: float) -> ForgottenPlan:
    """The plan for a job that had ``started`` (it left PENDING) or not, with
    ``restarts`` used of ``max_restarts`` (-1: no limit) and ``restart_times``
    inside ``window`` so far (no I/O)."""
    if not started:
        return ForgottenPlan(True, False, restarts, tuple(restart_times))
    after = restarts + 1
    fits, times = window.admit(restart_times, now)
    if 0 <= max_restarts < after:
        return ForgottenPlan(False, True, after, times, "daemon restarted and no restarts "
                             f"are left ({restarts} of {max_restarts} used)")
    if not fits:
        return ForgottenPlan(False, True, after, times, "daemon restarted and no restarts "
                             f"are left in the window ({window.describe(len(times) - 1)})")
    return ForgottenPlan(True, True, after, times)
