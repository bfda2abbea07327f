"""A store watch running in a thread, for the store tests."""

from __future__ import annotations

import threading
import time

from elasticd.store import WatchEvent


class Watcher:
    """Runs store.watch in a thread and collects what it yields."""

    def __init__(self, store, prefix, start_revision, timeout=None, deletes_only=False):
        self.events: list[WatchEvent] = []
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.changed = threading.Condition()
        self.thread = threading.Thread(
            target=self._run, args=(store, prefix, start_revision, timeout, deletes_only),
            daemon=True)
        self.thread.start()

    def _run(self, store, prefix, start_revision, timeout, deletes_only):
        try:
            for ev in store.watch(prefix, start_revision, self.stop, timeout,
                                  deletes_only=deletes_only):
                with self.changed:
                    self.events.append(ev)
                    self.changed.notify_all()
        except BaseException as e:  # surfaced by the test
            self.error = e

    def wait_for(self, n: int, timeout: float = 10.0) -> list[WatchEvent]:
        with self.changed:
            self.changed.wait_for(lambda: len(self.events) >= n or self.error, timeout)
        assert self.error is None, f"watch failed: {self.error!r}"
        assert len(self.events) >= n, f"only {len(self.events)} of {n} events: {self.events}"
        return list(self.events)

    def close(self) -> float:
        """Set stop and return how long the watch took to end."""
        t = time.monotonic()
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive(), "watch ignored stop_event"
        return time.monotonic() - t


def replay(store, prefix, after, count=None, until=None, timeout=10.0) -> list[WatchEvent]:
    """The events under ``prefix`` after revision ``after``: stops at
    ``count`` events, or after the first event ``until(event)`` accepts,
    or at ``timeout`` (generous: a loaded box is slow to set up a watch)."""
    out: list[WatchEvent] = []
    for ev in store.watch(prefix, after, timeout=timeout):
        out.append(ev)
        if len(out) == count or (until is not None and until(ev)):
            break
    return out
