"""The control server's pool serves callers in turn, and knows who calls before it queues a
call (control/fairpool.py); the per-uid caps name their setting (control/streamgate.py).

No daemon: a real gRPC server on a real unix socket for the part that depends on
how gRPC hands calls to its pool (so a gRPC upgrade that changes it fails here).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticd import errors
from elasticd.control.auth import TOKEN_METADATA_KEY, TokenIssuer
from elasticd.control.fairpool import CallerTag, FairExecutor, caller_of
from elasticd.control.streamgate import CallGate


def recorder(order: list, release: threading.Event):
    """``call(key, name, block)``: a call of caller ``key`` that appends ``name`` to
    ``order`` when it runs (after ``release`` is set, if ``block``)."""
    def call(key, name, block=False):
        def run():
            if block:
                release.wait(10)
            order.append(name)
        run.key = key
        return run
    return call


def test_one_callers_queue_never_goes_ahead_of_anothers_call():
    """With one thread busy: 50 calls of uid 1 queued, then one of uid 2; uid 2's
    runs second, not 51st."""
    release = threading.Event()
    order: list = []
    pool = FairExecutor(1, key_of=lambda fn: fn.key)
    call = recorder(order, release)
    first = pool.submit(call(1, "a0", block=True))
    rest = [pool.submit(call(1, f"a{i}")) for i in range(1, 50)]
    theirs = pool.submit(call(2, "b"))
    release.set()
    for f in [first, *rest, theirs]:
        f.result(10)
    assert order[:3] == ["a0", "a1", "b"] or order[:2] == ["a0", "b"], order[:5]
    assert order.index("b") <= 2 and len(order) == 51
    pool.shutdown()


def test_the_pool_grows_to_its_limit_returns_results_and_exceptions_and_shuts_down():
    pool = FairExecutor(4, key_of=lambda fn: None)
    gate = threading.Barrier(4, timeout=10)
    running = [pool.submit(gate.wait) for _ in range(4)]  # needs four threads at once
    assert sorted(f.result(10) for f in running) == [0, 1, 2, 3]

    def boom():
        raise ValueError("boom")
    with pytest.raises(ValueError):
        pool.submit(boom).result(10)
    assert pool.submit(lambda: 42).result(10) == 42
    pool.shutdown(wait=True)
    with pytest.raises(RuntimeError):
        pool.submit(lambda: 1)


def test_shutdown_cancels_what_is_queued_when_asked():
    started, release = threading.Event(), threading.Event()
    pool = FairExecutor(1, key_of=lambda fn: None)
    busy = pool.submit(lambda: started.set() or release.wait(10))
    assert started.wait(10)
    queued = pool.submit(lambda: 1)
    pool.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert busy.result(10) is True and queued.cancelled()


def test_a_caller_at_its_running_limit_waits_while_another_starts():
    release = threading.Event()
    lock = threading.Lock()
    now = {"running": 0, "most": 0}

    def blocking():
        with lock:
            now["running"] += 1
            now["most"] = max(now["most"], now["running"])
        release.wait(10)
        with lock:
            now["running"] -= 1

    def keyed(key, fn):
        fn.key = key
        return fn
    pool = FairExecutor(8, per_key=2, key_of=lambda fn: fn.key)
    mine = [pool.submit(keyed(1, lambda: blocking())) for _ in range(5)]
    other = pool.submit(keyed(2, lambda: "served"))
    assert other.result(10) == "served"      # while caller 1 holds its two
    time.sleep(0.2)
    assert now["most"] == 2 and sum(f.running() for f in mine) == 2
    release.set()
    for f in mine:
        f.result(10)
    assert now["most"] == 2
    pool.shutdown()


def test_a_caller_starts_at_most_its_rate_and_another_is_not_slowed():
    pool = FairExecutor(8, rate=20.0, key_of=lambda fn: fn.key)

    def keyed(key):
        def fn():
            return time.monotonic()
        fn.key = key
        return fn
    t0 = time.monotonic()
    burst = [pool.submit(keyed(1)) for _ in range(40)]   # 20 at once, then 20 a second
    other = pool.submit(keyed(2))
    assert other.result(10) - t0 < 0.5
    started = sorted(f.result(10) - t0 for f in burst)
    assert started[19] < 0.5 and 0.8 < started[-1] < 3.0, started
    pool.shutdown()


def test_a_call_past_its_callers_queue_limit_waits_its_turn_marked_to_refuse_itself():
    """Refusals are paced like the rest: a call that finds three waiting (the limit) is
    marked, and runs after them, not at once (a flood answered at once would be asked
    again at once, as fast as gRPC's serving thread could take it)."""
    release = threading.Event()
    marked: list = []
    order: list = []

    def keyed(key, name, fn=None):
        def run():
            order.append(name)
            return fn() if fn else name
        run.key, run.name = key, name
        return run
    pool = FairExecutor(2, per_key=1, max_queued=3, key_of=lambda fn: fn.key,
                        mark=lambda fn, waiting: marked.append((fn.name, waiting)))
    started = threading.Event()
    first = pool.submit(keyed(1, "first", lambda: started.set() or release.wait(10)))
    assert started.wait(10)
    queued = [pool.submit(keyed(1, f"q{i}")) for i in range(3)]
    over = pool.submit(keyed(1, "over"))
    time.sleep(0.2)
    assert not over.done() and marked == []     # waits behind its caller's running call
    release.set()
    assert over.result(10) == "over" and marked == [("over", 3)]
    assert [f.result(10) for f in queued] == ["q0", "q1", "q2"] and first.result(10)
    assert order == ["first", "q0", "q1", "q2", "over"]
    pool.shutdown()


def test_calls_past_a_queue_limit_never_go_ahead_of_another_callers_call():
    """With one thread busy: caller 1 at its queue limit sends 50 more (each to be
    refused), then caller 2 sends one: it runs in the next round, not after the 50."""
    release = threading.Event()
    order: list = []
    call = recorder(order, release)
    pool = FairExecutor(1, max_queued=2, key_of=lambda fn: fn.key, mark=lambda fn, n: None)
    first = pool.submit(call(1, "a", block=True))
    futures_ = [pool.submit(call(1, f"q{i}")) for i in range(2)]
    futures_ += [pool.submit(call(1, f"over{i}")) for i in range(50)]
    theirs = pool.submit(call(2, "b"))
    release.set()
    for f in [first, *futures_, theirs]:
        f.result(10)
    assert order.index("b") <= 3 and len(order) == 54, order[:6]
    pool.shutdown()


def test_a_uid_over_its_call_cap_is_refused_naming_the_setting():
    gate = CallGate(per_user=2)
    with gate.slot(1001, "ListJobs"), gate.slot(1001, "GetJob"):
        with pytest.raises(errors.ResourceExhausted,
                           match=r"uid 1001 has 2 calls in progress \(limits.calls_per_user 2\)"):
            with gate.slot(1001, "CancelJob"):
                pass
        with gate.slot(1002, "ListJobs"):  # another uid is not held back
            assert gate.open == 3
    assert gate.open == 0


def test_the_pool_learns_each_calls_uid_from_its_token_before_queueing_it():
    """A real gRPC server: the keys the pool is given are the token's uid, None for a
    call without a token (the health service) or with a forged one."""
    issuer = TokenIssuer(60)
    seen: list = []

    def key_of(fn):
        key = caller_of(fn)
        seen.append(key)
        return key

    path = os.path.join(tempfile.mkdtemp(prefix="ed-fp-", dir="/tmp"), "s.sock")
    server = grpc.server(FairExecutor(4, key_of=key_of), interceptors=[CallerTag(issuer)])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for token in (issuer.issue(1001, 1001, 1), issuer.issue(1002, 1002, 1),
                          None, "v1:0:0:1:9999999999:x:forged"):
                metadata = ((TOKEN_METADATA_KEY, token),) if token else ()
                stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
        deadline = time.monotonic() + 5
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [1001, 1002, None, None]
    finally:
        server.stop(0)
