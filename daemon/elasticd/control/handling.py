"""How every control call is served: its caller's slot held while it runs, our errors
mapped to gRPC status codes with their message, anything unexpected logged and
answered INTERNAL, so no exception ends a call badly or reaches the daemon.

``handled`` decorates a ControlServicer method, which then receives the ``Caller``
as its last argument; it uses the servicer's ``_caller``, ``_not_over_queue``,
``_observe``, ``_streams`` and ``_calls``.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc

from .. import errors

log = logging.getLogger("elasticd.control.service")

# Unary calls that may last as long as a stream: they take a stream's slot, not a short
# call's (their threads are the pool's share for long-lived calls).
LONG_LIVED_UNARY = frozenset({"WaitJob"})


def status_of(exc: errors.ElasticdError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def handled(method):
    """Map our errors to status codes; never let an exception kill a call badly. Every
    call holds a slot of its caller's while it runs (control/streamgate.py): a
    stream's or a long-lived unary call's (LONG_LIVED_UNARY) in the stream gate,
    any other's in the call gate."""
    name = method.__name__

    def fail(self, context, exc: BaseException) -> None:
        if isinstance(exc, errors.ElasticdError):
            code, msg = status_of(exc), str(exc)
        else:
            log.exception("control %s failed", name)
            code, msg = grpc.StatusCode.INTERNAL, f"internal error in elasticd: {exc!r} " \
                                                  "(see the daemon's log)"
        self._observe(name, code, context)
        context.abort(code, msg)

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):
            context.started = time.perf_counter()
            try:
                caller = self._caller(context)
                self._not_over_queue(caller, name)
                with self._streams.slot(caller.uid, name):
                    yield from method(self, request, context, caller)
                self._observe(name, grpc.StatusCode.OK, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                if _is_abort(exc):
                    raise
                fail(self, context, exc)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        context.started = time.perf_counter()
        try:
            caller = self._caller(context)
            self._not_over_queue(caller, name)
            gate = self._streams if name in LONG_LIVED_UNARY else self._calls
            with gate.slot(caller.uid, name):
                result = method(self, request, context, caller)
            self._observe(name, grpc.StatusCode.OK, context)
            return result
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if _is_abort(exc):
                raise
            fail(self, context, exc)
    return unary


def _is_abort(exc: BaseException) -> bool:
    # grpc raises a bare Exception from context.abort(); it carries no type of its own.
    return type(exc) is Exception and not exc.args
