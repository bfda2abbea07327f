"""The control server's thread pool: callers take turns, so one uid's flood of calls
never queues ahead of another uid's call.

gRPC runs each call on the pool it was given, first come first served: a
thousand queued calls of one user (each refused at once by a cap, or not)
are all served before the next user's ``list``. ``FairExecutor`` keeps one
queue per caller and gives each caller with queued calls one turn in a
round, so a call waits for at most one call of each other caller ahead of
it (plus the calls already running); a caller also has a bounded number
running and starts calls at a bounded rate (see ``FairExecutor``).

Who calls is known before the call is queued: ``CallerTag``, a server
interceptor, runs in gRPC's serving thread with the call's metadata, reads
the caller's uid from its credential token (control/auth.py) and sets it
in the call's own context (``contextvars``), the context gRPC then submits
the call's work in (``Context.run``); ``caller_of`` reads it from there. A
call without a valid token (the gRPC health service, a forged token) counts
as one caller, ``None``. Were gRPC ever to submit work another way, every
call would count as that one caller: first come first served, as before.
"""
from __future__ import annotations

import collections
import contextvars
import heapq
import itertools
import threading
import time
from concurrent import futures
from typing import Callable, Hashable

import grpc

from .auth import TOKEN_METADATA_KEY, AuthError, TokenIssuer

_CALLER: contextvars.ContextVar[int | None] = contextvars.ContextVar("elasticd_caller",
                                                                    default=None)
_OVER: contextvars.ContextVar[int] = contextvars.ContextVar("elasticd_over_queue", default=0)


class CallerTag(grpc.ServerInterceptor):
    """Sets the uid of each call's verified token in the call's context (or None)."""

    def __init__(self, issuer: TokenIssuer):
        self._issuer = issuer

    def intercept_service(self, continuation, handler_call_details):
        token = next((value for key, value in handler_call_details.invocation_metadata or ()
                      if key == TOKEN_METADATA_KEY), None)
        try:
            uid = self._issuer.verify(token).uid if isinstance(token, str) else None
        except AuthError:
            uid = None
        _CALLER.set(uid)
        return continuation(handler_call_details)


def caller_of(fn: Callable) -> Hashable:
    """Whose call ``fn`` (what gRPC submits: the call's ``Context.run``) is."""
    context = getattr(fn, "__self__", None)
    return context.get(_CALLER) if isinstance(context, contextvars.Context) else None


def mark_over(fn: Callable, waiting: int) -> None:
    """Tell the call ``fn`` (as ``caller_of`` reads it) that it came while its caller had
    ``waiting`` calls queued already: ``over_queue()`` says so while it runs."""
    context = getattr(fn, "__self__", None)
    if isinstance(context, contextvars.Context):
        context.run(_OVER.set, waiting)


def over_queue() -> int:
    """In a call: how many of its caller's calls were queued when it came, if that was
    over the queue limit (it is to refuse itself); else 0."""
    return _OVER.get()


class FairExecutor(futures.Executor):
    """Up to ``max_workers`` threads (started as needed) serving the callers
    (``key_of(fn)`` of each submitted ``fn``) in turn.

    Each caller also has at most ``per_key`` calls running at once, and starts at
    most ``rate`` calls a second (a burst of ``rate`` after a pause): its other
    calls wait in its queue, costing little meanwhile. A call that comes while
    its caller has ``max_queued`` waiting already waits its turn as well, and
    runs after ``mark(fn, waiting)``: the call then refuses itself
    (``over_queue``) instead of doing its work. The rate is what keeps a flood
    from taking the whole daemon: every call also costs gRPC's one serving
    thread its work, in the order calls arrive; a caller whose calls are
    answered at once (refused by a cap, say) would otherwise ask again as fast
    as that thread can take them, and another caller's call would wait behind
    them all. So refusals are paced with the rest: a caller gets no answer,
    served or refused, faster than its rate.
    """

    def __init__(self, max_workers: int, per_key: int | None = None,
                 rate: float | None = None, max_queued: int | None = None,
                 key_of: Callable[[Callable], Hashable] = caller_of,
                 mark: Callable[[Callable, int], None] = mark_over,
                 thread_name_prefix: str = "rpc", clock=time.monotonic):
        self._max = max_workers
        self._per_key = per_key or max_workers
        self._rate = rate
        self._max_queued = max_queued
        self._mark = mark
        self._key_of = key_of
        self._prefix = thread_name_prefix
        self._clock = clock
        self._names = itertools.count()
        self._cond = threading.Condition()
        self._queues: dict[Hashable, collections.deque] = {}
        self._turns: collections.deque = collections.deque()  # callers that may start one
        self._later: list = []        # heap of (when, n, caller): out of tokens until then
        self._n = itertools.count()
        self._waiting: set = set()    # callers in _turns or _later
        self._running: dict[Hashable, int] = {}
        self._tokens: dict[Hashable, tuple[float, float]] = {}  # caller -> (tokens, at)
        self._busy = 0
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> futures.Future:
        future: futures.Future = futures.Future()
        try:
            key = self._key_of(fn)
        except Exception:  # noqa: BLE001 - an unknown caller is served all the same
            key = None
        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            queue = self._queues.setdefault(key, collections.deque())
            if self._max_queued is not None and len(queue) >= self._max_queued:
                queue.append((future, fn, args, kwargs, len(queue)))  # to refuse itself
            else:
                queue.append((future, fn, args, kwargs))
            self._offer(key)
            if len(self._threads) < self._max and \
                    len(self._threads) - self._busy < self._startable():
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{self._prefix}_{next(self._names)}")
                self._threads.append(thread)
                thread.start()
            else:
                self._cond.notify()
        return future

    def _offer(self, key: Hashable) -> None:
        """Give ``key`` a turn if it has a call waiting, is under its running limit and
        not waiting for a turn already (under the lock)."""
        if key in self._queues and key not in self._waiting and \
                self._running.get(key, 0) < self._per_key:
            self._waiting.add(key)
            self._turns.append(key)

    def _startable(self) -> int:
        """How many calls could start now, tokens aside (under the lock)."""
        return sum(
            min(len(self._queues[key]), self._per_key - self._running.get(key, 0))
            for key in self._turns)

    def _take_token(self, key: Hashable, now: float) -> float:
        """0 if ``key`` may start a call now (a token taken), else how long until it may."""
        if self._rate is None:
            return 0.0
        tokens, at = self._tokens.get(key, (self._rate, now))
        tokens = min(self._rate, tokens + (now - at) * self._rate)
        if tokens < 1.0:
            self._tokens[key] = (tokens, now)
            return (1.0 - tokens) / self._rate
        self._tokens[key] = (tokens - 1.0, now)
        return 0.0

    def _next(self):
        """(caller, its oldest call) of the next caller whose turn it is, waiting for
        one; None once shut down and nothing may start."""
        with self._cond:
            while True:
                now = self._clock()
                while self._later and self._later[0][0] <= now:
                    self._turns.append(heapq.heappop(self._later)[2])
                if self._turns:
                    key = self._turns.popleft()
                    wait = self._take_token(key, now)
                    if wait:
                        heapq.heappush(self._later, (now + wait, next(self._n), key))
                        continue
                    break
                if self._shutdown and not self._later:
                    return None
                self._cond.wait(self._later[0][0] - now if self._later else None)
            self._waiting.discard(key)
            queue = self._queues[key]
            item = queue.popleft()
            if not queue:
                del self._queues[key]
            self._running[key] = self._running.get(key, 0) + 1
            self._busy += 1
            self._offer(key)  # its next call waits for everyone else's turn
            return key, item

    def _done(self, key: Hashable) -> None:
        with self._cond:
            self._busy -= 1
            running = self._running.pop(key) - 1
            if running:
                self._running[key] = running
            self._offer(key)  # it may have been at its running limit
            self._cond.notify()

    def _work(self) -> None:
        while True:
            got = self._next()
            if got is None:
                return
            key, (future, fn, args, kwargs, *waiting) = got
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        if waiting:
                            self._mark(fn, waiting[0])
                        result = fn(*args, **kwargs)
                    except BaseException as exc:  # noqa: BLE001 - handed to the future
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                self._done(key)
                del got, future, fn, args, kwargs, waiting

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                for queue in self._queues.values():
                    for future, *_ in queue:
                        future.cancel()
                self._queues.clear()
                self._turns.clear()
                self._later.clear()
                self._waiting.clear()
            self._cond.notify_all()
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()
