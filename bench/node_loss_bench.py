"""Node loss -> first training step on the survivors: elasticd vs torchrun, same run.

    python bench/node_loss_bench.py [--reps 2] [--warm 8] [--spares]
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

``--spares``: the same three nodes run a job that needs exactly two
(``--nnodes 2:2``), so one node is a spare, and what is measured is the
first step at the FULL world size again (2 ranks): rank 0's first
``FIRST_STEP`` after the kill whose attempt line (``attempt N: world size
2``, printed just before it) says world size 2; a first step at any other
size is reported as a bad run. The node killed is a member (it runs ranks)
other than rank 0's and, for c10d, the store host; never the spare.
  elasticd           the job submitted with `elasticctl submit --nnodes 2:2
                     --spares 1`: the third daemon stands by (its template warm;
                     found in the job's spare_nodes before the kill) and the
                     next round takes it in the lost node's group rank
  torchrun-*         3 agents with --nnodes 2:2: torch's third agent waits on the
                     rendezvous' redundancy list and joins the re-rendezvous
                     (torch's own form of a spare); same settings as above

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
ATTEMPT = re.compile(r"^attempt (\d+): world size (\d+),")
FULL_WORLD = 2  # ranks of the spare mode's job: 2 nodes x 1
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


def sized_first_steps(text: str) -> list[tuple[float, int]]:
    """(FIRST_STEP stamp, the world size its attempt line said) in rank 0's output;
    the size is 0 where no attempt line came before it."""
    world, out = 0, []
    for line in text.splitlines():
        m = ATTEMPT.match(line)
        if m:
            world = int(m.group(2))
            continue
        m = FIRST.match(line)
        if m:
            out.append((float(m.group(1)), world))
    return out


def after_kill(logs: list[str], killed_at: float, timeout: float,
               world: int = 0, smaller: list | None = None) -> float | None:
    """The first FIRST_STEP stamp after the kill, in any of these log files; with
    ``world``, the first whose attempt ran at that world size (the others' sizes and
    stamps are appended to ``smaller``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stamps = [(t, w) for path in logs for t, w in sized_first_steps(read_text(path))
                  if t > killed_at]
        ok = [t for t, w in stamps if not world or w == world]
        if ok:
            if smaller is not None:
                smaller.extend((t - killed_at, w) for t, w in stamps if t < min(ok))
            return min(ok)
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------- elasticd

def run_elasticd(etcd: EtcdServer, warm: float, timeout: float, spares: bool = False) -> dict:
    root = tempdir("nlb-")
    prefix = f"/nlb-{os.getpid()}-{time.monotonic_ns()}"
    nodes = [DaemonProc(os.path.join(root, n), node_id=n, etcd=etcd.url, slots=2,
                        extra_args=("--etcd-prefix", prefix))
             for n in ("n1", "n2", "n3")]
    for d in nodes:
        os.makedirs(d.root, exist_ok=True)
        d.start()
        own(d.proc)
    n1 = nodes[0]
    by_id = {d.node_id: d for d in nodes}
    try:
        ckpt = os.path.join(root, "ckpt")
        shape = ("--nnodes", "2:2", "--spares", "1") if spares else ("--nnodes", "2:3")
        res = n1.ctl("submit", *shape, "--max-restarts", "3", "--",
                     sys.executable, "-m", "elasticd.examples.train", *TRAIN_ARGS,
                     "--checkpoint-dir", ckpt)
        if res.returncode != 0:
            raise RuntimeError(f"submit failed: {res.stderr}")
        job = res.stdout.strip()

        def workers_of(d):
            return [w for w in d.job(job).workers if w.node_id == d.node_id and w.pid > 0]

        def started():
            info = n1.job(job)
            members = {w.node_id for w in info.workers if w.pid > 0}
            rank0 = [w.node_id for w in info.workers if w.rank == 0 and w.pid > 0]
            if len(members) != (2 if spares else 3) or not rank0 or \
                    (spares and len(info.spare_nodes) != 1):
                return None
            log0 = os.path.join(by_id[rank0[0]].state_dir, "logs", job, "rank-0.log")
            return (by_id[rank0[0]], log0, members, list(info.spare_nodes)) \
                if first_steps(read_text(log0)) else None

        what = "the first step on 2 nodes and a spare standing by" if spares \
            else "the first step on 3 nodes"
        home, log0, members, standing = wait_for(started, 180, what, 0.2)
        if not spares and home is not n1:
            raise RuntimeError("rank 0 is not on n1")
        time.sleep(warm)
        # A member that does not hold rank 0, never the spare (the last node by default).
        victim = next(d for d in reversed(nodes) if d.node_id in members and d is not home)
        if spares:
            standing = list(n1.job(job).spare_nodes)
            if victim.node_id in standing or len(standing) != 1:
                raise RuntimeError(f"spares standing by {standing}, victim {victim.node_id}")
        for d in nodes:
            own_tree(d.proc.pid)
        survivors = [psutil.Process(w.pid) for d in nodes if d is not victim
                     for w in workers_of(d)]
        killed_at = time.time()
        victim.proc.send_signal(signal.SIGKILL)
        stopped = gone_at(survivors, timeout)
        smaller: list = []
        first = after_kill([log0], killed_at, timeout, FULL_WORLD if spares else 0, smaller)
        kinds = ("state", "spare") if spares else ("state",)
        events = sorted((e.time - killed_at, f"[{e.kind}] {e.reason}" if spares else e.reason)
                        for e in home.events(job) if e.time > killed_at and e.kind in kinds)
        if spares:  # each live node's own word on the ranks it runs now
            ran = {d.node_id: sorted(w.rank for w in workers_of(d)) for d in nodes
                   if d is not victim}
            events.insert(0, f"spare before the kill {standing}, killed {victim.node_id}, "
                             f"rank 0 on {home.node_id}; ranks per live node after: {ran}")
            events[1:1] = [f"BAD: first step at world size {w} +{t:.2f}s"
                           for t, w in smaller]
        return {"stopped": stopped and stopped - killed_at,
                "first": first and first - killed_at, "notes": events,
                "bad": bool(smaller)}
    finally:
        for d in nodes:
            if d.proc and d.proc.poll() is None:
                own_tree(d.proc.pid)
                d.stop(timeout=15)
        kill_owned()


# ---------------------------------------------------------------- torchrun

def run_torchrun(variant: str, etcd: EtcdServer, warm: float, timeout: float,
                 spares: bool = False) -> dict:
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes",
           "2:2" if spares else "2:3",
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

        def members():
            return [i for i in range(3) if trainers(i)]

        wait_for(lambda: rank0_agent() is not None and len(members()) == (2 if spares else 3),
                 180, "the first step on " + ("2 agents" if spares else "3 nodes"), 0.2)
        time.sleep(warm)
        r0 = rank0_agent()
        # Never the store host (agent 0), nor rank 0's, nor (--spares) the agent waiting.
        running = members()
        victim = next((i for i in (2, 1) if i != r0 and i in running), None)
        if victim is None:
            raise RuntimeError(f"no agent to kill: rank 0 on agent {r0}, ranks on {running}")
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
        smaller: list = []
        first = after_kill([p for i, p in enumerate(logs) if i != victim], killed_at, timeout,
                           FULL_WORLD if spares else 0, smaller)
        notes = [f"ranks on agents {running}, rank 0 on agent {r0}, killed agent {victim}"] \
            if spares else []
        notes += [f"BAD: first step at world size {w} +{t:.2f}s" for t, w in smaller]
        return {"stopped": stopped and stopped - killed_at,
                "first": first and first - killed_at, "notes": notes, "bad": bool(smaller)}
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


def spread(xs: list) -> str:
    xs = sorted(x for x in xs if x is not None)
    return f"{xs[0]:.2f}-{xs[-1]:.2f} s" if xs else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warm", type=float, default=8.0,
                   help="seconds of training after the first step before the kill")
    p.add_argument("--timeout", type=float, default=150.0,
                   help="seconds to wait for the survivors to recover")
    p.add_argument("--spares", action="store_true",
                   help="a job of exactly 2 nodes on the 3, the third a spare (elasticd "
                        "--spares 1; torchrun's third agent waits): kill -> first step "
                        "at the full world size again")
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    args = p.parse_args()
    launchers = [x for x in args.launchers.split(",") if x]
    for x in launchers:
        if x not in LAUNCHERS:
            p.error(f"unknown launcher {x!r}; choose from {', '.join(LAUNCHERS)}")
    if args.spares:
        print(f"node loss with a spare (3 nodes, a job of --nnodes 2:2, kill -9 of a member) "
              f"-> first step at world size {FULL_WORLD} again; {machine()}; "
              f"elasticd {revision()}", flush=True)
    else:
        print(f"node loss (kill -9 of 1 of 3 nodes) -> first step on the survivors; "
              f"{machine()}; elasticd {revision()}", flush=True)
    results: dict[str, list[dict]] = {x: [] for x in launchers}
    with EtcdServer() as etcd:
        for rep in range(args.reps):
            order = launchers[rep % len(launchers):] + launchers[:rep % len(launchers)]
            for launcher in order:
                busy = wait_quiet(30.0, 20.0)
                load = os.getloadavg()[0]
                try:
                    r = (run_elasticd(etcd, args.warm, args.timeout, args.spares)
                         if launcher == "elasticd"
                         else run_torchrun(launcher, etcd, args.warm, args.timeout, args.spares))
                except Exception as exc:  # noqa: BLE001 - reported, the others still run
                    r = {"stopped": None, "first": None, "notes": [f"error: {exc}"]}
                results[launcher].append(r)
                print(f"  rep {rep + 1} {launcher:18s} survivors' workers stopped "
                      f"{fmt(r['stopped']):>8s}   first step {fmt(r['first']):>8s}   "
                      f"(machine {busy:.0f}% busy before, load {load:.1f})", flush=True)
                notes = r["notes"]
                for note in notes[:8] if launcher == "elasticd" else notes:
                    print(f"        +{note[0]:6.2f}s {note[1][:150]}" if isinstance(note, tuple)
                          else f"        {note}", flush=True)
    print("\nmedians (kill -9 -> ...):")
    med = {x: (median([r["stopped"] for r in rs]), median([r["first"] for r in rs]))
           for x, rs in results.items()}
    width = max(len(x) for x in launchers)
    for x in launchers:
        s, f = med[x]
        n_ok = sum(1 for r in results[x] if r["first"] is not None)
        n_bad = sum(1 for r in results[x] if r.get("bad"))
        print(f"  {x:{width}s}  workers stopped {fmt(s):>8s}   first step {fmt(f):>8s}   "
              f"(spread {spread([r['first'] for r in results[x]])}; {n_ok}/{len(results[x])} "
              f"recovered" + (f", {n_bad} ran smaller first" if n_bad else "") + ")")
    if "elasticd" in med and med["elasticd"][1]:
        print("\nratios torchrun / elasticd (first step after the kill):")
        for x in launchers:
            if x != "elasticd" and med[x][1]:
                print(f"  {x:{width}s}  {med[x][1] / med['elasticd'][1]:.1f}x"
                      + (f"   (workers stopped {med[x][0] / med['elasticd'][0]:.1f}x)"
                         if med[x][0] and med["elasticd"][0] else ""))
        if args.spares:
            ours = med["elasticd"][1]
            print(f"\ngoal: a lost node replaced by the spare, training at full world size "
                  f"within 2 s: {'PASS' if ours <= 2.0 else 'MISS'} ({fmt(ours)})")
            emit_row("node-loss-spare", **table_row(med, results))
        else:
            print(f"\ntarget: survivors notice a node loss within 3 s: elasticd stopped its "
                  f"workers in {fmt(med['elasticd'][0])}")
            emit_row("node-loss", **table_row(med, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
