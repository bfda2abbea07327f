"""Retention on this node: the loop that retires what finished jobs left behind.

``Retirer`` owns one thread (stop event, bounded wait) that runs a pass at start,
every ``retention.interval`` seconds, and whenever a job ends here (a terminal
event in the registry, or an agent exiting). A pass:

1. removes the run dirs (``<socket dir>/jobs/<job>``, written by the job's user)
   and the snapshot dirs (``<snapshot.root>/<job>``, the job's in-memory snapshots:
   workers/snapshot_dirs.py; also those a daemon killed before it could left) of
   every job that is not live here, and the log dirs of jobs with no record. In the
   snapshot dir only real dirs named like a job id are looked at;
2. gives every job that ended since the last pass its last log cap
   (``LogKeeper.cap_finished``: what a rank wrote between two size checks is cut
   to ``agent.log_max_bytes`` too), then measures its logs once (they no longer
   grow);
3. asks ``retention.decide`` what to retire, with the state dir's free space, and
   applies it: logs only (the record notes it, with an event; ``elasticctl logs``
   then says they were retired), or whole (logs; this node's events in etcd;
   record and events here, in one transaction). A cluster job's own keys in etcd
   stay (the cluster's record of how it ended, which a node back after a long
   time reads); a standalone daemon's in-memory copy of them goes too;
4. retires, by age and count alike, the events of jobs known here only by them
   (other nodes' jobs mirrored here, refused specs).

Nothing a live job uses is touched: only jobs in a terminal state whose agent has
exited count as finished. Removals never follow a link (``statedir.remove_tree``):
a user's run dir may hold links planted to make root delete something else.
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from typing import Callable

from .. import statedir
from ..logsetup import ctx
from ..store import StoreError
from .jobevent import JobEvent
from .spec import JOB_KEY
from .retention import Budget, Finished, Plan, Retire, Scope, decide
from .states import TERMINAL_STATES

log = logging.getLogger("elasticd.jobs.retirer")

_TERMINAL = frozenset(s.value for s in TERMINAL_STATES)


class Retirer:
    """Owns the retention thread; ``active()`` names the jobs whose agents run here,
    ``forget(job_id)`` deletes what the store keeps of a job retired whole here
    (this node's events in etcd; a standalone daemon's job keys), StoreError while
    the store does not answer (None: nothing)."""

    def __init__(self, cfg, registry, keeper, active: Callable[[], list[str]],
                 forget: Callable[[str], None] | None = None, clock=time.time):
        self._node = cfg.daemon.node_id
        self._state_dir = cfg.daemon.state_dir
        self._logs = cfg.logs_dir
        self._runs = cfg.jobs_run_dir
        self._snapshots = cfg.snapshot.root  # "": none (settings not resolved by load)
        self._min_free = cfg.limits.state_min_free_bytes
        self._budget = Budget.from_settings(cfg.retention)
        self._interval = cfg.retention.interval
        self._registry = registry
        self._keeper = keeper
        self._active = active
        self._forget = forget
        self._clock = clock
        self._sizes: dict[str, int] = {}      # finished job -> bytes of its logs, measured
        self._unshared: set[str] = set()      # retired jobs the store still keeps
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.retired_jobs = 0
        self.retired_logs = 0
        self.retired_log_bytes = 0
        self.removed_run_dirs = 0
        self.removed_snapshot_dirs = 0
        self.errors = 0
        self.last_pass_seconds = 0.0

    # -- life cycle ------------------------------------------------------------
    def start(self) -> None:
        self._registry.subscribe(self.on_event)
        self._thread = threading.Thread(target=self._run, name="retention", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def wake(self, job_id: str = "") -> None:
        """A pass soon (a job ended here)."""
        self._wake.set()

    def on_event(self, ev: JobEvent) -> None:
        # A registry listener, under the registry's lock: only wake the loop.
        if ev.to_state in _TERMINAL:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.run_once()
            except Exception:  # noqa: BLE001 - the loop outlives any one bad pass
                self.errors += 1
                log.exception("%s: retention pass failed", ctx(node=self._node))
            # Jobs ending back to back: a pass at most every other moment (the
            # wakes meanwhile fold into one), never a busy loop.
            self._stop.wait(min(self.last_pass_seconds, self._interval))
            self._wake.wait(self._interval)

    # -- one pass --------------------------------------------------------------
    def run_once(self) -> Plan:
        """One retirement pass (see the module doc); the plan it carried out."""
        t0 = time.monotonic()
        # What is on disk first: a dir listed before the registry is read belongs
        # to a job the registry then knows, if to any.
        log_dirs, run_dirs = _names(self._logs), _names(self._runs)
        snapshot_dirs = _job_dirs(self._snapshots) if self._snapshots else set()
        active = set(self._active())
        live = self._registry.live_ids() | active
        finished = [f for f in self._registry.finished() if f.job_id not in active]
        known = live | {f.job_id for f in finished}
        for name in sorted(run_dirs - live):
            if self._remove(self._runs, name, "run dir"):
                self.removed_run_dirs += 1
        for name in sorted(snapshot_dirs - live):
            if self._remove(self._snapshots, name, "snapshot dir"):
                self.removed_snapshot_dirs += 1
                log.info("%s: its snapshots here are freed (%s)", ctx(job=name, node=self._node),
                         os.path.join(self._snapshots, name))
        for name in sorted(log_dirs - known):
            self._remove(self._logs, name, "log dir of a job unknown here")
        for f in finished:
            if f.job_id not in self._sizes:
                self._keeper.cap_finished(f.job_id)
                self._sizes[f.job_id] = statedir.tree_bytes(os.path.join(self._logs, f.job_id))
        for gone in set(self._sizes) - {f.job_id for f in finished}:
            del self._sizes[gone]
        weighed = [Finished(f.job_id, f.finished_at, self._sizes.get(f.job_id, 0),
                            f.record_bytes) for f in finished]
        plan = decide(weighed, self._clock(), self._budget, shortfall=self._shortfall())
        self._apply(plan)
        events_plan = decide(self._registry.event_only_jobs(), self._clock(), self._budget)
        self._retire_records([r.job_id for r in events_plan.retire], "event-only")
        self._share_forgotten()
        try:
            self._registry.compact()
        except sqlite3.Error as exc:
            log.warning("%s: cannot checkpoint the job database: %s", ctx(node=self._node), exc)
        self.passes += 1
        self.last_pass_seconds = time.monotonic() - t0
        if plan.retire or events_plan.retire:
            log.info("%s: retention: %s; events of %d job(s) not run here retired; %d "
                     "finished job(s) kept, %.0f ms", ctx(node=self._node),
                     plan.sentence() or "no finished job retired", len(events_plan.retire),
                     len(finished) - len(plan.whole()), self.last_pass_seconds * 1000)
        return plan

    def _shortfall(self) -> int:
        try:
            space = statedir.disk_space(self._state_dir, self._min_free)
        except OSError:
            return 0
        return max(0, self._min_free - space.free_bytes) if space.full else 0

    def _apply(self, plan: Plan) -> None:
        for r in plan.logs_only():
            if self._retire_logs(r):
                self._registry.update(r.job_id, logs_retired_at=self._clock())
                self._registry.event(r.job_id, "info", f"logs retired ({r.log_bytes} bytes) "
                                     f"to keep this node within {r.why.value}")
        whole = [r for r in plan.whole() if self._retire_logs(r)]
        for r in whole:
            self._forget_shared(r.job_id, again=False)
        self._retire_records([r.job_id for r in whole], "finished")

    def _retire_logs(self, r: Retire) -> bool:
        """Remove a finished job's log dir; False (logged) if it could not be."""
        try:
            statedir.remove_tree(self._logs, r.job_id)
        except OSError as exc:
            self.errors += 1
            log.warning("%s: cannot retire the logs (%s): %s", ctx(job=r.job_id, node=self._node),
                        r.why.value, exc)
            return False
        self._sizes[r.job_id] = 0
        self.retired_log_bytes += r.log_bytes
        if r.scope is Scope.LOGS:
            self.retired_logs += 1
        log.debug("%s: retired %s (%s, %d bytes of logs)", ctx(job=r.job_id, node=self._node),
                  "its logs" if r.scope is Scope.LOGS else "the job", r.why.value, r.log_bytes)
        return True

    def _retire_records(self, job_ids: list[str], what: str) -> None:
        if not job_ids:
            return
        try:
            gone = self._registry.retire(job_ids)
        except sqlite3.Error as exc:
            self.errors += 1
            log.warning("%s: cannot retire the records of %d %s job(s): %s",
                        ctx(node=self._node), len(job_ids), what, exc)
            return
        self.retired_jobs += gone
        for job_id in job_ids:
            self._sizes.pop(job_id, None)

    def _forget_shared(self, job_id: str, again: bool) -> None:
        """Delete what the store keeps of a retired job; while the store does not
        answer, the job waits in ``_unshared`` for the next pass (logged once)."""
        if self._forget is None:
            return
        try:
            self._forget(job_id)
        except (StoreError, ValueError) as exc:
            self._unshared.add(job_id)
            if not again:
                log.info("%s: retired here; what the store keeps of it (this node's events) "
                         "waits until the store answers: %s",
                         ctx(job=job_id, node=self._node), exc)
        else:
            self._unshared.discard(job_id)

    def _share_forgotten(self) -> None:
        """Try again to delete from etcd the events of jobs retired before."""
        for job_id in sorted(self._unshared):
            self._forget_shared(job_id, again=True)
            if job_id in self._unshared:
                return  # the store still away: the rest wait for the next pass

    def _remove(self, parent: str, name: str, what: str) -> bool:
        try:
            return statedir.remove_tree(parent, name)
        except OSError as exc:
            self.errors += 1
            log.warning("%s: cannot remove the %s %s: %s", ctx(job=name, node=self._node),
                        what, os.path.join(parent, name), exc)
            return False


def _job_dirs(path: str) -> set[str]:
    """The real dirs (never a link) directly in ``path`` whose names are job ids."""
    try:
        with os.scandir(path) as entries:
            return {e.name for e in entries
                    if JOB_KEY.match(e.name) and e.is_dir(follow_symlinks=False)}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def _names(path: str) -> set[str]:
    try:
        return set(os.listdir(path))
    except FileNotFoundError:
        return set()
