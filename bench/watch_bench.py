"""Watches on one etcd: the daemon's store watching over the JSON gateway or the gRPC Watch stream.

    python bench/watch_bench.py [--watchers 50,200] [--writes 200] [--seconds 10]
                                [--bytes 1024] [--transports gateway,grpc]

Issue 33: every node of a job watches its job's keys, so each write is
delivered to every watcher, and etcd spends its CPU on deliveries (about
75 us each over the gateway). Each simulated node here is the daemon's own
store (``Etcd3Store``, a store per node as each daemon has one) watching one
prefix from a thread of its own, as a ``Follower`` does; one writer puts
``--writes`` records a second of ``--bytes`` each under that prefix, spread
evenly, so etcd delivers writes x watchers events a second:

  gateway   ``membership.watch_transport = gateway``: a POST to ``/v3/watch``,
            whose chunked HTTP answer carries each event as JSON (base64 key
            and value), one HTTP stream (and connection) per watcher;
  grpc      ``watch_transport = grpc`` (store/watch_stream.py): one ``Watch``
            stream on the store's gRPC channel, events as protobuf.

Per watcher count and transport, after a warm-up second, over ``--seconds``:
etcd's CPU (% of one core, from /proc through psutil) and its CPU per
delivery, this process's CPU (the simulator), the deliveries received
against those due, and the delivery latency (write -> watcher, p50/p99).
Prints one BENCH-ROW (bench/rows.py) for the largest count where both ran; never
asserts a timing; one real etcd 3.4 (tests/etcd_server.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from common import machine, revision  # noqa: E402
from rows import emit_row  # noqa: E402
from etcd_server import EtcdServer  # noqa: E402
from elasticd.store.etcd3 import Etcd3Store  # noqa: E402

PREFIX = "/bench/watch"


def busy(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def run(url: str, etcd_pid: int, watchers: int, writes: float, seconds: float, size: int,
        transport: str) -> dict:
    stores = [Etcd3Store([url], timeout=5.0, watch_transport=transport)
              for _ in range(watchers)]
    writer = Etcd3Store([url], timeout=5.0)
    _, start_rev = writer.list(PREFIX)
    stop = threading.Event()
    lock = threading.Lock()
    sent: dict[str, float] = {}
    got = {"n": 0, "lat": [], "counting": False}
    errors: list[str] = []

    def watch(store: Etcd3Store) -> None:
        try:
            for ev in store.watch(PREFIX, start_rev, stop):
                now = time.monotonic()
                if got["counting"]:
                    t = sent.get(ev.key)
                    with lock:
                        got["n"] += 1
                        if t is not None:
                            got["lat"].append(now - t)
        except Exception as exc:  # noqa: BLE001 - shown once
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=watch, args=(s,), daemon=True) for s in stores]
    for t in threads:
        t.start()
    time.sleep(1.0)                    # the streams open
    value = "x" * size
    period = 1.0 / writes
    etcd, me = psutil.Process(etcd_pid), psutil.Process()

    def write_for(span: float, tag: str) -> int:
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < span:
            at = t0 + n * period
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            key = f"{PREFIX}/{tag}{n % 64}"
            sent[key] = time.monotonic()
            writer.put(key, value)
            n += 1
        return n

    write_for(1.0, "w")                # warm-up
    time.sleep(0.5)
    e0, m0, t0 = busy(etcd), busy(me), time.monotonic()
    got["counting"] = True
    done = write_for(seconds, "k")
    time.sleep(0.5)                    # the last deliveries arrive
    got["counting"] = False
    e1, m1, span = busy(etcd), busy(me), time.monotonic() - t0
    stop.set()
    for t in threads:
        t.join(5)
    for s in stores:
        s.close()
    writer.delete_prefix(PREFIX)
    writer.close()
    lat = sorted(got["lat"]) or [float("nan")]
    deliveries = got["n"]
    return {"etcd": (e1 - e0) / span * 100, "sim": (m1 - m0) / span * 100,
            "etcd_us": (e1 - e0) / max(deliveries, 1) * 1e6, "writes": done / seconds,
            "got": deliveries, "due": done * watchers, "p50": lat[len(lat) // 2] * 1000,
            "p99": lat[int(len(lat) * 0.99)] * 1000, "errors": errors}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--watchers", default="50,200", help="watcher counts, comma separated")
    ap.add_argument("--writes", type=float, default=200.0, help="records written a second")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per run")
    ap.add_argument("--bytes", type=int, default=1024, help="bytes of each record's value")
    ap.add_argument("--transports", default="gateway,grpc", help="of gateway, grpc")
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.watchers.split(",") if x]
    transports = [t for t in args.transports.split(",") if t]
    if not set(transports) <= {"gateway", "grpc"}:
        ap.error(f"--transports: of gateway, grpc, not {args.transports}")
    print(f"watch_bench: {machine()}; elasticd {revision()}; {args.writes:g} writes/s of "
          f"{args.bytes} B, {args.seconds:g} s windows", flush=True)
    rows = []
    with EtcdServer() as etcd:
        for n in ns:
            for transport in transports:
                r = run(etcd.url, etcd.proc.pid, n, args.writes, args.seconds, args.bytes,
                        transport)
                r.update(n=n, transport=transport, load=os.getloadavg()[0])
                rows.append(r)
                print(f"watchers={n:>4} {transport:<8} etcd {r['etcd']:5.1f} % of a core, "
                      f"{r['etcd_us']:5.1f} us a delivery; simulator {r['sim']:5.1f} %; "
                      f"writes {r['writes']:.0f}/s; deliveries {r['got']} of {r['due']}; "
                      f"latency p50 {r['p50']:.1f} ms p99 {r['p99']:.1f} ms; "
                      f"load {r['load']:.1f}", flush=True)
                if r["errors"]:
                    print(f"    {len(r['errors'])} watch(es) failed; first: "
                          f"{r['errors'][0][:300]}", flush=True)
    print("\n| watchers | transport | etcd CPU | etcd CPU a delivery | simulator CPU | "
          "deliveries (due) | p50 / p99 | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['transport']} | {r['etcd']:.0f} % | {r['etcd_us']:.0f} us | "
              f"{r['sim']:.0f} % | {r['got']} ({r['due']}) | {r['p50']:.1f} / {r['p99']:.1f} ms "
              f"| {r['load']:.1f} |")
    by = {(r["n"], r["transport"]): r for r in rows}
    both = []
    for n in ns:
        g, c = by.get((n, "gateway")), by.get((n, "grpc"))
        if g and c and c["etcd_us"] > 0:
            both.append((n, g, c))
            print(f"watchers={n}: etcd CPU a delivery, gateway / grpc: "
                  f"{g['etcd_us'] / c['etcd_us']:.1f}x")
    if both:
        n, g, c = both[-1]
        emit_row("watch-delivery",
                 elasticd=f"{c['etcd_us']:.0f} us over gRPC, {g['etcd_us']:.0f} us over the "
                          f"gateway ({n} watchers; {c['got']} and {g['got']} deliveries of "
                          f"{c['due']} and {g['due']})",
                 ratio=f"{g['etcd_us'] / c['etcd_us']:.1f}x less etcd CPU over gRPC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
