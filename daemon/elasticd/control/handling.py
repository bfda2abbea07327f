"""How every control call is served: its caller's slot held while it runs, our errors
mapped to gRPC status codes with their message, anything unexpected logged and
answered INTERNAL, so no exception ends a call badly or reaches the daemon.

``handled`` decorates a ControlServicer method, which then receives the ``Caller``
as its last argument; all it needs of the servicer is its ``door``: the
``CallDoor`` every call passes (who calls, whether their queue is full, which
slot they hold, the call's metric).
"""
from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc

from .. import errors
from ..config import Config
from .auth import TOKEN_METADATA_KEY, AuthError, Caller, TokenIssuer
from .fairpool import over_queue
from .streamgate import CallGate, StreamGate

log = logging.getLogger("elasticd.control.service")

# Unary calls that may last as long as a stream: they take a stream's slot, not a short
# call's (their threads are the pool's share for long-lived calls).
LONG_LIVED_UNARY = frozenset({"WaitJob"})


class CallDoor:
    """What every control call passes before its method runs, and after."""

    def __init__(self, cfg: Config, issuer: TokenIssuer, metrics=None):
        self._limits = cfg.limits
        self._issuer = issuer
        self._metrics = metrics
        self.streams = StreamGate(cfg.limits.streams_total, cfg.limits.streams_per_user)
        self.calls = CallGate(cfg.limits.calls_per_user)

    def caller(self, context) -> Caller:
        """The caller the call's credential token names; Unauthenticated if none."""
        token = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY)
        try:
            return self._issuer.verify(token)
        except AuthError as exc:
            raise errors.Unauthenticated(str(exc)) from None

    def not_over_queue(self, caller: Caller, what: str) -> None:
        """Refuse a call that came while its caller had a full queue (control/fairpool.py)."""
        waiting = over_queue()
        if waiting:
            raise errors.ResourceExhausted(
                f"uid {caller.uid} has {waiting} calls waiting for their turn "
                f"(limits.calls_queued_per_user {self._limits.calls_queued_per_user}); "
                f"try this {what} again once they are answered")

    def slot(self, caller: Caller, name: str, long_lived: bool):
        """The caller's slot for the call: a stream's (streams and LONG_LIVED_UNARY
        calls) or a short call's."""
        gate = self.streams if long_lived or name in LONG_LIVED_UNARY else self.calls
        return gate.slot(caller.uid, name)

    def observe(self, method: str, code: grpc.StatusCode, context) -> None:
        if self._metrics is not None:
            self._metrics.observe_rpc(method, code.name,
                                      time.perf_counter() - getattr(context, "started", 0))


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
        self.door.observe(name, code, context)
        context.abort(code, msg)

    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):
            context.started = time.perf_counter()
            try:
                caller = self.door.caller(context)
                self.door.not_over_queue(caller, name)
                with self.door.slot(caller, name, long_lived=True):
                    yield from method(self, request, context, caller)
                self.door.observe(name, grpc.StatusCode.OK, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status code
                if _is_abort(exc):
                    raise
                fail(self, context, exc)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        context.started = time.perf_counter()
        try:
            caller = self.door.caller(context)
            self.door.not_over_queue(caller, name)
            with self.door.slot(caller, name, long_lived=False):
                result = method(self, request, context, caller)
            self.door.observe(name, grpc.StatusCode.OK, context)
            return result
        except Exception as exc:  # noqa: BLE001 - mapped to a status code
            if _is_abort(exc):
                raise
            fail(self, context, exc)
    return unary


def _is_abort(exc: BaseException) -> bool:
    # grpc raises a bare Exception from context.abort(); it carries no type of its own.
    return type(exc) is Exception and not exc.args
