"""One watch over every job's keys, kept as an in-memory view.

The daemon runs one ``JobsView`` (one watch stream, however many jobs);
rendezvous participants and the job dispatcher read it and wait on its
condition instead of polling etcd. Records that do not parse are logged
once and skipped: garbage under the prefix never stops a round.

A spec goes through ``open_spec(job_id, text)`` as it enters the view. The
daemon's verifies, decrypts and checks it (clusterspec.SpecCodec.open); a
spec it refuses is kept as ``JobKeys.rejection`` (``spec`` stays None), so
nothing reads it as a job, and the dispatcher can report it. The torchrun
adapter's specs are plain JSON (``plain_spec``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

from ..hangs.phase_board import NodePhases
from ..trust.rejections import Rejection, SpecRejected
from ..store import EVENT_PUT, Store
from ..store.follow import Follower
from .protocol import Join, RoundState

log = logging.getLogger("elasticd.rendezvous")

JOBS = "/v1/jobs"


@dataclass
class JobKeys:
    spec: dict | None = None
    state: RoundState | None = None
    state_revision: int = 0
    joins: dict = field(default_factory=dict)     # round -> {node: Join}
    done: dict = field(default_factory=dict)      # round -> set(node)
    workers: dict = field(default_factory=dict)   # node -> list of worker rows
    summaries: dict = field(default_factory=dict)  # node -> its recovery summary (a dict)
    rejection: Rejection | None = None             # the spec was refused (spec is None)
    phases: dict = field(default_factory=dict)    # node -> (NodePhases, monotonic time got)


def plain_spec(job_id: str, text: str) -> dict:
    """A spec as plain JSON, unchecked (the torchrun adapter's own prefix)."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError("spec is not an object")
    return spec


class JobsView:
    def __init__(self, store: Store, retry: float = 1.0, prefix: str = JOBS,
                 open_spec=plain_spec, on_bad_phases=None):
        self._prefix = prefix
        self._open_spec = open_spec
        self._jobs: dict[str, JobKeys] = {}
        self.changed = threading.Condition()
        self.revision = 0
        self._follower = Follower(store, prefix, "jobs-watch", retry, self._reset, self._event)
        self.synced = self._follower.synced
        self._bad: set[str] = set()
        self.bad_phase_records = 0   # peers' phase records refused (phase_board.from_json)
        self._on_bad_phases = on_bad_phases  # called (no arguments) for each: metrics

    # -- reading -------------------------------------------------------------
    def job(self, job_id: str) -> JobKeys | None:
        with self.changed:
            keys = self._jobs.get(job_id)
            if keys is None:
                return None
            return JobKeys(spec=keys.spec, state=keys.state, state_revision=keys.state_revision,
                           joins={r: dict(v) for r, v in keys.joins.items()},
                           done={r: set(v) for r, v in keys.done.items()},
                           workers=dict(keys.workers), summaries=dict(keys.summaries),
                           rejection=keys.rejection)

    def phases(self, job_id: str) -> dict:
        """{node: (NodePhases, monotonic time this daemon got it)} of the job."""
        with self.changed:
            keys = self._jobs.get(job_id)
            return dict(keys.phases) if keys is not None else {}

    def job_ids(self) -> list[str]:
        with self.changed:
            return list(self._jobs)

    def wait(self, timeout: float, seen: int | None = None,
             stop: threading.Event | None = None) -> None:
        """Wait for a change after revision ``seen`` (now, if None), timeout,
        or ``stop`` set (whoever sets it then calls ``wake_waiters``).

        Pass the revision read before looking at the view: a change applied
        between that look and this call then returns at once instead of
        being slept through.
        """
        with self.changed:
            after = self.revision if seen is None else seen
            self.changed.wait_for(
                lambda: self.revision > after or (stop is not None and stop.is_set()), timeout)

    def wake_waiters(self) -> None:
        """Wake every ``wait`` to look at its ``stop`` event again."""
        with self.changed:
            self.changed.notify_all()

    # -- the loop --------------------------------------------------------------
    def start(self) -> None:
        self._follower.start()

    def request_stop(self) -> None:
        self._follower.request_stop()

    def stop(self) -> None:
        self._follower.stop()

    def _reset(self, kvs: list, revision: int) -> None:
        with self.changed:
            self._jobs = {}
            for kv in kvs:
                self._apply(kv.key, kv.value, kv.revision)
            self.revision = revision
            self.changed.notify_all()

    def _event(self, ev) -> None:
        with self.changed:
            self._apply(ev.key, ev.value if ev.type == EVENT_PUT else None, ev.revision)
            self.revision = ev.revision
            # A phase record (each node, every second, per job) changes no round: the
            # rendezvous and the dispatcher need not wake for it (the agent reads it).
            parts = ev.key[len(self._prefix) + 1:].split("/")
            if not (len(parts) == 3 and parts[1] == "phases"):
                self.changed.notify_all()

    def _apply(self, key: str, value: str | None, revision: int) -> None:
        """Fold one key into the view; the caller holds the condition."""
        parts = key[len(self._prefix) + 1:].split("/")
        if len(parts) < 2:
            return self._garbage(key, "unexpected key")
        job_id, kind = parts[0], parts[1]
        keys = self._jobs.setdefault(job_id, JobKeys())
        try:
            if kind == "spec" and len(parts) == 2:
                keys.spec, keys.rejection = None, None
                if value is not None:
                    try:
                        keys.spec = self._open_spec(job_id, value)
                    except SpecRejected as exc:
                        keys.rejection = exc.rejection
            elif kind == "state" and len(parts) == 2:
                keys.state = RoundState.from_json(value) if value is not None else None
                keys.state_revision = revision if value is not None else 0
            elif kind in ("join", "done") and len(parts) == 4:
                rnd, node = int(parts[2]), parts[3]
                table = keys.joins if kind == "join" else keys.done
                if value is None and kind == "join":
                    table.get(rnd, {}).pop(node, None)
                elif value is None:
                    table.get(rnd, set()).discard(node)
                elif kind == "join":
                    join = Join.from_json(value)
                    if join.node_id != node:
                        raise ValueError("join record names another node")
                    table.setdefault(rnd, {})[node] = join
                else:
                    table.setdefault(rnd, set()).add(node)
            elif kind == "workers" and len(parts) == 3:
                if value is None:
                    keys.workers.pop(parts[2], None)
                    keys.summaries.pop(parts[2], None)
                else:
                    data = json.loads(value)
                    rows, summary = (data.get("rows"), data.get("summary", {})) \
                        if isinstance(data, dict) else (data, {})  # a list: before summaries
                    if not isinstance(rows, list) or not isinstance(summary, dict):
                        raise ValueError("worker rows are not a list")
                    keys.workers[parts[2]] = rows
                    keys.summaries[parts[2]] = summary
            elif kind == "phases" and len(parts) == 3:
                keys.phases.pop(parts[2], None)
                if value is not None:
                    try:
                        keys.phases[parts[2]] = (NodePhases.from_json(value, parts[2]),
                                                 time.monotonic())
                    except (ValueError, RecursionError) as exc:
                        self.bad_phase_records += 1
                        if self._on_bad_phases is not None:
                            self._on_bad_phases()
                        raise ValueError(f"phase record refused: {str(exc)[:200]}") from None
            else:
                self._garbage(key, "unknown key")
        except (ValueError, KeyError, TypeError) as exc:
            self._garbage(key, str(exc))
        if keys.spec is None and keys.state is None and not keys.joins and not keys.workers \
                and keys.rejection is None:
            self._jobs.pop(job_id, None)

    def _garbage(self, key: str, why: str) -> None:
        if key not in self._bad:
            self._bad.add(key)
            log.warning("ignoring %s in etcd: %s", key, why)
