"""Rendezvous formation: elasticd's cluster rendezvous vs torch's own handlers, on one etcd.

    python bench/rendezvous_bench.py [--n 2,4,8,16,32,64] [--max-n N] [--reps 1]
                                     [--impls ours,ours-shared-view,torch-etcd,torch-etcd-v2,c10d]
                                     [--timeout 240]

N participants (simulated nodes, one thread each, all in one process per
measurement) join one round of one job, min = max = N, on one real etcd 3.4
(tests/etcd_server.py: a single member on loopback, v2 API enabled, data in
/dev/shm). Every participant is set up first (its etcd client, its handler,
for ours its watch); then they are released together and each calls its
handler's "next round" once. Measured: seconds from the release until the
LAST participant has its result (rank, world size, master), and the etcd
requests and writes the round cost, read from etcd's own /metrics before
and after:

  requests  v3 API: sum of grpc_server_started_total (unary calls and streams
            started; our store speaks to etcd's v3 JSON gateway, which etcd
            counts there too); v2 API: sum of etcd_http_received_total (every
            v2 HTTP request, long-poll watches included)
  writes    etcd_server_proposals_committed_total: raft proposals, i.e. writes
            that went through consensus (same meaning for v2 and v3)

Implementations (each measurement in a fresh Python process):
  ours              elasticd.rendezvous.round.ClusterRendezvous.next_round on
                    the etcd3 store, ONE JobsView (one watch stream) PER
                    participant, as every daemon runs one; each participant
                    writes its own join key (with its own lease); the decider
                    closes the round with one compare-and-swap
  ours-shared-view  the same with one JobsView shared by all participants (each
                    still has its own store client): what one participant costs
                    without the simulation paying N watch streams x N events
                    in one process
  torch-etcd        torch.distributed.elastic.rendezvous.etcd_rendezvous (torchrun
                    --rdzv-backend etcd): etcd v2 API via python-etcd
  torch-etcd-v2     torch's dynamic rendezvous over EtcdRendezvousBackend
                    (--rdzv-backend etcd-v2): etcd v2 API via python-etcd
  c10d              torch's dynamic rendezvous over a TCPStore (--rdzv-backend
                    c10d; the first participant hosts the store); no etcd, so
                    no etcd counts
  torch handlers run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so rank 0 does
  not also start a TCPStore server for the workers (ours does not either).

Prints a table, the ratios torch / ours, and the growth of ours per doubling
of N. Never asserts a timing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

IMPLS = ("ours", "ours-shared-view", "torch-etcd", "torch-etcd-v2", "c10d")
ETCD_IMPLS = {"ours": "v3", "ours-shared-view": "v3", "torch-etcd": "v2", "torch-etcd-v2": "v2"}


# ---------------------------------------------------------------- etcd counters

def scrape(url: str) -> dict[str, float]:
    """The etcd counters this benchmark reads, from its /metrics page."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r'grpc_server_started_total\{grpc_method="(\w+)",'
                     r'grpc_service="[\w.]+",grpc_type="\w+"\} (\S+)', line)
        if m and "Health" not in line:
            out["v3:" + m.group(1)] = out.get("v3:" + m.group(1), 0) + float(m.group(2))
            continue
        m = re.match(r'etcd_http_received_total\{method="(\w+)"\} (\S+)', line)
        if m:
            out["v2:" + m.group(1)] = float(m.group(2))
            continue
        if line.startswith("etcd_server_proposals_committed_total "):
            out["writes"] = float(line.split()[1])
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    keys = set(before) | set(after)
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys
            if after.get(k, 0) != before.get(k, 0)}


# ---------------------------------------------------------------- participants

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_ours(n: int, url: str, shared_view: bool):
    """N participants of one job; returns (calls, check, cleanup)."""
    from elasticd.rendezvous.round import ClusterRendezvous, create_job
    from elasticd.rendezvous.protocol import JobLimits
    from elasticd.rendezvous.view import JobsView
    from elasticd.store import open_store
    from elasticd.trust.sealed import SealedRecords

    prefix = f"/bench-{uuid.uuid4().hex[:8]}"
    records = SealedRecords(os.urandom(32), prefix)   # sealed as the daemons' records are
    job_id = "j" + uuid.uuid4().hex[:7]
    limits = JobLimits(min_nodes=n, max_nodes=n, max_restarts=0, last_call=0.0,
                       join_timeout=3600.0)
    stores, views = [], []

    def new_view():
        store = open_store("etcd3", [url], prefix=prefix, timeout=30.0)
        view = JobsView(store, records=records, retry=0.5)
        view.start()
        stores.append(store)
        views.append(view)
        return view

    shared = new_view() if shared_view else None
    parts = []
    for i in range(n):
        store = open_store("etcd3", [url], prefix=prefix, timeout=30.0)
        stores.append(store)
        lease = store.grant_lease(60)
        view = shared or new_view()
        parts.append(ClusterRendezvous(store, view, job_id, f"node{i:03d}", "127.0.0.1", 1,
                                       (lambda lease=lease: lease), limits, poll=0.5))
    for view in views:
        if not view.synced.wait(30):
            raise RuntimeError("a jobs view did not sync with etcd")
    create_job(stores[0], job_id, {"id": job_id, "nodes": []}, time.time(), records=records)
    deadline = time.monotonic() + 30
    while not all((k := v.job(job_id)) is not None and k.state is not None for v in views):
        if time.monotonic() > deadline:
            raise RuntimeError("the views did not see the job")
        time.sleep(0.01)
    stop = threading.Event()
    calls = [(lambda p=p: p.next_round(stop)) for p in parts]

    def check(results):
        ranks = sorted(r.place.group_rank for r in results)
        worlds = {(r.place.group_world_size, r.place.master_addr, r.place.master_port)
                  for r in results}
        return ranks == list(range(n)) and len(worlds) == 1

    def cleanup():
        stop.set()
        for v in views:
            v.stop()
        for s in stores:
            s.close()
    return calls, check, cleanup


def setup_torch(n: int, impl: str, url: str):
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    import logging

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)

    run_id = "r" + uuid.uuid4().hex[:8]
    host_port = url.split("://", 1)[1]
    backend = {"torch-etcd": "etcd", "torch-etcd-v2": "etcd-v2", "c10d": "c10d"}[impl]
    if impl == "c10d":
        host_port = f"127.0.0.1:{free_port()}"
    # min = max = N: the round completes when the N-th joins, so the last call
    # (which must be positive for the dynamic handler) never applies.
    extra = {"join_timeout": 3600, "last_call_timeout": 1, "read_timeout": 3600}
    if impl == "torch-etcd":
        extra = {"timeout": 3600, "last_call_timeout": 0,
                 "etcd_prefix": f"/torchelastic/bench-{run_id}"}
    handlers = []
    for i in range(n):
        params = RendezvousParameters(backend=backend, endpoint=host_port, run_id=run_id,
                                      min_nodes=n, max_nodes=n, local_addr="127.0.0.1",
                                      **extra)
        handlers.append(get_rendezvous_handler(params))
    calls = [h.next_rendezvous for h in handlers]

    def check(results):
        ranks = sorted(r.rank for r in results)
        return ranks == list(range(n)) and {r.place.world_size for r in results} == {n}

    def cleanup():
        for h in handlers:
            try:
                if hasattr(h, "_stop_heartbeats"):
                    h._stop_heartbeats()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    return calls, check, cleanup


def measure(impl: str, n: int, url: str, timeout: float) -> dict:
    """One round of N participants, in this process."""
    if impl in ("ours", "ours-shared-view"):
        calls, check, cleanup = setup_ours(n, url, impl == "ours-shared-view")
    else:
        calls, check, cleanup = setup_torch(n, impl, url)
    results: list = [None] * n
    times: list = [None] * n
    errors: list = []
    barrier = threading.Barrier(n + 1)
    start = [0.0]

    def run(i):
        barrier.wait()
        try:
            results[i] = calls[i]()
            times[i] = time.perf_counter() - start[0]
        except Exception as exc:  # noqa: BLE001 - reported
            errors.append(f"participant {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # every thread is at the barrier
    before = scrape(url) if impl in ETCD_IMPLS else {}
    start[0] = time.perf_counter()
    barrier.wait()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    done = [x for x in times if x is not None]
    after = scrape(url) if impl in ETCD_IMPLS else {}
    out = {"impl": impl, "n": n, "finished": len(done), "errors": errors[:3]}
    if len(done) == n:
        out.update(time_all=max(done), time_mean=sum(done) / n,
                   ok=bool(check(results)))
    else:
        out.update(time_all=None, ok=False,
                   errors=errors[:3] or [f"only {len(done)} of {n} done within {timeout}s"])
    d = delta(before, after)
    if impl in ETCD_IMPLS:
        api = ETCD_IMPLS[impl]
        out["requests"] = sum(v for k, v in d.items() if k.startswith(api + ":"))
        out["by_method"] = {k: v for k, v in d.items() if k.startswith(api + ":")}
        out["writes"] = d.get("writes", 0)
    try:
        cleanup()
    except Exception:  # noqa: BLE001 - best effort
        pass
    return out


# ---------------------------------------------------------------- the parent

def run_child(impl: str, n: int, url: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, str(n), url,
           "--timeout", str(timeout)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "n": n, "time_all": None, "ok": False,
                "errors": [f"no answer within {timeout + 120:.0f}s"]}
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"impl": impl, "n": n, "time_all": None, "ok": False,
            "errors": [f"child exited {res.returncode}: {res.stderr[-500:]}"]}


def fmt_t(x) -> str:
    return "-" if x is None else (f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s")


def fmt_n(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="2,4,8,16,32,64", help="participant counts")
    p.add_argument("--max-n", type=int, default=0, help="drop counts above this")
    p.add_argument("--reps", type=int, default=1, help="repetitions (median reported)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds one round may take before it counts as not done")
    p.add_argument("--child", nargs=3, metavar=("IMPL", "N", "URL"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        impl, n, url = args.child[0], int(args.child[1]), args.child[2]
        print(json.dumps(measure(impl, n, url, args.timeout)), flush=True)
        os._exit(0)  # torch handlers leave non-daemon timer threads behind

    from common import machine, revision
    from etcd_server import EtcdServer

    counts = [int(x) for x in args.n.split(",") if x]
    if args.max_n:
        counts = [c for c in counts if c <= args.max_n]
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            p.error(f"unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    print(f"rendezvous formation, min = max = N, one etcd 3.4 on loopback; {machine()}; "
          f"elasticd {revision()}", flush=True)
    rows: dict[tuple, dict] = {}
    with EtcdServer() as etcd:
        for n in counts:
            for impl in impls:
                runs = [run_child(impl, n, etcd.url, args.timeout) for _ in range(args.reps)]
                good = sorted((r for r in runs if r.get("ok")), key=lambda r: r["time_all"])
                r = good[len(good) // 2] if good else runs[-1]
                rows[(impl, n)] = r
                note = "" if r.get("ok") else f"  FAILED: {'; '.join(r.get('errors') or [])}"
                print(f"  N={n:3d} {impl:17s} {fmt_t(r.get('time_all')):>9s}  "
                      f"requests {fmt_n(r.get('requests')):>6s}  "
                      f"writes {fmt_n(r.get('writes')):>6s}{note}", flush=True)
                if r.get("by_method"):
                    print("        " + ", ".join(f"{k.split(':')[1]} {v:.0f}" for k, v in
                                                sorted(r["by_method"].items())), flush=True)

    print()
    header = ["N"]
    for impl in impls:
        header += [f"{impl} time"] + ([f"{impl} req/wr"] if impl in ETCD_IMPLS else [])
    table = []
    for n in counts:
        line = [str(n)]
        for impl in impls:
            r = rows.get((impl, n), {})
            t = r.get("time_all") if r.get("ok") else None
            line.append(fmt_t(t) if r.get("ok") else "failed")
            if impl in ETCD_IMPLS:
                line.append(f"{fmt_n(r.get('requests'))}/{fmt_n(r.get('writes'))}")
        table.append(line)
    widths = [max(len(x) for x in col) for col in zip(header, *table)]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)))

    if "ours" in impls:
        print("\nratios, time of the torch handler / time of ours (same N, same run):")
        for n in counts:
            ours = rows.get(("ours", n), {})
            if not ours.get("ok"):
                continue
            parts = []
            for impl in impls:
                r = rows.get((impl, n), {})
                if impl.startswith("ours") or not r.get("ok"):
                    continue
                parts.append(f"{impl} {r['time_all'] / ours['time_all']:.1f}x")
            print(f"  N={n:3d}: " + (", ".join(parts) or "-"))
        print("\nours, growth per doubling of N (2.0 = linear):")
        prev = None
        for n in counts:
            r = rows.get(("ours", n), {})
            if not r.get("ok"):
                prev = None
                continue
            if prev is not None:
                pn, pr = prev
                k = n / pn
                print(f"  N={pn:3d} -> {n:3d}: time x{r['time_all'] / pr['time_all']:.2f}, "
                      f"requests x{r['requests'] / max(pr['requests'], 1):.2f}, "
                      f"writes x{r['writes'] / max(pr['writes'], 1):.2f} (N x{k:.0f}); "
                      f"{r['requests'] / n:.2f} requests and {r['writes'] / n:.2f} writes "
                      "per participant")
            prev = (n, r)
        top = max((n for n in counts if rows.get(("ours", n), {}).get("ok")), default=None)
        te = rows.get(("torch-etcd", top), {}) if top else {}
        if top and te.get("ok"):
            ratio = te["time_all"] / rows[("ours", top)]["time_all"]
            print(f"\ngoal: at N = {top}, ours >= 5x faster than torch's etcd rendezvous: "
                  f"{ratio:.1f}x -> {'PASS' if ratio >= 5 else 'MISS'}"
                  + ("" if top == 64 else " (goal is stated at N = 64)"))
        if top:  # the README's row (bench/run_all.py): min = max = N, no last call to match
            emit_table_row(rows, top)
    return 0


def emit_table_row(rows: dict, n: int) -> None:
    def cell(impl: str) -> str:
        r = rows.get((impl, n), {})
        if not r.get("ok"):
            return f"{impl}: {'failed' if r else 'not run'}"
        wrote = f", {fmt_n(r.get('writes'))} writes" if impl in ETCD_IMPLS else ""
        return f"{fmt_t(r['time_all'])}{wrote} ({impl})"
    ours = rows[("ours", n)]
    ratios = [f"{rows[(i, n)]['time_all'] / ours['time_all']:.1f}x {i}"
              for i in ("torch-etcd", "c10d") if rows.get((i, n), {}).get("ok")]
    from rows import emit_row
    emit_row("rendezvous", elasticd=f"N = {n}: {cell('ours')}",
             torch="; ".join(cell(i) for i in ("torch-etcd", "c10d")), ratio=", ".join(ratios))


if __name__ == "__main__":
    sys.exit(main())
