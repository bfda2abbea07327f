"""Job events shared across the cluster: every node's, on whichever node asks.

Each daemon keeps its job events in its own registry (jobs/registry.py). For a job
that runs on several nodes a user on one node must see the others' too
(a worker crash there, its RESTARTING), so ``EventLog`` does two things:

* publish: a writer thread puts each of this node's events in etcd, one key
  per event (one put each)::

      /v1/events/<job>/<node>/<seq>     the event as JSON; seq is its seq in
                                        that node's registry, zero-padded

  The local registry is the queue: the writer reads it from the last seq it
  published (kept in ``<state>/events.published``), so a transition never
  waits for etcd, and events made while etcd is down, or while the daemon
  was stopped, go out once it is back. The registry listener only wakes it.
  Each node keeps its newest ``events.keep_per_job`` keys per job in etcd
  and deletes older ones (job records themselves stay in etcd, as they do
  today, so this is what bounds the prefix).
* mirror: the other nodes' events are imported into the local registry
  (``JobRegistry.import_events``, idempotent on node and origin seq), so
  ``Events`` and its ``after_seq`` keep working on local seqs. Not every
  event to every node (a fault of one job would reach the whole cluster):
  a ``Follower`` lists, then watches, ``/v1/events/<job>/`` of each job this
  node runs (``follow``/``unfollow``, with the job's rounds: the jobs view
  calls them), and of whatever job a user follows here (``elasticctl events
  -f JOB``; no job: the whole prefix, while the stream is open); a plain
  ``events [JOB]`` reads it once (``read``).

Each event is sealed with the cluster key, bound to its key (job, node and
seq: trust/sealed.py); one that does not verify or does not check is
counted, logged once (trust/refusals.py) and never imported.

Standalone daemons (one node, in-memory store) run none of this.
"""
from __future__ import annotations

import json
import logging
import os
import threading

from .. import statedir
from ..logsetup import ctx
from ..jobs.jobevent import JobEvent
from ..jobs.restartpolicy import RestartRule
from ..jobs.states import JobState
from ..store import EVENT_PUT, Store, StoreError
from ..store.follow import Follower, Held
from ..fields import is_ident, is_real
from ..trust.refusals import Refusals
from ..trust.sealed import Kind, Reason, Refused

log = logging.getLogger("elasticd.cluster.eventlog")

EVENTS = "/v1/events"
_STATES = frozenset(s.value for s in JobState) | {""}
_TEXT = ("job_id", "kind", "from_state", "to_state", "reason", "node_id")
_INTS = ("round", "rank", "restart")
_RULES = frozenset(r.value for r in RestartRule)
_MAX_TEXT = 16 * 1024     # characters of an event's text field (a reason: cut when written)


def event_key(job_id: str, node_id: str, seq: int) -> str:
    return f"{EVENTS}/{job_id}/{node_id}/{seq:012d}"


def parse_key(key: str) -> tuple[str, str, int]:
    """(job, node, seq) of an event key; ValueError if it is not one."""
    if not key.startswith(EVENTS + "/"):
        raise ValueError("not under the events prefix")
    parts = key[len(EVENTS) + 1:].split("/")
    if len(parts) != 3 or not all(map(is_ident, parts[:2])) or not parts[2].isascii() \
            or not parts[2].isdigit() or len(parts[2]) > 18:
        raise ValueError("expected /v1/events/<job>/<node>/<seq>")
    return parts[0], parts[1], int(parts[2])


def parse_event(key: str, value: str | None, records) -> JobEvent:
    """The event stored at ``key``, verified (``records``: trust/sealed.py) and
    checked, as the registry stores it (with ``origin_seq``); Refused for anything
    that is not a genuine, well-formed event whose job and node are the key's."""
    try:
        parse_key(key)
    except ValueError as exc:
        raise Refused(Reason.BAD_KEY, str(exc)) from None
    data = records.open(Kind.EVENT, key, value).doc
    try:
        return _event_fields(key, data)
    except ValueError as exc:
        raise Refused(Reason.INVALID, str(exc)) from None


def _event_fields(key: str, data: dict) -> JobEvent:
    job_id, node_id, seq = parse_key(key)
    try:
        ev = {name: data[name] for name in _TEXT}
        ev.update({name: data[name] for name in _INTS})
        ev["time"] = data["time"]
    except KeyError as exc:
        raise ValueError(f"event has no {exc.args[0]}") from None
    if not all(isinstance(ev[n], str) and len(ev[n]) <= _MAX_TEXT for n in _TEXT) \
            or not all(type(ev[n]) is int and abs(ev[n]) < 1 << 62 for n in _INTS) \
            or not is_real(ev["time"], 0.0, 1e11):
        raise ValueError("event field of the wrong type")
    if (ev["job_id"], ev["node_id"]) != (job_id, node_id):
        raise ValueError("event names another job or node than its key")
    if ev["from_state"] not in _STATES or ev["to_state"] not in _STATES:
        raise ValueError("unknown job state")
    if "layer" in data:
        if not isinstance(data["layer"], str) or len(data["layer"]) > 64 or \
                not is_real(data.get("duration_seconds", 0.0), 0.0, 1e9):
            raise ValueError("event layer of the wrong type")
        ev["layer"], ev["duration_seconds"] = data["layer"], data.get("duration_seconds", 0.0)
    if "restart_rule" in data:
        if data["restart_rule"] not in _RULES or \
                not is_real(data.get("restart_delay_seconds", 0.0), 0.0, 1e9):
            raise ValueError("event restart plan of the wrong type")
        ev["restart_rule"] = data["restart_rule"]
        ev["restart_delay_seconds"] = data.get("restart_delay_seconds", 0.0)
    ev["origin_seq"] = seq
    return JobEvent.from_dict(ev)


def shared(ev: JobEvent, node_id: str) -> bool:
    """Whether the writer publishes this registry event: this node's own, not imported,
    and about a job (a refused spec's id is not one: each node keeps its own refusal)."""
    return ev.node_id == node_id and ev.origin_seq is None and ev.kind != "rejected"


class EventLog:
    """Owns the writer thread and the mirror's follower; started and stopped by
    the daemon."""

    def __init__(self, cfg, store: Store, registry, *, records,
                 refusals: Refusals | None = None):
        self._node_id = cfg.daemon.node_id
        self._store = store
        self._records = records           # trust/sealed.py: how events are sealed, opened
        self._refusals = refusals or Refusals(ctx(node=cfg.daemon.node_id))
        self._registry = registry
        self._retry = cfg.events.retry
        self._keep = cfg.events.keep_per_job
        self._mark_path = os.path.join(cfg.daemon.state_dir, "events.published")
        self.published = self._read_mark()
        self._counts: dict[str, int] = {}    # job -> our keys in etcd, once looked up
        self._down = ""                       # why the last write failed, until one works
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch_retry = cfg.membership.watch_retry
        self._lock = threading.Lock()
        # what is followed ("": the whole prefix; else a job) -> its Follower
        self._followed = Held()
        self._stopping = False

    # -- life cycle ------------------------------------------------------------
    def start(self) -> None:
        self._registry.subscribe(self._on_local_event)
        self._thread = threading.Thread(target=self._run, name="events-publish", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """The mirror's watches start winding down (the writer keeps going)."""
        with self._lock:
            self._stopping = True
            followers = self._followed.things()
        for f in followers:
            f.request_stop()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            followers = self._followed.clear()
        for f in followers:
            f.request_stop()
        for f in followers:
            f.stop()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._retry + 2 * self._store.timeout + 2)

    def _on_local_event(self, ev: JobEvent) -> None:
        # Called under the registry's lock: only wake the writer.
        self._wake.set()

    # -- publish ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            if not self._publish_some():
                self._wake.wait(self._retry)
        self._publish_some()  # one last pass; what is left goes out at the next start

    def _publish_some(self) -> bool:
        """One batch; True if there may be more right away."""
        try:
            return self.publish_batch()
        except StoreError as exc:
            if not self._down:
                log.warning("%s: job events not shared while etcd is unavailable (%s); they "
                            "wait in the local log", ctx(node=self._node_id), exc)
            self._down = str(exc)
        except Exception:
            log.exception("publishing job events failed")
        self._stop.wait(self._retry)
        return False

    def publish_batch(self, limit: int = 1000) -> bool:
        """Put this node's events after the last published seq; True if it read a
        full batch. Raises StoreError, having kept what was done."""
        evs = self._registry.events(self.published, limit=limit)
        try:
            for ev in evs:
                if shared(ev, self._node_id):
                    self._put(ev)
                self.published = ev.seq
        finally:
            if evs:
                self._write_mark()
        if self._down and evs:
            log.info("%s: etcd is back; job events shared again", ctx(node=self._node_id))
            self._down = ""
        return len(evs) == limit

    def _put(self, ev: JobEvent) -> None:
        body = {k: v for k, v in ev.to_dict().items() if k != "seq"}
        for name in _TEXT:
            if isinstance(body.get(name), str):
                body[name] = body[name][:_MAX_TEXT]
        try:
            key = event_key(ev.job_id, self._node_id, ev.seq)
            self._store.put(key, self._records.seal(Kind.EVENT, key, json.dumps(body)))
        except ValueError as exc:  # a job or node id that is no key segment
            log.warning("%s: event %d not shared: %s", ctx(job=ev.job_id), ev.seq, exc)
            return
        self._trim(ev.job_id)

    def _trim(self, job_id: str) -> None:
        """Keep our newest keep_per_job keys of the job; delete older ones in
        batches of a tenth, so trimming costs a list per keep/10 events."""
        count = self._counts.get(job_id)
        if count is None:
            kvs, _ = self._store.list(f"{EVENTS}/{job_id}/{self._node_id}")
            count = len(kvs)
        else:
            count += 1
        self._counts[job_id] = count
        if count <= self._keep + self._keep // 10:
            return
        kvs, _ = self._store.list(f"{EVENTS}/{job_id}/{self._node_id}")
        old = sorted(kvs, key=lambda kv: kv.key)[:max(0, len(kvs) - self._keep)]
        for kv in old:
            self._store.delete(kv.key)
        self._counts[job_id] = len(kvs) - len(old)

    def forget_job(self, job_id: str) -> None:
        """Delete this node's events of a job that retention retired here
        (jobs/retirer.py) from etcd. Raises StoreError (or ValueError for an id
        that is no key segment); the retirer tries again at its next pass."""
        self._store.delete_prefix(f"{EVENTS}/{job_id}/{self._node_id}")
        self._counts.pop(job_id, None)

    def _read_mark(self) -> int:
        """The last seq published; on a first start, the registry's last (what
        came before is not sent)."""
        try:
            with open(self._mark_path) as fh:
                return int(fh.read().strip())
        except FileNotFoundError:
            return self._registry.last_seq
        except (OSError, ValueError) as exc:
            log.warning("unreadable %s (%s); sharing events from now on", self._mark_path, exc)
            return self._registry.last_seq

    def _write_mark(self) -> None:
        tmp = self._mark_path + ".tmp"
        try:
            with open(statedir.open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as fh:
                fh.write(f"{self.published}\n")
            os.replace(tmp, self._mark_path)
        except OSError as exc:  # at worst, events are put again at the next start
            log.warning("cannot record published events in %s: %s", self._mark_path, exc)

    # -- mirror ----------------------------------------------------------------
    def _prefix(self, job_id: str) -> str:
        if job_id and not is_ident(job_id):
            raise ValueError(f"{job_id[:80]!r} is no job id")
        return f"{EVENTS}/{job_id}/" if job_id else EVENTS

    def follow(self, job_id: str = "", wait: float = 0.0) -> None:
        """Import the job's events (``""``: every job's) as they come, until as many
        ``unfollow``s; with ``wait``, up to that many seconds for those before now.
        A job id that is no key segment is not followed (ValueError)."""
        prefix = self._prefix(job_id)
        with self._lock:
            if self._stopping:
                return
            follower, new = self._followed.take(job_id, lambda: self._follower(job_id, prefix))
            if new:
                follower.start()
        if wait > 0:
            follower.synced.wait(wait)

    def _follower(self, job_id: str, prefix: str) -> Follower:
        """A watch of ``prefix`` that imports what it gets while it is the one held for
        ``job_id`` (an event after the last unfollow is not taken)."""
        def live() -> bool:
            with self._lock:
                return self._followed.get(job_id) is follower
        follower = Follower(self._store, prefix, f"events-watch-{job_id or 'all'}",
                            self._watch_retry, lambda kvs, rev: live() and self._reset(kvs, rev),
                            lambda ev: live() and self._event(ev))
        return follower

    def unfollow(self, job_id: str = "") -> None:
        """One ``follow`` less; the watch ends (within its poll) after the last."""
        with self._lock:
            follower = self._followed.let_go(job_id)
        if follower is not None:
            follower.request_stop()

    def following(self) -> list[str]:
        with self._lock:
            return sorted(self._followed.keys())

    def read(self, job_id: str = "") -> None:
        """Import the job's events (``""``: every job's) in etcd now, unless a watch
        here holds them already. Raises StoreError (ValueError for a job id that is
        no key segment)."""
        with self._lock:
            held = "" in self._followed or (job_id and job_id in self._followed)
        if not held:
            kvs, _ = self._store.list(self._prefix(job_id))
            self._reset(kvs, 0)

    def _reset(self, kvs: list, revision: int) -> None:
        self._import([(kv.key, kv.value) for kv in kvs])

    def _event(self, ev) -> None:
        if ev.type == EVENT_PUT:
            self._import([(ev.key, ev.value)])

    def _import(self, items: list[tuple[str, str | None]]) -> None:
        evs = []
        for key, value in items:
            try:
                ev = parse_event(key, value, self._records)
            except Refused as exc:
                self._refusals.refused(Kind.EVENT, key, exc.reason, exc.detail)
                continue
            except Exception as exc:  # a bug: this key only, never the watch
                self._refusals.refused(Kind.EVENT, key, Reason.ERROR, repr(exc), trace=True)
                continue
            if ev.node_id != self._node_id:
                evs.append(ev)
        if evs:
            self._registry.import_events(evs)
