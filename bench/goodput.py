"""Goodput under repeated faults: elasticd vs torchrun, a worker SIGKILLed at random times.

    python bench/goodput.py                       # 90 s per run, 8 runs: about 15 minutes
    python bench/goodput.py --duration 40 --launchers elasticd,torchrun
    python bench/goodput.py --picture bench/goodput.svg   # and draw it (bench/README.md)

Goodput is the share of the training a job does with faults of what the same
job does without faults in the same time: the step it has reached when the
run ends, over the step the fault-free run of the same launcher reached.

The job, under each launcher, 2 ranks on this node, gloo:

    python -m elasticd.examples.train --steps 1000000 --step-time 0.05
        --checkpoint-every 20 --log-every 1 --checkpoint-dir DIR

(0.05 s steps, a disk checkpoint every 20 steps, resumed at every start; the
``-snap`` launchers add ``--snapshot-every 1``: the state kept in memory with
elasticd.snapshot after every step, on tmpfs, resumed from when it is newer).
Each launcher runs it twice in the same invocation, for ``--duration``
seconds from the job's first training step each (the cold start before it,
the same with or without faults, is left out: on a busy machine its length
varies more than a fault costs): once with no faults, once while a random
worker is SIGKILLed at random times, ``--fault-every`` seconds apart on
average (each gap drawn uniformly from 0.5x to 1.5x of it; seeded: the same
gaps and choices for every launcher). A fixed period would line up with the
20-step checkpoint grid once restarts take a tenth of a second, and a fault
would then cost almost nothing. A kill that finds no running worker (a
restart under way) waits for one, at most ``--fault-every`` seconds.

Launchers:
  torchrun      torchrun --standalone --nnodes 1 --nproc-per-node 2
                --max-restarts 100 --monitor-interval 0.1 -m elasticd.examples.train ...
                (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see restart_vs_torchrun.py)
  torchrun-snap the same with --snapshot-every 1 (elasticd.snapshot works without
                a daemon: ELASTICD_SNAPSHOT_DIR is a private dir on /dev/shm)
  elasticd      python -m elasticd --standalone, default settings; the job
                submitted with --max-restarts-per-window 100 (the default of 10
                per hour is spent by a fault every 10 s for longer than 100 s:
                that is what it is for)
  elasticd-snap the same with --snapshot-every 1 (snapshot.root on /dev/shm)
  elasticd-old  the same, with the settings that reproduce the restart
                policy before issue 22: agent.progress_min_beats and
                agent.progress_min_runtime at their maxima (no attempt counts
                as progress, so the backoff grows with every restart: 0, 0.5,
                1, 2, ... 30 s) and agent.warm_spare_restart_delay at its
                maximum (spares refilled agent.warm_spare_delay = 3 s after
                every start)

``--nodes 3``: three "nodes" on this machine, one etcd (loopback), the job
``--nnodes 2:3`` with one worker per node (3 ranks); every ``--node-every``
(4th) fault kills a node instead of a worker, and it comes back
``--node-down`` (3) seconds later:
  elasticd       3 daemons (python -m elasticd --etcd URL, defaults), the job
                 submitted on n1 with --max-restarts-per-window 100; the node
                 fault is a kill -9 of the daemon of n2 or n3 (its workers die
                 with it), started again on the same state dir
  elasticd-lastcall  the same with the settings that reproduce the rounds before
                 the 3-node follow-up: rendezvous.round_stores=false (rank 0 hosts
                 MASTER_PORT's store) and rendezvous.rejoin_timeout at 3600 (a round
                 after a node died waits the last call, 2 s, or its lease)
  elasticd-snap  the same with --snapshot-every 1 (named with --launchers only); the
                 node fault also removes the node's snapshot root (its memory is lost):
                 its ranks restore the replica its buddy forwards when the round keeps
                 the world size, the disk checkpoint when it does not
  torchrun-c10d  3 x torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend
                 c10d --max-restarts 100 --monitor-interval 0.1 (defaults
                 otherwise); the node fault is a kill -9 of agent 1 or 2 and
                 everything under it (never agent 0: it hosts the c10d store),
                 started again with the same command
  torchrun-c10d-lc2  the same with --rdzv-conf last_call_timeout=2: elasticd's
                 last call, the setting of torch's that matches ours
Rank 0 stays on n1 / agent 0 throughout, whose log is read.

``--nodes 3 --spares 1``: one node more, as a spare: 4 daemons (agents), the
job ``--nnodes 3:3`` (elasticd: ``--spares 1``, the 4th daemon stands by; torchrun:
the 4th agent waits for a re-rendezvous), the same seeded faults; a node fault
kills a node that runs ranks (never the spare, never rank 0's), which comes back
``--node-down`` s later and stands by in its turn. Default launchers elasticd-snap
and torchrun-c10d-lc2; rank 0 stays on the node the first round gave it (read from
the daemons), and each node fault and the world sizes rank 0 ran at are printed
(a spare's point: never below 3).

Printed per launcher: steps without and with faults, goodput, restarts,
faults injected, the mean time from a kill to the first training step after
it (the worker's FIRST_STEP line; same clock), and the steps lost to
rollback (the step reached before each fault minus the checkpoint step the
next attempt resumed from). Never asserts a timing.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from common import (BenchDaemon, kill_owned, kill_procs, machine, read_text,  # noqa: E402
                    revision, start_torchrun, stop_torchrun, table, tempdir, torchrun_bin,
                    torchrun_env, tree)
from goodput_picture import Trace, draw  # noqa: E402
from rows import emit_row  # noqa: E402

LAUNCHERS = ("torchrun", "torchrun-snap", "elasticd", "elasticd-snap")
LAUNCHERS_MORE = ("elasticd-old",)  # named with --launchers only
LAUNCHERS3 = ("torchrun-c10d", "torchrun-c10d-lc2", "elasticd", "elasticd-lastcall")
LAUNCHERS3_MORE = ("elasticd-snap",)  # named with --launchers only
LAUNCHERS3_SPARE = ("elasticd-snap", "torchrun-c10d-lc2")  # --spares 1's default
# The rounds of a job across nodes before the 3-node follow-up of issue 22, by
# settings: rank 0 hosts MASTER_PORT's store (others retry a refused connect), and a
# round after a fault waits the last call (or the lease) for a member that died.
LASTCALL_POLICY = {"ELASTICD_RENDEZVOUS_ROUND_STORES": "false",
                   "ELASTICD_RENDEZVOUS_REJOIN_TIMEOUT": "3600"}
OLD_POLICY = {"ELASTICD_AGENT_PROGRESS_MIN_BEATS": "1000000",
              "ELASTICD_AGENT_PROGRESS_MIN_RUNTIME": str(30 * 86400),
              "ELASTICD_AGENT_WARM_SPARE_RESTART_DELAY": "3600"}
ATTEMPT_RE = re.compile(r"^attempt (\d+): world size \d+, starting at step (\d+)(?: \(from [^)]*\))?$")
FIRST_RE = re.compile(r"^FIRST_STEP (\d+\.\d+) attempt=(\d+) step=(\d+)")
STEP_RE = re.compile(r"^step (\d+)/\d+ loss")


@dataclass
class Run:
    launcher: str
    faults: bool
    kills: list = field(default_factory=list)      # unix times of the SIGKILLs
    skipped: int = 0                               # kills that found no worker in time
    node_kills: int = 0                            # of which a node's daemon / agent
    final_step: int = 0
    restarts: int = 0
    lost: int = 0                                  # steps rolled back
    recover: list = field(default_factory=list)    # kill -> first step after it (s)
    error: str = ""
    trace: Trace = field(default_factory=Trace)    # rank 0's step over time (--picture)


def train_args(ckpt: str, launcher: str = "") -> list[str]:
    snap = ["--snapshot-every", "1"] if launcher.endswith("-snap") else []
    return ["--steps", "1000000", "--step-time", "0.05", "--checkpoint-every", "20",
            "--log-every", "1", "--checkpoint-dir", ckpt, *snap]


def shm_dir(prefix: str) -> str:
    """A private dir on tmpfs for a run's snapshots; the caller removes it."""
    return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")


def parse(run: Run, text: str) -> None:
    """Steps reached, restarts, rollback and recovery times from rank 0's output."""
    last = 0
    attempts = 0
    firsts = []
    for line in text.splitlines():
        m = STEP_RE.match(line)
        if m:
            last = max(last, int(m.group(1)))
            continue
        m = ATTEMPT_RE.match(line)
        if m:
            attempts = max(attempts, int(m.group(1)))
            start = int(m.group(2))
            if int(m.group(1)) > 0:
                run.lost += max(0, last - start)
            last = start
            continue
        m = FIRST_RE.match(line)
        if m:
            firsts.append(float(m.group(1)))
    run.final_step = last
    run.restarts = max(run.restarts, attempts)
    for k in run.kills:
        after = [t for t in firsts if t > k]
        if after:
            run.recover.append(after[0] - k)


class Faults:
    """SIGKILL a random running worker at random times, ``every`` seconds apart on average."""

    def __init__(self, every: float, seed: int, node_every: int = 0):
        self.every = every
        self.node_every = node_every
        self.rng = random.Random(seed)           # which worker, which node
        self.gaps = random.Random(seed + 1)      # when: its own stream, the same for all

    def gap(self) -> float:
        return self.every * self.gaps.uniform(0.5, 1.5)

    def drive(self, run: Run, t0: float, duration: float, workers, log_path: str,
              node_fault=None, on_tick=None, start_timeout: float = 300.0) -> None:
        """For ``duration`` seconds from rank 0's first FIRST_STEP line (the run's
        window; at most ``start_timeout`` s of start-up before it): kill one of
        ``workers()`` (pids) every ``every`` seconds, the first ``every`` seconds
        in. With ``node_fault``, every ``node_every``-th fault calls it instead (a
        node's daemon or agent killed); ``on_tick`` runs every 50 ms (bring it back)."""
        next_at = end = None
        while time.time() < (end or t0 + start_timeout):
            if on_tick is not None:
                on_tick()
            if end is None:
                if "FIRST_STEP" in read_text(log_path):
                    run.trace.start = time.time()
                    end = run.trace.start + duration
                    next_at = time.time() + self.gap()
                else:
                    time.sleep(0.05)
                    continue
            run.trace.sample(lambda: read_text(log_path))
            if not run.faults or time.time() < next_at:
                time.sleep(0.05)
                continue
            if node_fault is not None and (len(run.kills) + 1) % self.node_every == 0:
                node_fault(self.rng)
                run.kills.append(time.time())
                run.node_kills += 1
                next_at += self.gap()
                continue
            pids = workers()
            if pids:
                pid = self.rng.choice(sorted(pids))
                try:
                    os.kill(pid, signal.SIGKILL)
                    run.kills.append(time.time())
                except ProcessLookupError:
                    continue
                next_at += self.gap()
            elif time.time() > next_at + self.every:
                run.skipped += 1
                next_at += self.gap()
            else:
                time.sleep(0.02)


def run_torchrun(run: Run, a, work: str, faults: Faults) -> None:
    tag = f"{run.launcher}-{int(run.faults)}"
    ckpt = os.path.join(work, f"ckpt-{tag}")
    base = os.path.join(work, tag)
    t0 = time.time()
    env = torchrun_env()
    snaps = shm_dir("gp-torchrun-") if run.launcher.endswith("-snap") else None
    if snaps:
        env["ELASTICD_SNAPSHOT_DIR"] = snaps
    proc = start_torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", "2",
                           "--max-restarts", "100", "--monitor-interval", "0.1",
                           "-m", "elasticd.examples.train", *train_args(ckpt, run.launcher)],
                          work, base, env=env)

    def workers():
        try:
            kids = psutil.Process(proc.pid).children()
        except psutil.Error:
            return []
        out = []
        for p in kids:
            try:
                if "elasticd.examples.train" in " ".join(p.cmdline()) and p.status() != "zombie":
                    out.append(p.pid)
            except psutil.Error:
                pass
        return out

    try:
        faults.drive(run, t0, a.duration, workers, base + ".out")
        text = read_text(base + ".out")   # the window's end: what is printed after is not counted
    finally:
        stop_torchrun(proc)
        if snaps:
            shutil.rmtree(snaps, ignore_errors=True)
    parse(run, text)
    if run.final_step == 0:
        run.error = "no step reached: " + read_text(base + ".err")[-500:]


def run_elasticd(run: Run, a, work: str, faults: Faults) -> None:
    from elasticd.v1 import control_pb2 as pb
    env = dict(os.environ, **(OLD_POLICY if run.launcher == "elasticd-old" else {}))
    snaps = shm_dir("gp-elasticd-") if run.launcher.endswith("-snap") else None
    d = BenchDaemon(tempdir("edg-"), slots=4, env=env,
                    extra_args=("--set", f"snapshot.root={snaps}") if snaps else ())
    d.start()
    ckpt = os.path.join(work, f"ckpt-{run.launcher}-{int(run.faults)}")
    try:
        t0 = time.time()
        req = pb.SubmitRequest(command=[sys.executable, "-m", "elasticd.examples.train",
                                        *train_args(ckpt, run.launcher)],
                               cwd=work, env=torchrun_env(), nproc_per_node=2,
                               max_restarts=-1, max_restarts_per_window=100)
        job_id = d.client().call("Submit", req).job.id

        def workers():
            job = d.get_job(job_id)
            if pb.JobState.Name(job.state) != "RUNNING":
                return []
            return [w.pid for w in job.workers if w.state == "running" and w.pid]

        log0 = os.path.join(d.state_dir, "logs", job_id, "rank-0.log")
        faults.drive(run, t0, a.duration, workers, log0)
        text = read_text(log0)   # the window's end: what is printed after is not counted
        job = d.get_job(job_id)
        run.restarts = job.restarts
        if a.verbose and run.faults:
            show_timeline(t0, run, d.events(job_id), text, pb)
        if pb.JobState.Name(job.state) in ("FAILED", "SUCCEEDED"):
            run.error = f"job ended {pb.JobState.Name(job.state)}: {job.reason}"
        d.cancel(job_id)
        parse(run, text)
        run.restarts = job.restarts
    finally:
        d.stop()
        if snaps:
            shutil.rmtree(snaps, ignore_errors=True)


# -- 3 nodes on one etcd (loopback) ---------------------------------------------------
class NodeBack:
    """Restart what a node fault killed, ``down`` seconds later (one at a time)."""

    def __init__(self, down: float):
        self.down = down
        self.pending: list = []     # (when, start callable)

    def later(self, start) -> None:
        self.pending.append((time.time() + self.down, start))

    def tick(self) -> None:
        due = [p for p in self.pending if p[0] <= time.time()]
        for p in due:
            self.pending.remove(p)
            p[1]()


def run_elasticd3(run: Run, a, work: str, faults: Faults, etcd) -> None:
    from daemons import DaemonProc
    from common import own, own_tree
    root = tempdir("edg3-")
    prefix = f"/goodput-{os.getpid()}-{time.monotonic_ns()}"
    env = LASTCALL_POLICY if run.launcher == "elasticd-lastcall" else {}
    nodes = [DaemonProc(os.path.join(root, f"n{i}"), node_id=f"n{i}", etcd=etcd.url,
                        slots=2, extra_args=("--etcd-prefix", prefix), env=env)
             for i in range(1, 4 + a.spares)]
    back = NodeBack(a.node_down)
    for d in nodes:
        os.makedirs(d.root, exist_ok=True)
        d.start()
        own(d.proc)
    n1 = nodes[0]
    try:
        ckpt = os.path.join(work, f"ckpt-{run.launcher}-{int(run.faults)}")
        t0 = time.time()
        shape = ("--nnodes", "3:3", "--spares", str(a.spares)) if a.spares \
            else ("--nnodes", "2:3")
        res = n1.ctl("submit", *shape, "--max-restarts-per-window", "100", "--",
                     sys.executable, "-m", "elasticd.examples.train",
                     *train_args(ckpt, run.launcher),
                     env=torchrun_env())
        if res.returncode != 0:
            raise RuntimeError(f"submit failed: {res.stderr}")
        job_id = res.stdout.strip()
        # Rank 0's node, whose log is read and which is never killed: n1, or with spares
        # whichever node the first round put rank 0 on (the others may stand by first).
        home = rank0_node(nodes, job_id, t0 + 300) if a.spares else n1
        log0 = os.path.join(home.state_dir, "logs", job_id, "rank-0.log")

        def workers():
            try:
                job = home.job(job_id)
            except Exception:  # busy: try at the next tick
                return []
            return [w.pid for w in job.workers if w.state == "running" and w.pid > 0]

        def node_fault(rng) -> None:
            live = [d for d in nodes if d is not home and d.proc and d.proc.poll() is None]
            if a.spares:  # a member, never a spare: that is what spares are for
                try:
                    standing = list(home.job(job_id).spare_nodes)
                except Exception:  # busy: said as unknown
                    standing = ["?"]
                members = [d for d in live if d.node_id not in standing
                           and runs_ranks(d, job_id)]
                d = rng.choice(members or live)
                print(f"    node fault at +{time.time() - t0:.1f} s: kill -9 {d.node_id} "
                      f"({'a member' if d in members else 'NO MEMBER FOUND: a live node'}); "
                      f"standing by: {', '.join(standing) or 'none'}", flush=True)
            else:
                d = rng.choice(live)
            own_tree(d.proc.pid)
            d.kill()
            if run.launcher.endswith("-snap"):   # the node's memory goes with it
                shutil.rmtree(d.snapshot_dir, ignore_errors=True)
            back.later(lambda: own(d.start().proc))

        faults.drive(run, t0, a.duration, workers, log0, node_fault, back.tick)
        text = read_text(log0)
        if a.spares:  # the point of a spare: the job never runs with fewer nodes
            sizes = [int(w) for w in re.findall(r"^attempt \d+: world size (\d+)", text, re.M)]
            print(f"    {run.launcher}: {len(sizes)} attempts, world sizes "
                  f"{sorted(set(sizes))}, {sum(1 for w in sizes if w < 3)} below 3", flush=True)
        job = home.job(job_id)
        run.restarts = job.restarts
        if run.faults:
            from elasticd.v1 import control_pb2 as pb
            evs = home.events(job_id)
            if a.verbose:
                show_timeline(t0, run, evs, text, pb)
            print(f"  {run.launcher}, per fault:")
            show_breakdown(run, evs, text, pb)
        parse(run, text)
        run.restarts = job.restarts
    finally:
        for d in nodes:
            if d.proc and d.proc.poll() is None:
                own_tree(d.proc.pid)
        for d in nodes:
            d.stop(timeout=15)
        kill_owned()


def runs_ranks(d, job_id: str) -> bool:
    """Whether node ``d`` runs ranks of the job now: its own daemon's worker records, each
    pid alive (a daemon restarted after kill -9 still lists its dead workers as running)."""
    try:
        return any(w.node_id == d.node_id and w.pid > 0 and w.state == "running"
                   and psutil.pid_exists(w.pid) for w in d.job(job_id).workers)
    except Exception:  # busy or gone: not a member we can tell
        return False


def rank0_node(nodes: list, job_id: str, deadline: float):
    """The node whose daemon runs the job's rank 0 (once the first round started it)."""
    while time.time() < deadline:
        for d in nodes:
            try:
                if any(w.rank == 0 and w.node_id == d.node_id and w.pid > 0
                       for w in d.job(job_id).workers):
                    return d
            except Exception:  # not answering yet
                pass
        time.sleep(0.2)
    raise TimeoutError("no node ran rank 0 of the job in time")


def run_torchrun3(run: Run, a, work: str, faults: Faults, etcd) -> None:
    from etcd_server import free_port
    from common import own, own_tree
    root = tempdir("tdg3-")
    ckpt = os.path.join(work, f"ckpt-{run.launcher}-{int(run.faults)}")
    port = free_port()
    run_id = f"gp{os.getpid()}{time.monotonic_ns() % 10**8}"
    n = 3 + a.spares   # with spares: --nnodes 3:3, the extra agents wait (torch's spares)
    cmd = [*torchrun_bin(), "--nnodes", "3:3" if a.spares else "2:3", "--nproc-per-node", "1",
           "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--max-restarts", "100", "--monitor-interval", "0.1",
           *(["--rdzv-conf", "last_call_timeout=2"] if run.launcher.endswith("-lc2") else []),
           "-m", "elasticd.examples.train", *train_args(ckpt)]
    env = dict(torchrun_env(), PYTHONUNBUFFERED="1")
    agents: list = [None] * n
    logs = [os.path.join(root, f"agent{i}.log") for i in range(n)]
    back = NodeBack(a.node_down)

    def start(i: int) -> None:
        with open(logs[i], "ab") as fh:
            agents[i] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                         cwd=root, start_new_session=True)
        own(agents[i])

    t0 = time.time()
    try:
        for i in range(n):
            start(i)
            if i == 0:  # the first agent hosts the c10d store: let it bind
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and not any(
                        c.laddr.port == port and c.status == "LISTEN"
                        for c in psutil.net_connections("tcp")):
                    time.sleep(0.05)

        def trainers(i):
            try:
                return [p.pid for p in psutil.Process(agents[i].pid).children(recursive=True)
                        if "elasticd.examples.train" in " ".join(p.cmdline())
                        and p.status() != "zombie"]
            except psutil.Error:
                return []

        def workers():
            return [pid for i in range(n) if agents[i].poll() is None for pid in trainers(i)]

        def node_fault(rng) -> None:
            # Never agent 0: it hosts the c10d store (without it torchrun cannot go on);
            # with spares, one that runs ranks (not one waiting).
            live = [i for i in range(1, n) if agents[i].poll() is None]
            i = rng.choice(([i for i in live if trainers(i)] or live) if a.spares else live)
            own_tree(agents[i].pid)
            doomed = tree(agents[i].pid)
            kill_procs(doomed)
            back.later(lambda: start(i))

        # Rank 0 stays with agent 0: c10d orders a round's nodes by (host, pid).
        faults.drive(run, t0, a.duration, workers, logs[0], node_fault, back.tick)
        parse(run, read_text(logs[0]))  # (read before the agents are stopped)
    finally:
        for p in agents:
            if p is not None:
                own_tree(p.pid)
        kill_owned()


def show_breakdown(run: Run, events, log0: str, pb) -> None:
    """Per fault of an elasticd run: seconds from the kill until every node had stopped
    (its last RESTARTING event), until the ranks ran again on every node (the last
    RUNNING before the next first step), until that first step; the rounds formed."""
    firsts = sorted(float(m.group(1)) for m in map(FIRST_RE.match, log0.splitlines()) if m)
    moves = sorted((e.time, pb.JobState.Name(e.to_state), e.reason) for e in events
                   if e.kind == "state")
    rows = []
    kills = sorted(run.kills)
    for i, k in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        first = next((t for t in firsts if k < t < until), None)
        end = first if first is not None else until
        running = [(t, why) for t, to, why in moves if k <= t < end and to == "RUNNING"]
        # the stops of the first restart (a node back later moves to RESTARTING too)
        stop_end = running[0][0] if running else end
        stopped = [t for t, to, _ in moves if k <= t < stop_end and to == "RESTARTING"]
        rounds = {why.split(":")[0] for _, why in running}

        def s(t):
            return f"{t - k:.2f}" if t is not None else "-"
        rows.append([f"{i + 1}", s(stopped[-1] if stopped else None),
                     s(running[-1][0] if running else None), s(first), len(rounds)])
    print(table(rows, ["fault", "-> all stopped (s)", "-> running everywhere (s)",
                       "-> first step (s)", "rounds"]))


def show_timeline(t0: float, run: Run, events, log0: str, pb) -> None:
    """--verbose: the job's events, the kills and rank 0's attempts, seconds from launch."""
    rows = [(e.time, f"{e.kind:11s} {pb.JobState.Name(e.to_state) if e.to_state else '':10s} "
                     f"{e.reason[:140]}") for e in events]
    rows += [(k, "KILL") for k in run.kills]
    for line in log0.splitlines():
        m = FIRST_RE.match(line)
        if m:
            rows.append((float(m.group(1)), f"first step of attempt {m.group(2)} at step "
                                             f"{m.group(3)}"))
    for t, what in sorted(rows):
        print(f"    {t - t0:7.2f}  {what}")


def report(runs: list[Run], launchers: list[str], a) -> None:
    where = ("1 node" if a.nodes == 1 else
             f"3 nodes{spare_words(a)}, every {a.node_every}th fault a node's daemon/agent "
             f"(back after {a.node_down:g} s)")
    print(f"\n== goodput: {a.duration:g} s per run, a random worker SIGKILLed every "
          f"{a.fault_every:g} s; {where} ==")
    rows = []
    for L in launchers:
        base = next((r for r in runs if r.launcher == L and not r.faults), None)
        hit = next((r for r in runs if r.launcher == L and r.faults), None)
        if base is None or hit is None:
            continue
        good = hit.final_step / base.final_step if base.final_step else 0.0
        rec = (sum(hit.recover) / len(hit.recover)) if hit.recover else None
        rows.append([L, base.final_step, hit.final_step, f"{100 * good:.0f} %",
                     hit.restarts, f"{len(hit.kills)}" + (f" ({hit.skipped} skipped)"
                                                           if hit.skipped else ""),
                     f"{rec:.2f} s" if rec is not None else "-", hit.lost,
                     hit.error or base.error or ""])
    print(table(rows, ["launcher", "steps, no faults", "steps, faults", "goodput",
                       "restarts", "faults", "fault -> training", "steps lost to rollback",
                       "error"]))
    good = {r[0]: float(r[3].rstrip(" %")) for r in rows}
    emit_table_rows(rows, good, a)
    if a.nodes == 1:
        goals = (("elasticd-snap", 97, "torchrun"), ("elasticd", 90, "torchrun"))
    elif a.spares:
        goals = (("elasticd-snap", 95, "torchrun-c10d"),)
    else:
        goals = (("elasticd", 85, "torchrun-c10d"), ("elasticd-snap", 95, "torchrun-c10d"))
    for ours, goal, theirs in goals:
        if ours not in good:
            continue
        lead = good[ours] - good[theirs] if theirs in good else None
        print(f"goal ({a.nodes} node(s)): {ours} >= {goal} %: "
              f"{'PASS' if good[ours] >= goal else 'MISS'} ({good[ours]:.0f} %"
              + (f"; {theirs} {good[theirs]:.0f} %, {ours} ahead by {lead:.0f} points"
                 if lead is not None else "") + ")")


def spare_words(a) -> str:
    return (f" (+{a.spares} spare: {3 + a.spares} daemons/agents, the job --nnodes 3:3)"
            if a.spares else "")


def emit_table_rows(rows: list, good: dict, a) -> None:
    """The README's rows (bench/run_all.py): goodput and fault -> training, torchrun at
    its defaults and with our settings where torch has them (on 1 node: the same
    snapshots, elasticd.snapshot under torchrun; on 3: elasticd's last call)."""
    recover = {r[0]: r[6] for r in rows}

    def cell(name: str) -> str:
        return (f"{good[name]:.0f} % ({recover[name]} per fault)" if name in good
                else "not run")

    def ahead(ours: str, *theirs: str) -> str:
        return ", ".join(f"+{good[ours] - good[x]:.0f} points vs {x}" for x in theirs
                         if x in good)

    if a.nodes == 3 and a.spares:
        if "elasticd-snap" in good:
            emit_row("goodput-3nodes-spare",
                     elasticd=f"**{cell('elasticd-snap')}**, {a.duration:g} s, -snap",
                     torch=cell("torchrun-c10d"), matched=cell("torchrun-c10d-lc2"),
                     ratio=ahead("elasticd-snap", "torchrun-c10d", "torchrun-c10d-lc2"))
        return
    if a.nodes == 3:
        if "elasticd" in good:
            emit_row("goodput-3nodes", elasticd=f"**{cell('elasticd')}**, {a.duration:g} s",
                     torch=cell("torchrun-c10d"), matched=cell("torchrun-c10d-lc2"),
                     ratio=ahead("elasticd", "torchrun-c10d", "torchrun-c10d-lc2"))
        return
    if "elasticd-snap" in good:
        emit_row("goodput", elasticd=f"**{cell('elasticd-snap')}**, {a.duration:g} s",
                 torch=cell("torchrun"), matched=cell("torchrun-snap"),
                 ratio=ahead("elasticd-snap", "torchrun", "torchrun-snap"))
    if "elasticd" in good:
        emit_row("goodput-disk", elasticd=f"**{cell('elasticd')}**, {a.duration:g} s",
                 torch=cell("torchrun"), matched="", ratio=ahead("elasticd", "torchrun"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90.0, help="seconds per run (90)")
    ap.add_argument("--fault-every", type=float, default=10.0, help="seconds between kills")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--nodes", type=int, choices=(1, 3), default=1,
                    help="1: one node; 3: three daemons / torchrun agents on one etcd")
    ap.add_argument("--node-every", type=int, default=4,
                    help="with --nodes 3: every N-th fault kills a node's daemon (agent) "
                         "instead of a worker (4)")
    ap.add_argument("--node-down", type=float, default=3.0,
                    help="with --nodes 3: seconds before a killed node comes back (3)")
    ap.add_argument("--spares", type=int, choices=(0, 1), default=0,
                    help="with --nodes 3: one more node as a spare, the job --nnodes 3:3 "
                         "(elasticd --spares 1; torchrun's 4th agent waits); node faults "
                         "kill members only")
    ap.add_argument("--verbose", action="store_true",
                    help="print each elasticd run with faults as a timeline")
    ap.add_argument("--picture", metavar="SVG", default="",
                    help="also draw each launcher's step against time, faults marked, "
                         "to this SVG file (bench/README.md shows bench/goodput.svg)")
    ap.add_argument("--launchers", default=None,
                    help=f"default {','.join(LAUNCHERS)}; also {','.join(LAUNCHERS_MORE)} "
                         f"(3 nodes: {','.join(LAUNCHERS3)}; also "
                         f"{','.join(LAUNCHERS3_MORE)}; with --spares 1: "
                         f"{','.join(LAUNCHERS3_SPARE)})")
    a = ap.parse_args(argv)
    if a.spares and a.nodes != 3:
        ap.error("--spares needs --nodes 3")
    known = LAUNCHERS + LAUNCHERS_MORE if a.nodes == 1 else LAUNCHERS3 + LAUNCHERS3_MORE
    default = LAUNCHERS if a.nodes == 1 else LAUNCHERS3_SPARE if a.spares else LAUNCHERS3
    launchers = [L for L in (a.launchers or ",".join(default)).split(",") if L]
    bad = [L for L in launchers if L not in known]
    if bad:
        ap.error(f"unknown launcher(s) {bad}; pick from {known}")
    print(f"goodput.py --nodes {a.nodes}{f' --spares {a.spares}' if a.spares else ''}  {datetime.datetime.now():%Y-%m-%d %H:%M}  "
          f"rev {revision()}  {machine()}")
    work = tempdir("goodput-")
    runs = []
    etcd = None
    if a.nodes == 3:
        from etcd_server import EtcdServer
        etcd = EtcdServer().__enter__()
    try:
        for L in launchers:
            for with_faults in (False, True):
                run = Run(L, with_faults)
                faults = Faults(a.fault_every, a.seed, a.node_every if a.nodes == 3 else 0)
                started = time.time()
                try:
                    if a.nodes == 3:
                        (run_torchrun3 if L.startswith("torchrun") else run_elasticd3)(
                            run, a, work, faults, etcd)
                    else:
                        (run_torchrun if L.startswith("torchrun") else run_elasticd)(
                            run, a, work, faults)
                except Exception as exc:  # report it, go on with the others
                    run.error = f"{type(exc).__name__}: {exc}"
                print(f"  {L:13s} {'faults' if with_faults else 'no faults':9s}: step "
                      f"{run.final_step}, {len(run.kills)} faults ({run.node_kills} nodes), "
                      f"restarts {run.restarts}, lost {run.lost}, fault -> training "
                      f"[{', '.join(f'{t:.1f}' for t in run.recover)}] s  "
                      f"({time.time() - started:.0f} s)"
                      + (f"  ERROR {run.error}" if run.error else ""), flush=True)
                runs.append(run)
    finally:
        if etcd is not None:
            etcd.__exit__(None, None, None)
    report(runs, launchers, a)
    if a.picture:
        where = "1 node, 2 ranks" if a.nodes == 1 else "3 nodes" + spare_words(a)
        draw(a.picture, f"goodput.py --nodes {a.nodes} --duration {a.duration:g} --fault-every "
                        f"{a.fault_every:g} --seed {a.seed}; {where}; rev {revision()}",
             [(L, next((r.trace for r in runs if r.launcher == L and not r.faults), None),
               next((r.trace for r in runs if r.launcher == L and r.faults), None),
               next((r.kills for r in runs if r.launcher == L and r.faults), []))
              for L in launchers])
        print(f"picture: {a.picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
