"""Node leases on one etcd: the daemon's store refreshing over etcd's JSON gateway or its gRPC stream.

    python bench/lease_bench.py [--nodes 100,300,1000] [--seconds 10] [--refresh 1.0]
                                [--apis gateway,grpc,grpc-aio]

Issue 33 asks which of etcd's two APIs keeps a thousand nodes' leases for
less of etcd's CPU. Each simulated node holds one lease (TTL 3 s, as
``membership.lease_ttl``; ``--ttl``) and refreshes it every ``--refresh`` seconds (as
``membership.refresh_interval``), the nodes spread evenly over the period:

  gateway   the daemon's own store, ``Etcd3Store.refresh_lease`` with
            ``membership.lease_transport = gateway``: one POST to
            ``/v3/lease/keepalive`` a refresh (the gateway opens an internal
            gRPC stream for each), a store (its HTTP connection) per node,
            refreshes made by a pool of threads;
  grpc      the daemon's own store with ``lease_transport = grpc`` (the
            default; store/lease_stream.py): per node a store, so one gRPC
            channel and one ``LeaseKeepAlive`` stream kept open, one message a
            refresh, made by the same pool of threads;
  grpc-aio  etcd's gRPC Lease service driven directly, per node its own channel
            and stream (grpc.aio, one event loop), with the stubs the store
            uses (daemon/elasticd/store/etcdpb, from protos/): what the stream
            costs without the store's threads.

Per N and API, after a warm-up of one period, over ``--seconds``: etcd's
CPU (% of one core, from /proc through psutil), this process's CPU (the
simulator: where it, not etcd, is the limit), the refreshes done per second
against those due, the refreshes that failed or came more than half a
period late, and the refresh latency (p50/p99). Leases are granted through
the gateway for all (not measured) and revoked after. Never asserts a
timing; one real etcd 3.4 (tests/etcd_server.py).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine, revision  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from elasticd.store.etcd3 import Etcd3Store  # noqa: E402



class Meter:
    """CPU seconds of etcd and of this process, and the refreshes counted, over a window."""

    def __init__(self, etcd_pid: int):
        self._etcd = psutil.Process(etcd_pid)
        self._me = psutil.Process()
        self.lock = threading.Lock()
        self.done = self.failed = self.late = 0
        self.latencies: list[float] = []
        self.counting = False
        self.first_error = ""

    @staticmethod
    def _busy(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system + getattr(t, "children_user", 0) * 0

    def count(self, ok: bool, latency: float, late: bool) -> None:
        if not self.counting:
            return
        with self.lock:
            if ok:
                self.done += 1
                self.latencies.append(latency)
            else:
                self.failed += 1
            self.late += late

    def window(self, seconds: float) -> dict:
        e0, m0, t0 = self._busy(self._etcd), self._busy(self._me), time.monotonic()
        self.counting = True
        time.sleep(seconds)
        self.counting = False
        e1, m1, span = self._busy(self._etcd), self._busy(self._me), time.monotonic() - t0
        lat = sorted(self.latencies) or [float("nan")]
        return {"etcd": (e1 - e0) / span * 100, "sim": (m1 - m0) / span * 100,
                "rate": self.done / span, "failed": self.failed, "late": self.late,
                "p50": lat[len(lat) // 2] * 1000, "p99": lat[int(len(lat) * 0.99)] * 1000}


def due(i: int, n: int, period: float, start: float, k: int) -> float:
    return start + period * (k + i / n)


def run_store(url: str, n: int, period: float, seconds: float, meter: Meter, ttl: int,
              transport: str) -> dict:
    stores = [Etcd3Store([url], timeout=5.0, lease_transport=transport) for _ in range(n)]
    leases = [s.grant_lease(ttl) for s in stores]
    stop = threading.Event()
    threads = min(64, n)
    start = time.monotonic() + 0.5

    def refresher(j: int) -> None:
        mine = range(j, n, threads)
        k = 0
        while not stop.is_set():
            for i in mine:
                at = due(i, n, period, start, k)
                wait = at - time.monotonic()
                if wait > 0 and stop.wait(wait):
                    return
                t = time.monotonic()
                try:
                    stores[i].refresh_lease(leases[i])
                    ok = True
                except Exception as exc:  # noqa: BLE001 - counted, the first one shown
                    ok = False
                    meter.first_error = meter.first_error or f"{type(exc).__name__}: {exc}"
                meter.count(ok, time.monotonic() - t, t - at > period / 2)
            k += 1

    pool = [threading.Thread(target=refresher, args=(j,), daemon=True) for j in range(threads)]
    for t in pool:
        t.start()
    time.sleep(0.5 + period)           # warm-up: one period
    result = meter.window(seconds)
    stop.set()
    for t in pool:
        t.join(10)
    for s, lease in zip(stores, leases):
        try:
            s.revoke_lease(lease)
        except Exception:
            pass
        s.close()
    return result


def run_grpc_aio(url: str, n: int, period: float, seconds: float, meter: Meter,
                 ttl: int) -> dict:
    import grpc
    from elasticd.store.etcdpb import lease_pb2, lease_pb2_grpc
    granter = Etcd3Store([url], timeout=5.0)
    leases = [granter.grant_lease(ttl) for _ in range(n)]
    target = url.split("://", 1)[-1]
    result: dict = {}

    async def node(i: int, start: float, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            call = lease_pb2_grpc.LeaseStub(channel).LeaseKeepAlive()
            k = 0
            while not stop.is_set():
                at = due(i, n, period, start, k)
                wait = at - time.monotonic()
                if wait > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                        break
                    except asyncio.TimeoutError:
                        pass
                t = time.monotonic()
                try:
                    await call.write(lease_pb2.LeaseKeepAliveRequest(ID=leases[i].id))
                    resp = await call.read()
                    ok = resp is not grpc.aio.EOF and resp.TTL > 0
                except grpc.RpcError:
                    ok = False
                meter.count(ok, time.monotonic() - t, t - at > period / 2)
                k += 1
            call.cancel()

    async def main() -> None:
        stop = asyncio.Event()
        start = time.monotonic() + 0.5
        tasks = [asyncio.create_task(node(i, start, stop)) for i in range(n)]
        await asyncio.sleep(0.5 + period)
        loop = asyncio.get_running_loop()
        result.update(await loop.run_in_executor(None, meter.window, seconds))
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    for lease in leases:
        try:
            granter.revoke_lease(lease)
        except Exception:
            pass
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="100,300,1000", help="N values, comma separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    ap.add_argument("--refresh", type=float, default=1.0,
                    help="seconds between a node's refreshes (membership.refresh_interval)")
    ap.add_argument("--ttl", type=int, default=3,
                    help="lease TTL (membership.lease_ttl); longer where the simulator takes "
                         "more than a TTL to open N stores")
    ap.add_argument("--apis", default="gateway,grpc", help="of gateway, grpc, grpc-aio")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.nodes.split(",") if x]
    apis = [a for a in args.apis.split(",") if a]
    if not set(apis) <= {"gateway", "grpc", "grpc-aio"}:
        ap.error(f"--apis: of gateway, grpc, grpc-aio, not {args.apis}")
    print(f"lease_bench: {machine()}; elasticd {revision()}; refresh every {args.refresh:g} s, "
          f"TTL {args.ttl} s, {args.seconds:g} s windows", flush=True)
    rows = []
    with EtcdServer() as etcd:
        for n in ns:
            for api in apis:
                meter = Meter(etcd.proc.pid)
                r = (run_grpc_aio(etcd.url, n, args.refresh, args.seconds, meter, args.ttl)
                     if api == "grpc-aio" else
                     run_store(etcd.url, n, args.refresh, args.seconds, meter, args.ttl, api))
                r.update(n=n, api=api, want=n / args.refresh, load=os.getloadavg()[0])
                rows.append(r)
                print(f"N={n:>5} {api:<9} etcd {r['etcd']:5.1f} % of a core, simulator "
                      f"{r['sim']:5.1f} %, refreshes {r['rate']:7.1f}/s of {r['want']:.0f} due, "
                      f"failed {r['failed']}, late {r['late']}, latency p50 {r['p50']:.1f} ms "
                      f"p99 {r['p99']:.1f} ms, load {r['load']:.1f}", flush=True)
                if meter.first_error:
                    print(f"    first failure: {meter.first_error[:300]}", flush=True)
                time.sleep(min(args.ttl, 5) + 1)   # what the last run left ends before the next
    print("\n| N | API | etcd CPU | simulator CPU | refreshes/s (due) | failed | late | "
          "p50 / p99 | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['api']} | {r['etcd']:.0f} % | {r['sim']:.0f} % | "
              f"{r['rate']:.0f} ({r['want']:.0f}) | {r['failed']} | {r['late']} | "
              f"{r['p50']:.1f} / {r['p99']:.1f} ms | {r['load']:.1f} |")
    by = {(r["n"], r["api"]): r for r in rows}
    for n in ns:
        g, c = by.get((n, "gateway")), by.get((n, "grpc"))
        if g and c and c["etcd"] > 0:
            print(f"N={n}: etcd CPU per refresh, gateway / grpc: "
                  f"{(g['etcd'] / max(g['rate'], 1e-9)) / (c['etcd'] / max(c['rate'], 1e-9)):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
