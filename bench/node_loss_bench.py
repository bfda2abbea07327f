"""Node loss -> first training step on the survivors: elasticd vs torchrun, same run.

    python bench/node_loss_bench.py [--reps 2] [--warm 8]
        [--launchers elasticd,torchrun-c10d,torchrun-c10d-lc2,torchrun-etcd]

Three "nodes" on this machine run one elastic job, --nnodes 2:3, one worker
per node, gloo, up to 3 restarts:

    python -m elasticd.examples.train --steps 5000 --step-time 0.05
        --checkpoint-every 50 --log-every 100000 --checkpoint-dir <shared dir>

``--warm`` seconds after rank 0's first step, one node is killed with
SIGKILL: for elasticd its daemon (its workers die with it: PDEATHSIG); for
torchrun the agent and every process under it (their own sessions
included), i.e. everything that node ran. The node killed is one that
neither holds rank 0 nor, for c10d, hosts the rendezvous TCPStore (kill the
store's host and torchrun's c10d job cannot re-rendezvous at all).

Measured, all on the workers' and this machine's wall clock:
  stopped     kill -> the survivors' workers of the old round are all gone
              (psutil, polled every 10 ms)
  first step  kill -> the first ``FIRST_STEP <time>`` line rank 0 prints after
              the kill (the new world's first optimizer step, after its
              re-rendezvous, spawn, init_process_group and checkpoint load)

Launchers:
  elasticd           3 daemons (python -m elasticd --etcd URL, default settings:
                     lease TTL 3 s, last call 2 s, warm spares on), the job
                     submitted with `elasticctl submit --nnodes 2:3`
  torchrun-c10d      3 x torchrun --nnodes 2:3 --nproc-per-node 1
                     --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
                     --max-restarts 3 --monitor-interval 0.1 (defaults otherwise:
                     the dynamic rendezvous waits its 30 s last call once min
                     nodes joined and max did not)
  torchrun-c10d-lc2  the same with --rdzv-conf last_call_timeout=2, elasticd's
                     last call: what is left once that default is matched
  torchrun-etcd      3 x torchrun --rdzv-backend etcd (the etcd v2 rendezvous,
                     on the same etcd; last call 30 s by default)
torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (with 2.13's default,
restarted gloo workers read the old round's addresses, pytorch#135712).

Prints each run, the medians, and the ratios torchrun / elasticd. Never
asserts a timing.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from common import (kill_owned, machine, median, own, own_tree, read_text,  # noqa: E402
                    revision, tempdir, wait_quiet)
from daemons import DaemonProc  # noqa: E402
from rows import emit_row  # noqa: E402
from etcd_server import EtcdServer, free_port  # noqa: E402

LAUNCHERS = ("elasticd", "torchrun-c10d", "torchrun-c10d-lc2", "torchrun-etcd")
FIRST = re.compile(r"FIRST_STEP (\d+\.\d+) attempt=(\d+)")
TRAIN_ARGS = ["--steps", "5000", "--step-time", "0.05", "--checkpoint-every", "50",
              "--log-every", "100000"]


def first_steps(text: str) -> list[float]:
    return [float(m.group(1)) for m in FIRST.finditer(text)]


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def gone_at(procs: list[psutil.Process], timeout: float) -> float | None:
    """time.time() when every process in ``procs`` has exited (None: not in time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if not left:
            return time.time()
        time.sleep(0.01)
    return None


def after_kill(logs: list[str], killed_at: float, timeout: float) -> float | None:
    """The first FIRST_STEP stamp after the kill, in any of these log files."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stamps = [t for path in logs for t in first_steps(read_text(path)) if t > killed_at]
        if stamps:
            return min(stamps)
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------- elasticd

def run_elasticd(etcd: EtcdServer, warm: float, timeout: float) -> dict:
    root = tempdir("nlb-")
    prefix = f"/nlb-{os.getpid()}-{time.monotonic_ns()}"
    nodes = [DaemonProc(os.path.join(root, n), node_id=n, etcd=etcd.url, slots=2,
                        extra_args=("--etcd-prefix", prefix))
             for n in ("n1", "n2", "n3")]
    for d in nodes:
        os.makedirs(d.root, exist_ok=True)
        d.start()
        own(d.proc)
    n1, n2, n3 = nodes
    try:
        ckpt = os.path.join(root, "ckpt")
        res = n1.ctl("submit", "--nnodes", "2:3", "--max-restarts", "3", "--",
                     sys.executable, "-m", "elasticd.examples.train", *TRAIN_ARGS,
                     "--checkpoint-dir", ckpt)
        if res.returncode != 0:
            raise RuntimeError(f"submit failed: {res.stderr}")
        job = res.stdout.strip()
        log0 = os.path.join(n1.state_dir, "logs", job, "rank-0.log")

        def workers_of(d):
            return [w for w in d.job(job).workers if w.node_id == d.node_id and w.pid > 0]

        wait_for(lambda: len({w.node_id for w in n1.job(job).workers}) == 3
                 and first_steps(read_text(log0)), 180, "the first step on 3 nodes", 0.2)
        if {w.rank for w in workers_of(n1)} != {0}:
            raise RuntimeError("rank 0 is not on n1")
        time.sleep(warm)
        for d in nodes:
            own_tree(d.proc.pid)
        survivors = [psutil.Process(w.pid) for d in (n1, n2) for w in workers_of(d)]
        killed_at = time.time()
        n3.proc.send_signal(signal.SIGKILL)
        stopped = gone_at(survivors, timeout)
        first = after_kill([log0], killed_at, timeout)
        events = [(e.time - killed_at, e.reason) for e in n1.events(job)
                  if e.time > killed_at and e.kind == "state"]
        return {"stopped": stopped and stopped - killed_at,
                "first": first and first - killed_at, "notes": events}
    finally:
        for d in nodes:
            if d.proc and d.proc.poll() is None:
                own_tree(d.proc.pid)
                d.stop(timeout=15)
        kill_owned()


# ---------------------------------------------------------------- torchrun

def run_torchrun(variant: str, etcd: EtcdServer, warm: float, timeout: float) -> dict:
    root = tempdir("nlt-")
    ckpt = os.path.join(root, "ckpt")
    run_id = f"nl{os.getpid()}{time.monotonic_ns() % 10**8}"
    if variant.startswith("torchrun-c10d"):
        port = free_port()
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        if variant.endswith("-lc2"):
            rdzv += ["--rdzv-conf", "last_call_timeout=2"]
    else:
        port = None
        rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", f"127.0.0.1:{etcd.client_port}",
                "--rdzv-conf", f"etcd_prefix=/torchelastic/{run_id}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3",
           "--nproc-per-node", "1", *rdzv, "--rdzv-id", run_id, "--max-restarts", "3",
           "--monitor-interval", "0.1", "-m", "elasticd.examples.train", *TRAIN_ARGS,
           "--checkpoint-dir", ckpt]
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    agents, logs = [], []
    try:
        for i in range(3):
            logs.append(os.path.join(root, f"agent{i}.log"))
            with open(logs[-1], "wb") as fh:
                agents.append(subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                               env=env, cwd=root, start_new_session=True))
            own(agents[-1])
            if i == 0 and port:  # the first agent hosts the c10d store: let it bind
                wait_for(lambda: any(c.laddr.port == port and c.status == "LISTEN"
                                     for c in psutil.net_connections("tcp")), 60,
                         "the c10d store to listen")

        def rank0_agent():
            hits = [i for i, path in enumerate(logs) if first_steps(read_text(path))]
            return hits[0] if hits else None

        def trainers(i):
            try:
                return [p for p in psutil.Process(agents[i].pid).children(recursive=True)
                        if "elasticd.examples.train" in " ".join(p.cmdline())]
            except psutil.Error:
                return []

        wait_for(lambda: rank0_agent() is not None and all(trainers(i) for i in range(3)),
                 180, "the first step on 3 nodes", 0.2)
        time.sleep(warm)
        r0 = rank0_agent()
        victim = next(i for i in (2, 1) if i != r0)  # never the store host (agent 0)
        for a in agents:
            own_tree(a.pid)
        survivors = [p for i in range(3) if i != victim for p in trainers(i)]
        doomed = [psutil.Process(agents[victim].pid)]
        doomed += doomed[0].children(recursive=True)
        killed_at = time.time()
        for p in doomed:  # the whole node at once: agent, workers (own sessions) and all
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
        stopped = gone_at(survivors, timeout)
        first = after_kill([p for i, p in enumerate(logs) if i != victim], killed_at, timeout)
        return {"stopped": stopped and stopped - killed_at,
                "first": first and first - killed_at, "notes": []}
    finally:
        for a in agents:
            own_tree(a.pid)
        kill_owned()


# ---------------------------------------------------------------- main

def fmt(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def table_row(med: dict, results: dict) -> dict:
    """The README table's cells: first step after the kill, medians; torchrun c10d at its
    defaults (30 s last call) and with elasticd's last call (lc2), etcd v2 beside."""
    ours = med["elasticd"][1]

    def cell(x: str) -> str:
        if x not in med:
            return "not run"
        n_ok = sum(1 for r in results[x] if r["first"] is not None)
        return (f"{fmt(med[x][1])} ({x.removeprefix('torchrun-')}, {n_ok}/{len(results[x])} "
                f"recovered)" if med[x][1] else f"none within the timeout ({x})")
    ratios = [f"{med[x][1] / ours:.1f}x {x.removeprefix('torchrun-')}"
              for x in ("torchrun-c10d", "torchrun-c10d-lc2") if x in med and med[x][1]]
    torch = cell("torchrun-c10d") + ("; " + cell("torchrun-etcd") if "torchrun-etcd" in med
                                     else "")
    return {"elasticd": f"{fmt(ours)} (median of {len(results['elasticd'])})",
            "torch": torch, "matched": cell("torchrun-c10d-lc2"), "ratio": ", ".join(ratios)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warm", type=float, default=8.0,
                   help="seconds of training after the first step before the kill")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds to wait for the survivors to recover")
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    args = p.parse_args()
    launchers = [x for x in args.launchers.split(",") if x]
    for x in launchers:
        if x not in LAUNCHERS:
            p.error(f"unknown launcher {x!r}; choose from {', '.join(LAUNCHERS)}")
    print(f"node loss (kill -9 of 1 of 3 nodes) -> first step on the survivors; {machine()}; "
          f"elasticd {revision()}", flush=True)
    results: dict[str, list[dict]] = {x: [] for x in launchers}
    with EtcdServer() as etcd:
        for rep in range(args.reps):
            order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
            for launcher in order:
                busy = wait_quiet(30.0, 20.0)
                try:
                    r = (run_elasticd(etcd, args.warm, args.timeout) if launcher == "elasticd"
                         else run_torchrun(launcher, etcd, args.warm, args.timeout))
                except Exception as exc:  # noqa: BLE001 - reported, the others still run
                    r = {"stopped": None, "first": None, "notes": [f"error: {exc}"]}
                results[launcher].append(r)
                print(f"  rep {rep + 1} {launcher:18s} survivors' workers stopped "
                      f"{fmt(r['stopped']):>8s}   first step {fmt(r['first']):>8s}   "
                      f"(machine {busy:.0f}% busy before)", flush=True)
                for t, why in r["notes"][:6] if launcher == "elasticd" else r["notes"]:
                    print(f"        +{t:6.2f}s {why[:150]}" if isinstance(t, float)
                          else f"        {t}", flush=True)
    print("\nmedians (kill -9 -> ...):")
    med = {x: (median([r["stopped"] for r in rs]), median([r["first"] for r in rs]))
           for x, rs in results.items()}
    width = max(len(x) for x in launchers)
    for x in launchers:
        s, f = med[x]
        n_ok = sum(1 for r in results[x] if r["first"] is not None)
        print(f"  {x:{width}s}  workers stopped {fmt(s):>8s}   first step {fmt(f):>8s}   "
              f"({n_ok}/{len(results[x])} recovered)")
    if "elasticd" in med and med["elasticd"][1]:
        print("\nratios torchrun / elasticd (first step after the kill):")
        for x in launchers:
            if x != "elasticd" and med[x][1]:
                print(f"  {x:{width}s}  {med[x][1] / med['elasticd'][1]:.1f}x"
                      + (f"   (workers stopped {med[x][0] / med['elasticd'][0]:.1f}x)"
                         if med[x][0] and med["elasticd"][0] else ""))
        print(f"\ntarget: survivors notice a node loss within 3 s: elasticd stopped its "
              f"workers in {fmt(med['elasticd'][0])}")
        emit_row("node-loss", **table_row(med, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
