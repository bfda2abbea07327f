"""What an elasticd daemon costs: start-up, idle footprint, spawn latency, RPC latency.

    python bench/daemon_overhead.py [--starts 5] [--idle-seconds 30]
                                    [--spawns 20] [--rpc-calls 1000]

(a) start -> ready: from exec of ``python -m elasticd --standalone`` to the
    first ListNodes call that answers (fresh socket and state dir each time,
    polled every 5 ms), median of --starts starts.
(b) idle: RSS (psutil) of the daemon process at the end of an idle window,
    and its CPU (user+system over all its threads) over the window, as % of
    one core.
(c) submit -> first worker process started: the job is
    ``/bin/sh -c 'date +%s.%N > FILE'``; the time in FILE minus the time
    just before the Submit call. Sequential, each job waited for.
(d) control RPC latency: GetJob and ListJobs, --rpc-calls each, one client
    (one channel, token fetched once), after 20 warm-up calls.

Prints a table with the design goals and PASS/MISS. Never fails on a miss.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (BenchDaemon, machine, median, ms, percentile,  # noqa: E402
                    revision, table, tempdir)
from rows import emit_row  # noqa: E402

from elasticd.v1 import control_pb2 as pb  # noqa: E402

GOALS = {  # name: (limit, unit)
    "rss": 80.0,        # MB
    "cpu": 1.0,         # % of one core
    "ready": 1.0,       # s
    "spawn": 0.100,     # s
    "rpc_p99": 0.005,   # s
}


def bytecode_env() -> dict:
    """An environment where Python may cache bytecode, in a temp tree (not the repo)."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(tempdir("edb-pyc-"), "pyc"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def bench_start(n: int, env: dict | None = None,
                warmup: int = 0) -> tuple[list[float], list[float]]:
    """n cold starts; (exec -> ready seconds, the daemon's own 'ready in' seconds)."""
    times, own = [], []
    for i in range(warmup + n):
        d = BenchDaemon(env=env)
        try:
            t = d.start()
            if i >= warmup:
                times.append(t)
                own.append(_own_ready_ms(d.log()))
        finally:
            d.stop()
    return times, own


def _own_ready_ms(log: str) -> float | None:
    for line in log.splitlines():
        if " ready in " in line:
            try:
                return float(line.split(" ready in ", 1)[1].split(" ms", 1)[0]) / 1000
            except ValueError:
                return None
    return None


def bench_idle(d: BenchDaemon, seconds: float, settle: float) -> dict:
    p = psutil.Process(d.pid)
    time.sleep(settle)
    c0, t0 = p.cpu_times(), time.monotonic()
    rss_max = 0
    end = t0 + seconds
    while True:
        rss_max = max(rss_max, p.memory_info().rss)
        left = end - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(1.0, left))
    c1, t1 = p.cpu_times(), time.monotonic()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    mem = p.memory_info()
    return {"rss_mb": mem.rss / 2**20, "rss_max_mb": rss_max / 2**20,
            "cpu_pct": 100.0 * cpu / (t1 - t0), "cpu_s": cpu, "window": t1 - t0,
            "threads": p.num_threads()}


def bench_spawn(d: BenchDaemon, n: int) -> list[float]:
    work = tempdir("edb-spawn-")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    out = []
    for i in range(n):
        stamp = os.path.join(work, f"t{i}")
        cmd = ["/bin/sh", "-c", f"date +%s.%N > {stamp}"]
        t_before = time.time()
        job_id = d.submit(cmd, cwd=work, nproc=1, max_restarts=0, env=env)
        job = d.wait_job(job_id, timeout=60)
        state = pb.JobState.Name(job.state)
        if state != "SUCCEEDED":
            raise RuntimeError(f"spawn job {job_id} ended {state}: {job.reason}")
        with open(stamp) as fh:
            out.append(float(fh.read().strip()) - t_before)
    return out


def bench_rpc(d: BenchDaemon, n: int, job_id: str) -> dict:
    c = d.client()
    calls = {
        "GetJob": ("GetJob", pb.GetJobRequest(id=job_id)),
        "ListJobs": ("ListJobs", pb.ListJobsRequest()),
    }
    result = {}
    for name, (method, req) in calls.items():
        for _ in range(20):
            c.call(method, req)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            c.call(method, req)
            lat.append(time.perf_counter() - t)
        result[name] = lat
    result["jobs_listed"] = len(c.call("ListJobs", pb.ListJobsRequest()).jobs)
    return result


def verdict(value, limit) -> str:
    if value is None:
        return "n/a"
    return "PASS" if value < limit else "MISS"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=5)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--settle-seconds", type=float, default=2.0,
                    help="wait after ready before the idle window opens")
    ap.add_argument("--spawns", type=int, default=20)
    ap.add_argument("--rpc-calls", type=int, default=1000)
    args = ap.parse_args(argv)

    print(f"machine: {machine()}")
    print(f"elasticd: {revision()}")
    as_is = "no .pyc" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "as is"
    print(f"(a) {args.starts} starts, this environment's bytecode setting ({as_is}) ...",
          flush=True)
    starts, own = bench_start(args.starts)
    print("    exec -> ready: " + ", ".join(ms(t, 0) for t in starts))
    print(f"    {args.starts} starts with a warm bytecode cache (PYTHONPYCACHEPREFIX, "
          "after 1 unmeasured start) ...", flush=True)
    starts_pyc, own_pyc = bench_start(args.starts, env=bytecode_env(), warmup=1)
    print("    exec -> ready: " + ", ".join(ms(t, 0) for t in starts_pyc))

    # (d) times one client's calls back to back, not the fair share: no pacing of its uid.
    d = BenchDaemon(extra_args=("--set", "limits.call_rate_per_user=1000000"))
    try:
        d.start()
        print(f"(b) idle window {args.idle_seconds:g} s (after {args.settle_seconds:g} s "
              "settle) ...", flush=True)
        idle = bench_idle(d, args.idle_seconds, args.settle_seconds)
        print(f"(c) {args.spawns} submits of /bin/sh -c 'date +%s.%N > FILE' ...", flush=True)
        spawn = bench_spawn(d, args.spawns)
        print("    submit -> worker: " + ", ".join(ms(t, 1) for t in spawn))
        any_job = d.client().call("ListJobs", pb.ListJobsRequest()).jobs[0].id
        print(f"(d) {args.rpc_calls} GetJob + {args.rpc_calls} ListJobs ...", flush=True)
        rpc = bench_rpc(d, args.rpc_calls, any_job)
        rss_after = psutil.Process(d.pid).memory_info().rss / 2**20
    finally:
        d.stop()

    s_med = median(starts)
    sp_med, sp_p95 = median(spawn), percentile(spawn, 95)
    g, l_ = rpc["GetJob"], rpc["ListJobs"]
    sp_med_pyc = median(starts_pyc)
    rows = [
        ["start -> ready (median of %d, %s)" % (len(starts), as_is), ms(s_med, 0),
         f"min {ms(min(starts), 0)}, max {ms(max(starts), 0)}; daemon's own 'ready in' "
         f"(after imports) median {ms(median(own), 0)}", "< 1 s",
         verdict(s_med, GOALS["ready"])],
        ["start -> ready (median of %d, .pyc cached)" % len(starts_pyc), ms(sp_med_pyc, 0),
         f"min {ms(min(starts_pyc), 0)}, max {ms(max(starts_pyc), 0)}; 'ready in' median "
         f"{ms(median(own_pyc), 0)}", "< 1 s", verdict(sp_med_pyc, GOALS["ready"])],
        ["idle RSS", f"{idle['rss_mb']:.1f} MB",
         f"max in window {idle['rss_max_mb']:.1f} MB; {idle['threads']} threads; "
         f"after (c)+(d) {rss_after:.1f} MB", "< 80 MB", verdict(idle["rss_mb"], GOALS["rss"])],
        ["idle CPU (%% of one core, %.0f s)" % idle["window"], f"{idle['cpu_pct']:.2f} %",
         f"{idle['cpu_s'] * 1000:.0f} ms CPU in {idle['window']:.1f} s", "< 1 %",
         verdict(idle["cpu_pct"], GOALS["cpu"])],
        ["submit -> worker started (p95 of %d)" % len(spawn), ms(sp_p95),
         f"median {ms(sp_med)}, min {ms(min(spawn))}, max {ms(max(spawn))}", "< 100 ms",
         verdict(sp_p95, GOALS["spawn"])],
        ["GetJob p99 (%d calls)" % len(g), ms(percentile(g, 99), 2),
         f"p50 {ms(percentile(g, 50), 2)}, max {ms(max(g), 2)}", "< 5 ms",
         verdict(percentile(g, 99), GOALS["rpc_p99"])],
        ["ListJobs p99 (%d calls, %d jobs)" % (len(l_), rpc["jobs_listed"]),
         ms(percentile(l_, 99), 2),
         f"p50 {ms(percentile(l_, 50), 2)}, max {ms(max(l_), 2)}", "< 5 ms",
         verdict(percentile(l_, 99), GOALS["rpc_p99"])],
    ]
    print()
    print(table(rows, ["measure", "value", "detail", "goal", ""]))
    emit_row("idle-daemon", elasticd=f"{idle['rss_mb']:.0f} MB RSS, {idle['cpu_pct']:.2f} % "
             f"CPU ({idle['window']:.0f} s), ready in {ms(s_med, 0)} (median of {len(starts)})")
    print(f"\nmachine after: {machine()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
