"""What the daemon's limits cost and protect: idle connections, list under streams.

    python bench/limits_bench.py [--connections 5000] [--calls 500]

(a) RSS of the daemon (psutil) before and after --connections idle HTTP/2
    connections to the control socket (each sends the client preface and an
    empty SETTINGS frame, then nothing), once with the default
    limits.max_connections (connections past it are closed by the daemon at
    once) and once with the cap raised above --connections. Says how many
    connections the daemon kept open (those the bench still sees open).
(b) ListJobs latency (p50/p99 over --calls calls, one client) with nothing
    else going on, and while one uid (this one) holds limits.streams_per_user
    ``logs -f`` streams and tries as many more (refused at once); the
    ratio of the two p99s.

Prints a table; never fails on a number.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import threading
import time

import grpc
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BenchDaemon, machine, percentile, revision, table  # noqa: E402

from elasticctl.client import Client, CtlError, fetch_token  # noqa: E402
from elasticd.config import LimitsSettings  # noqa: E402
from elasticd.v1 import control_pb2 as pb  # noqa: E402
from elasticd.v1 import control_pb2_grpc as pb_grpc  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 1e6


def open_idle(path: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            s.sendall(PREFACE)
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def still_open(socks: list[socket.socket]) -> int:
    """Connections the daemon has not closed (no EOF waiting on them)."""
    alive = 0
    for s in socks:
        s.setblocking(False)
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break  # EOF: the daemon closed it
        except BlockingIOError:
            alive += 1  # only the daemon's SETTINGS and ack, no EOF
        except OSError:
            pass
    return alive


def idle_connections(n: int, cap: int | None) -> list:
    extra = ("--set", f"limits.max_connections={cap}") if cap else ()
    d = BenchDaemon(extra_args=extra)
    d.start()
    try:
        time.sleep(1.0)
        before = rss_mb(d.pid)
        socks = open_idle(d.socket, n)
        time.sleep(3.0)
        after = rss_mb(d.pid)
        alive = still_open(socks)
        t0 = time.monotonic()
        try:
            with Client(d.socket) as c:  # a new client: still served?
                c.call("ListJobs", pb.ListJobsRequest())
            answered = f"{(time.monotonic() - t0) * 1e3:.1f}"
        except CtlError as exc:
            answered = f"refused ({str(exc)[:60]}...)"
        for s in socks:
            s.close()
        return [f"{n} idle, max_connections {cap or LimitsSettings().max_connections}",
                f"{before:.0f}", f"{after:.0f}", f"{(after - before) * 1e3 / max(alive, 1):.1f}",
                alive, answered]
    finally:
        d.stop()


def list_latency(calls: int, hold: bool) -> tuple[float, float, int, int]:
    # One client's calls back to back: no pacing of its uid (limits.call_rate_per_user).
    d = BenchDaemon(extra_args=("--set", "limits.call_rate_per_user=1000000"))
    d.start()
    stop = threading.Event()
    opened, refused = [], []
    try:
        job = d.submit(["/bin/sh", "-c", "echo hi; sleep 600"], cwd=d.root)
        token = fetch_token(d.socket)
        per_user = LimitsSettings().streams_per_user

        def follow():
            ch = grpc.insecure_channel(f"unix:{d.socket}")
            call = pb_grpc.ControlStub(ch).Logs(pb.LogsRequest(id=job, follow=True),
                                                metadata=(("elasticd-token", token),))
            try:
                for _ in call:
                    opened.append(1)
                    stop.wait()
                    break
            except grpc.RpcError:
                refused.append(1)
            finally:
                call.cancel()
                ch.close()

        threads = []
        if hold:
            threads = [threading.Thread(target=follow, daemon=True) for _ in range(2 * per_user)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while len(opened) + len(refused) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.05)
        c = d.client()
        for _ in range(20):
            c.call("ListJobs", pb.ListJobsRequest())
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            c.call("ListJobs", pb.ListJobsRequest())
            times.append(time.perf_counter() - t0)
        stop.set()
        for t in threads:
            t.join(5)
        return percentile(times, 50), percentile(times, 99), len(opened), len(refused)
    finally:
        stop.set()
        d.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=5000)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"# {machine()} rev {revision()}")
    rows = [idle_connections(args.connections, None),
            idle_connections(args.connections, args.connections + 100)]
    print(table(rows, ["connections", "RSS before MB", "RSS after MB", "KB per open conn",
                       "open at the daemon", "list ms"]))
    base = list_latency(args.calls, hold=False)
    held = list_latency(args.calls, hold=True)
    print(table([["no streams", f"{base[0] * 1e3:.2f}", f"{base[1] * 1e3:.2f}", "-", "-"],
                 ["one uid at its stream cap", f"{held[0] * 1e3:.2f}", f"{held[1] * 1e3:.2f}",
                  held[2], held[3]]],
                ["ListJobs", "p50 ms", "p99 ms", "streams open", "streams refused"]))
    print(f"p99 ratio (held / none): {held[1] / base[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
