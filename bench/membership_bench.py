"""What cluster membership costs etcd, and how fast a lost node is noticed.

    python bench/membership_bench.py [--nodes 3] [--seconds 20] [--trials 10]

Everything is real: one etcd server (tests/etcd_server.py: loopback ports,
data under /dev/shm) and ``python -m elasticd --etcd ...`` daemons.

(a) etcd requests per node per second at steady state: --nodes daemons,
    idle, then each running one job (``/bin/sleep``); after a warm-up, two
    scrapes --seconds apart of
      - each daemon's own count of store requests by operation
        (``elasticd_store_request_duration_seconds_count{operation}``; a
        watch is one long stream and is not counted there), and
      - etcd's own count of the gRPC calls it started, by method
        (``grpc_server_started_total{grpc_method}`` on its client port;
        every v3 gateway request is one of them, watches included).
    Goal: one lease refresh per refresh interval per node, nothing else.
(b) node-loss detection: an observer daemon and a victim daemon; the victim
    is killed with SIGKILL at a random point of its refresh cycle, and the
    time until the observer's ListNodes says ``lost`` (polled every 10 ms)
    is taken (and when etcd itself dropped the key, polled alongside);
    median of --trials, at the default settings and with
    ``membership.lease_ttl=1, membership.refresh_interval=0.25,
    etcd.request_timeout=0.5``. Goals: <= 3 s by default, <= 1 s possible.

Prints tables with PASS/MISS; never fails on a miss.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
import urllib.request
import uuid

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
from common import BenchDaemon, machine, median, percentile, revision, secs, table  # noqa: E402
from rows import emit_row  # noqa: E402
from daemons import cluster_key_args  # noqa: E402
from etcd_server import EtcdServer, etcd_binary, free_port  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from elasticd.store import open_store  # noqa: E402
from elasticd.v1 import control_pb2 as pb  # noqa: E402

SHORT = ("--set", "membership.lease_ttl=1", "--set", "membership.refresh_interval=0.25",
         "--set", "etcd.request_timeout=0.5")
GOAL_DETECT_DEFAULT = 3.0
GOAL_DETECT_SHORT = 1.0


class ClusterDaemon(BenchDaemon):
    """A BenchDaemon joined to etcd instead of --standalone, metrics on a free port."""

    def __init__(self, etcd_url: str, prefix: str, node_id: str, extra: tuple = (),
                 metrics: bool = False):
        self.metrics_port = free_port() if metrics else 0
        super().__init__(node_id=node_id, slots=4,
                         extra_args=("--etcd-prefix", prefix,
                                     "--metrics-port", str(self.metrics_port), *extra))
        self.node_id = node_id
        self.args[self.args.index("--standalone")] = "--etcd"
        self.args.insert(1, etcd_url)
        self.args += cluster_key_args()  # a daemon on etcd needs the cluster key

    def states(self) -> dict[str, str]:
        resp = self.client().call("ListNodes", pb.ListNodesRequest())
        return {n.node_id: n.state for n in resp.nodes}

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()


def scrape(url: str) -> list:
    with urllib.request.urlopen(url, timeout=5) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def samples(url: str, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed by ``label``."""
    out: dict[str, float] = {}
    for fam in scrape(url):
        for s in fam.samples:
            if s.name == name:
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


def wait_until(pred, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except Exception:  # noqa: BLE001 - not yet
            pass
        time.sleep(step)
    return False


# -- (a) steady-state requests ---------------------------------------------------
def bench_requests(etcd: EtcdServer, nodes: int, seconds: float, warmup: float) -> list[list]:
    prefix = f"/bench{uuid.uuid4().hex[:8]}"
    ds = [ClusterDaemon(etcd.url, prefix, f"node-{i}", metrics=True) for i in range(nodes)]
    for d in ds:
        d.start()
    want = {d.node_id: "ready" for d in ds}
    if not all(wait_until(lambda d=d: d.states() == want, 10) for d in ds):
        raise RuntimeError("the daemons never saw each other ready")
    rows = []
    try:
        for phase in ("idle", "one running job per node"):
            if phase != "idle":
                for d in ds:
                    req = pb.SubmitRequest(command=["/bin/sleep", "3600"], cwd=d.root,
                                           env=dict(os.environ), nproc_per_node=1,
                                           min_nodes=1, max_nodes=1, nodes=[d.node_id])
                    d.client().call("Submit", req)
            time.sleep(warmup)
            ours0 = [samples(f"http://127.0.0.1:{d.metrics_port}/metrics",
                             "elasticd_store_request_duration_seconds_count", "operation")
                     for d in ds]
            etcd0 = samples(etcd.url + "/metrics", "grpc_server_started_total", "grpc_method")
            t0 = time.monotonic()
            time.sleep(seconds)
            ours1 = [samples(f"http://127.0.0.1:{d.metrics_port}/metrics",
                             "elasticd_store_request_duration_seconds_count", "operation")
                     for d in ds]
            etcd1 = samples(etcd.url + "/metrics", "grpc_server_started_total", "grpc_method")
            span = time.monotonic() - t0
            per_op: dict[str, float] = {}
            for a, b in zip(ours0, ours1):
                for op, n in delta(b, a).items():
                    per_op[op] = per_op.get(op, 0.0) + n
            etcd_d = delta(etcd1, etcd0)
            total_ours = sum(per_op.values()) / nodes / span
            total_etcd = sum(etcd_d.values()) / nodes / span
            writes = sum(n for op, n in per_op.items() if op not in ("get", "list", "health"))
            ops = ", ".join(f"{op} {n / nodes / span:.2f}" for op, n in sorted(per_op.items()))
            meth = ", ".join(f"{m} {n / nodes / span:.2f}" for m, n in sorted(etcd_d.items()))
            refresh = per_op.get("refresh_lease", 0.0) / nodes / span
            # The goal is about writes: one lease refresh per interval, no other write.
            ok = abs(refresh - 1.0) < 0.1 and abs(writes / nodes / span - refresh) < 0.05
            rows.append([phase, f"{total_ours:.2f}", f"{writes / nodes / span:.2f}", ops,
                         f"{total_etcd:.2f}", meth, "PASS" if ok else "MISS"])
    finally:
        for d in ds:
            d.stop()
    return rows


# -- (b) detection time -------------------------------------------------------------
def bench_detect(etcd: EtcdServer, trials: int, extra: tuple) -> tuple[list, list]:
    """(kill -> the observer lists the victim lost, kill -> etcd has expired its key)."""
    prefix = f"/bench{uuid.uuid4().hex[:8]}"
    observer = ClusterDaemon(etcd.url, prefix, "observer", extra)
    observer.start()
    store = open_store("etcd3", etcd.endpoints, timeout=2.0)
    times, gone = [], []
    try:
        for i in range(trials):
            victim = ClusterDaemon(etcd.url, prefix, f"victim-{i}", extra)
            victim.start()
            if not wait_until(lambda: observer.states().get(victim.node_id) == "ready", 10):
                raise RuntimeError(f"the observer never saw {victim.node_id}:\n"
                                   f"{observer.log()[-2000:]}\n{victim.log()[-2000:]}")
            time.sleep(1.0 + random.random())  # kill at a random point of the refresh cycle
            key = f"{prefix}/v1/nodes/{victim.node_id}"
            t0 = time.monotonic()
            victim.kill9()
            expired = seen = None
            while seen is None and time.monotonic() - t0 < 30:
                if expired is None and store.get(key) is None:
                    expired = time.monotonic() - t0
                if observer.states().get(victim.node_id) == "lost":
                    seen = time.monotonic() - t0
                time.sleep(0.005)
            if seen is None:
                raise RuntimeError(f"victim-{i} not seen lost within 30 s:\n"
                                   f"{observer.log()[-2000:]}")
            times.append(seen)
            gone.append(expired if expired is not None else seen)
            victim.client().close()  # not stop(): common.kill_owned() would take the observer too
    finally:
        store.close()
        observer.stop()
    return times, gone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3, help="daemons for (a) (default 3)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="measuring window of (a) per phase (default 20)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before each window")
    ap.add_argument("--trials", type=int, default=10, help="kills per setting in (b)")
    args = ap.parse_args(argv)
    if etcd_binary() is None:
        print("no etcd binary (install etcd or set ELASTICD_TEST_ETCD)", file=sys.stderr)
        return 2
    print(f"membership bench: {machine()}; elasticd {revision()}")
    with EtcdServer() as etcd:
        print(f"\n(a) etcd requests per node per second, {args.nodes} daemons, "
              f"{args.seconds:g} s window (default settings: one refresh per 1 s)")
        rows = bench_requests(etcd, args.nodes, args.seconds, args.warmup)
        print(table(rows, ["phase", "daemon-counted req/node/s", "of them writes",
                           "by operation (daemon)", "etcd gRPC calls/node/s",
                           "by method (etcd)", "goal: writes = 1 refresh/s"]))

        print(f"\n(b) node-loss detection after kill -9, {args.trials} trials each")
        out = []
        for name, extra, goal in (("default (ttl 3, refresh 1)", (), GOAL_DETECT_DEFAULT),
                                  ("short (ttl 1, refresh 0.25, timeout 0.5)", SHORT,
                                   GOAL_DETECT_SHORT)):
            times, gone = bench_detect(etcd, args.trials, extra)
            med = median(times)
            out.append([name, secs(med, 2), secs(min(times), 2),
                        secs(percentile(times, 90), 2), secs(max(times), 2),
                        secs(median(gone), 2),
                        secs(median([t - g for t, g in zip(times, gone)]), 3),
                        f"<= {goal:g} s", "PASS" if med <= goal else "MISS"])
            print(f"  {name}: " + " ".join(f"{t:.2f}" for t in times))
        print(table(out, ["setting", "median", "min", "p90", "max", "etcd expiry (median)",
                          "then watch -> daemon (median)", "goal", ""]))
        emit_row("node-loss-noticed", elasticd=f"median {out[0][1]} (TTL 3 s; {out[1][1]} at "
                 f"TTL 1 s), {args.trials} kills each")
        print("etcd 3.4 looks for expired leases every 500 ms, so detection is the TTL minus "
              "the age of the last refresh, plus up to 0.5 s, plus the watch.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
