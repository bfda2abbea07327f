"""Following a prefix: list it, then watch it from the list's revision.

Every in-memory view of the store (drain marks, jobs, events) is kept the
same way, by one ``Follower`` thread each: ``on_reset`` gets the whole prefix
after each (re)list, ``on_event`` every change after it, in order. A follower
of deletes only (the loss witnesses: cluster/witness.py) lists nothing: it
starts from the store's revision, or from ``from_revision`` while etcd keeps that
history (``on_reset`` gets no keys), and is told the prefix's deletes, each its key
alone.
A compacted history means a fresh list; an unreachable store a bounded wait
and a new watch from the last revision seen; nothing is lost either way.

What a handler makes of one key is that key's business: the handlers check
and refuse values themselves (trust/refusals.py), and an exception that still
escapes one is logged (once per key) and counted in ``handler_errors``, and
the follower goes on with the next event. It never lists again because of a
value: the list would hold the same value, and a watch that relists forever
delivers nothing to anyone (one bad key once stalled every job that way).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from .base import KV, Store, StoreError, WatchCompacted, WatchEvent

log = logging.getLogger("elasticd.store")

_LOGGED_KEYS = 1024   # keys whose handler failure is logged; later ones are only counted


class Follower:
    def __init__(self, store: Store, prefix: str, name: str, retry: float,
                 on_reset: Callable[[list[KV], int], None],
                 on_event: Callable[[WatchEvent], None], deletes_only: bool = False,
                 from_revision: int = 0):
        self._store = store
        self._deletes_only = deletes_only
        self._from = from_revision if deletes_only else 0
        self._prefix = prefix
        self._name = name
        self._retry = retry
        self._on_reset = on_reset
        self._on_event = on_event
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()
        self.handler_errors = 0          # events (or lists) a handler raised on
        self._logged: set[str] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop (it sees this within the store's watch poll)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop the loop and wait for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._retry + 2)

    def _handled(self, key: str, handle, *args) -> None:
        """Run one handler; an exception from it is that key's, never the watch's."""
        try:
            handle(*args)
        except Exception:
            self.handler_errors += 1
            if key not in self._logged and len(self._logged) < _LOGGED_KEYS:
                self._logged.add(key)
                log.exception("%s: handling %r failed; skipped, the watch goes on",
                              self._name, key[:200])

    def _run(self) -> None:
        revision = None
        while not self._stop.is_set():
            try:
                if revision is None:
                    kvs, revision = (([], self._from or self._store.revision())
                                     if self._deletes_only else self._store.list(self._prefix))
                    self._from = 0   # from a compacted history on: the store's revision
                    self._handled(f"(the list of {self._prefix})", self._on_reset, kvs, revision)
                    self.synced.set()
                for ev in self._store.watch(self._prefix, revision, self._stop,
                                            deletes_only=self._deletes_only):
                    revision = ev.revision
                    self._handled(ev.key, self._on_event, ev)
            except WatchCompacted:
                revision = None
            except StoreError as exc:
                log.debug("%s interrupted: %s", self._name, exc)
                self._stop.wait(self._retry)
            except Exception:
                log.exception("%s failed; listing again", self._name)
                revision = None
                self._stop.wait(self._retry)


class Held:
    """Things kept per key while someone uses them (a job's watch while its agent runs,
    a user's event stream): the first ``take`` makes one, as many ``let_go``s end it.
    No lock of its own: its owner's guards it."""

    def __init__(self):
        self._held: dict = {}      # key -> [users, thing]

    def take(self, key, make) -> tuple[object, bool]:
        """The thing held for ``key`` (``make()`` if none), and whether it is new."""
        got = self._held.get(key)
        if got is not None:
            got[0] += 1
            return got[1], False
        thing = make()
        self._held[key] = [1, thing]
        return thing, True

    def let_go(self, key):
        """One user less; the thing once its last user let go (it is held no more),
        else None."""
        got = self._held.get(key)
        if got is None:
            return None
        got[0] -= 1
        if got[0] > 0:
            return None
        del self._held[key]
        return got[1]

    def get(self, key):
        got = self._held.get(key)
        return got[1] if got is not None else None

    def __contains__(self, key) -> bool:
        return key in self._held

    def keys(self) -> list:
        return list(self._held)

    def things(self) -> list:
        return [got[1] for got in self._held.values()]

    def clear(self) -> list:
        """Hold nothing more; what was held."""
        things, self._held = self.things(), {}
        return things
