"""Multi-node jobs end to end: several real elasticd daemons, one real etcd.

Each "node" is a real daemon on this machine with its own node id, control
socket and state dir, all joined to one etcd (each cluster under its own
key prefix, so clusters of different tests never meet). Tests drive them as
a user does (the real ``elasticctl`` against each node's socket) and check
what that user sees: the job's state and reason, ``status`` on a node that
did not submit the job, ``logs``, ``events``, ``nodes``; plus what the
workers saw (a probe writes each rank's torchrun environment into a shared
directory) and which processes are left (psutil).

The clusters that run many jobs turn warm spares off (``agent.warm_spares``):
each spare imports torch, which on a small CI machine costs more than the
jobs themselves; the node-loss-during-training tests keep the defaults.
"""
from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from daemons import DaemonProc, short_tmpdir
from elasticctl.output import job_dict
from elasticd.v1 import control_pb2 as pb
from etcd_server import EtcdServer, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")

PY = sys.executable
LEASE_TTL = 3.0           # membership.lease_ttl default: what "node loss" is measured against
NO_SPARES = ("--set", "agent.warm_spares=false")

# A worker that records the torchrun environment it was given (one JSON file
# per job, round and rank in OUT) and then trains, sleeps, or holds round 1.
PROBE = r'''
import json, os, runpy, sys, time
KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "ELASTICD_JOB_ID",
        "ELASTICD_ROUND", "ELASTICD_NODE_ID", "TORCHELASTIC_USE_AGENT_STORE")
out, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
env = {k: os.environ.get(k) for k in KEYS}
env["pid"] = os.getpid()
name = "%s-round%s-rank%s.json" % (env["ELASTICD_JOB_ID"], env["ELASTICD_ROUND"], env["RANK"])
with open(os.path.join(out, "." + name), "w") as fh:
    json.dump(env, fh)
os.replace(os.path.join(out, "." + name), os.path.join(out, name))
print("probe", env["ELASTICD_NODE_ID"], "rank", env["RANK"], flush=True)
if mode == "train-grow" and int(env["WORLD_SIZE"]) < 4:
    args = [*args, "--steps", "1000000"]   # trains until the job has grown to 4 ranks
if mode in ("train", "train-grow"):
    sys.argv = ["train", *args]
    runpy.run_module("elasticd.examples.train", run_name="__main__")
elif mode == "sleep":          # seconds for rank 0, seconds for the other ranks
    time.sleep(float(args[0] if env["RANK"] == "0" else args[1]))
elif mode == "hold-on":        # on args[0] nodes: run until stopped; on fewer: exit 0
    if env["GROUP_WORLD_SIZE"] == args[0]:
        time.sleep(600)
    time.sleep(0.5)
'''


# ---------------------------------------------------------------- the cluster

class Cluster:
    """Daemons n1..nK on one etcd under their own prefix, and a shared dir."""

    def __init__(self, etcd: EtcdServer, size: int, extra_args: tuple = ()):
        self.etcd = etcd
        self.prefix = f"/mt-{uuid.uuid4().hex[:8]}"
        self.extra_args = tuple(extra_args)
        self.shared = short_tmpdir("mt-")
        self.probe = os.path.join(self.shared, "probe.py")
        with open(self.probe, "w") as fh:
            fh.write(PROBE)
        self.out = os.path.join(self.shared, "env")
        os.makedirs(self.out)
        self.nodes: dict[str, DaemonProc] = {}
        self._seen: dict[int, float] = {}   # every process the daemons started
        with concurrent.futures.ThreadPoolExecutor(max(1, size)) as pool:
            list(pool.map(self.add, [f"n{i}" for i in range(1, size + 1)]))

    def add(self, node_id: str, extra_args: tuple = ()) -> DaemonProc:
        d = DaemonProc(short_tmpdir(), node_id=node_id, etcd=self.etcd.url, slots=4,
                       extra_args=("--etcd-prefix", self.prefix, *self.extra_args,
                                   *extra_args))
        self.nodes[node_id] = d
        d.start()
        return d

    def __getitem__(self, node_id: str) -> DaemonProc:
        return self.nodes[node_id]

    def remember_children(self) -> None:
        for d in self.nodes.values():
            if d.proc is not None and d.proc.poll() is None:
                try:
                    for p in psutil.Process(d.proc.pid).children(recursive=True):
                        self._seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    pass

    def close(self) -> None:
        self.remember_children()
        for d in self.nodes.values():
            d.stop()
        for pid, created in self._seen.items():  # nothing a test started may outlive it
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01:
                    p.kill()
            except psutil.Error:
                pass
        for d in self.nodes.values():
            shutil.rmtree(d.root, ignore_errors=True)
        shutil.rmtree(self.shared, ignore_errors=True)

    # -- jobs ------------------------------------------------------------------
    def probe_cmd(self, mode: str, *args: str) -> list[str]:
        return [PY, self.probe, self.out, mode, *args]

    def train_cmd(self, name: str, *args: str, mode: str = "train") -> list[str]:
        ckpt = os.path.join(self.shared, f"ckpt-{name}")
        return self.probe_cmd(mode, "--checkpoint-dir", ckpt, *args)

    def envs(self, job_id: str, rnd: int | None = None) -> list[dict]:
        """What each rank of the job saw (latest round if ``rnd`` is None)."""
        files = glob.glob(os.path.join(self.out, f"{job_id}-round*-rank*.json"))
        found = [json.load(open(f)) for f in files]
        if not found:
            return []
        rnd = rnd if rnd is not None else max(int(e["ELASTICD_ROUND"]) for e in found)
        return sorted((e for e in found if int(e["ELASTICD_ROUND"]) == rnd),
                      key=lambda e: int(e["RANK"]))


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def trio(etcd):
    """Three nodes for the tests that do not lose one. A longer last call than
    the default keeps a 2:3 round from closing without a node that is slow to
    adopt the job on a loaded machine."""
    c = Cluster(etcd, 3, NO_SPARES + ("--set", "rendezvous.last_call=5"))
    yield c
    c.close()


@pytest.fixture
def make_cluster(etcd):
    made = []

    def make(size: int, extra_args: tuple = ()) -> Cluster:
        c = Cluster(etcd, size, extra_args)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------- helpers

def ctl_ok(d: DaemonProc, *args: str, **kw) -> subprocess.CompletedProcess:
    res = d.ctl(*args, **kw)
    assert res.returncode == 0, (f"elasticctl {' '.join(args)} on {d.node_id} exited "
                                 f"{res.returncode}\nstdout: {res.stdout}\nstderr: {res.stderr}")
    return res


def submit(d: DaemonProc, *args: str, cmd: list[str]) -> str:
    out = ctl_ok(d, "submit", *args, "--", *cmd).stdout.strip()
    assert out and len(out.split()) == 1, f"submit should print just the job id, got {out!r}"
    return out


def status(d: DaemonProc, job_id: str) -> dict:
    return json.loads(ctl_ok(d, "-o", "json", "status", job_id).stdout)


def polled(d: DaemonProc, job_id: str) -> dict:
    """What ``status`` says, read over the daemon's socket in this process and made by
    elasticctl's own ``job_dict``: for the looks a wait repeats (an elasticctl run costs
    a third of a second of CPU); what a case asserts last, ``status`` asks elasticctl."""
    return job_dict(d.job(job_id))


def events(d: DaemonProc, job_id: str) -> list[dict]:
    out = ctl_ok(d, "-o", "json", "events", job_id).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def wait_done(d: DaemonProc, job_id: str, timeout: float = 120.0) -> dict:
    d.wait_job(job_id, timeout)
    return status(d, job_id)


def wait_for(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def rank_log(d: DaemonProc, job_id: str, rank: int) -> str:
    """`elasticctl logs JOB --rank R` on the node that runs R."""
    return ctl_ok(d, "logs", job_id, "--rank", str(rank)).stdout


def local_rows(d: DaemonProc, job_id: str) -> list[dict]:
    """This node's own worker rows (pid, rank) from its status."""
    return [w for w in status(d, job_id).get("workers", []) if w["node_id"] == d.node_id]


def procs(rows: list[dict]) -> list[psutil.Process]:
    out = []
    for w in rows:
        try:
            out.append(psutil.Process(w["pid"]))
        except psutil.NoSuchProcess:
            pass
    return out


def descendants(d: DaemonProc) -> list[psutil.Process]:
    """Every process a daemon runs now: workers, warm spares, anything they forked."""
    try:
        return psutil.Process(d.proc.pid).children(recursive=True)
    except psutil.Error:
        return []


def alive(ps: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for p in ps:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    return left


def running_on(d: DaemonProc, job_id: str, nodes: int, timeout: float = 90) -> dict:
    """Wait until the job runs with workers on ``nodes`` nodes (as ``d`` sees it)."""
    last = {}

    def running(st: dict) -> bool:
        live = {w["node_id"] for w in st.get("workers", []) if w["state"] == "running"}
        return st["state"] == "RUNNING" and len(live) == nodes

    def ready():
        # Polled over the daemon's socket (an elasticctl run costs a third of a second
        # of CPU); once it holds, `elasticctl status` says it too, and is the answer.
        job = d.job(job_id)
        last["st"] = {"state": pb.JobState.Name(job.state), "reason": job.reason,
                      "workers": [{"node_id": w.node_id, "rank": w.rank, "state": w.state}
                                  for w in job.workers]}
        if not running(last["st"]):
            return None
        st = last["st"] = status(d, job_id)
        return st if running(st) else None
    try:
        return wait_for(ready, timeout, f"job {job_id} running on {nodes} nodes", interval=0.3)
    except AssertionError as exc:
        st = last.get("st", {})
        rows = [(w["node_id"], w["rank"], w["state"]) for w in st.get("workers", [])]
        moves = "\n".join(f"  {e.get('node_id')}: {e.get('from_state')} -> {e.get('to_state')}: "
                          f"{e.get('reason')}" for e in events(d, job_id))
        raise AssertionError(f"{exc}; it is {st.get('state')} ({st.get('reason')}), "
                             f"workers {rows}; events on {d.node_id}:\n{moves}") from None


def state_moves(evs: list[dict]) -> list[tuple]:
    return [(e.get("from_state"), e.get("to_state"), e.get("reason", "")) for e in evs
            if e["kind"] == "state"]


def check_envs(envs: list[dict], job_id: str, nodes: int, nproc: int) -> dict[int, str]:
    """Every rank's torchrun environment agrees; returns rank -> node id."""
    world = nodes * nproc
    assert [int(e["RANK"]) for e in envs] == list(range(world)), envs
    masters = {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}
    assert len(masters) == 1, f"ranks disagree on the master: {masters}"
    by_group = {}
    for e in envs:
        assert int(e["WORLD_SIZE"]) == world and int(e["ROLE_WORLD_SIZE"]) == world
        assert int(e["GROUP_WORLD_SIZE"]) == nodes
        assert int(e["LOCAL_WORLD_SIZE"]) == nproc
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * nproc + int(e["LOCAL_RANK"])
        assert e["ROLE_RANK"] == e["RANK"]
        assert e["TORCHELASTIC_RUN_ID"] == job_id == e["ELASTICD_JOB_ID"]
        by_group.setdefault(int(e["GROUP_RANK"]), set()).add(e["ELASTICD_NODE_ID"])
    # one node per group rank, one group rank per node
    assert sorted(by_group) == list(range(nodes))
    assert all(len(v) == 1 for v in by_group.values()), by_group
    assert len({next(iter(v)) for v in by_group.values()}) == nodes
    return {int(e["RANK"]): e["ELASTICD_NODE_ID"] for e in envs}


# ---------------------------------------------------------------- one job, three nodes

@pytest.fixture(scope="module")
def three_node_job(trio):
    """A 2:3 training job, two ranks per node, submitted on n1, run to the end."""
    job = submit(trio["n1"], "--nnodes", "2:3", "--nproc-per-node", "2",
                 cmd=trio.train_cmd("three", "--steps", "30", "--checkpoint-every", "10"))
    final = wait_done(trio["n1"], job)
    return job, final


def test_job_submitted_on_one_node_runs_on_three_with_global_ranks(trio, three_node_job):
    job, final = three_node_job
    assert final["state"] == "SUCCEEDED", final
    assert final["restarts"] == 0
    # What the workers were given: one torchrun world of 6 ranks over 3 nodes.
    envs = trio.envs(job)
    node_of = check_envs(envs, job, nodes=3, nproc=2)
    assert set(node_of.values()) == {"n1", "n2", "n3"}
    # The training script's own check: every all_reduce summed right.
    rank0 = trio[node_of[0]]
    log = rank_log(rank0, job, 0)
    assert "done: 30 steps, world size 6, all_reduce check ok" in log, log[-3000:]


def test_status_on_a_node_that_did_not_submit_lists_every_nodes_workers(trio, three_node_job):
    job, _ = three_node_job
    node_of = {int(e["RANK"]): e["ELASTICD_NODE_ID"] for e in trio.envs(job)}
    for viewer in ("n2", "n3"):
        st = status(trio[viewer], job)
        assert st["state"] == "SUCCEEDED"
        assert st["node_id"] == "n1", "status should name the node the job was submitted on"
        rows = st["workers"]
        assert sorted(w["rank"] for w in rows) == list(range(6)), rows
        assert {w["node_id"] for w in rows} == {"n1", "n2", "n3"}
        assert {w["rank"]: w["node_id"] for w in rows} == node_of
        assert all(w["pid"] > 0 for w in rows)


def test_logs_for_a_rank_on_another_node_says_where_it_runs(trio, three_node_job):
    job, _ = three_node_job
    node_of = {int(e["RANK"]): e["ELASTICD_NODE_ID"] for e in trio.envs(job)}
    rank = max(r for r, n in node_of.items() if n != "n1")
    res = trio["n1"].ctl("logs", job, "--rank", str(rank))
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert f"node {node_of[rank]}" in res.stderr, res.stderr
    assert f"--rank {rank}" in res.stderr, "it should say what to run there"
    # ... and there it works.
    assert "probe" in rank_log(trio[node_of[rank]], job, rank)


@pytest.fixture(scope="module")
def cancelled_job(trio):
    """A 3-node job cancelled on n1 while every node's workers run."""
    job = submit(trio["n1"], "--nnodes", "3", cmd=trio.probe_cmd("sleep", "600", "600"))
    running_on(trio["n1"], job, 3)
    trio.remember_children()
    workers = procs(sum((local_rows(trio[n], job) for n in ("n1", "n2", "n3")), []))
    t0 = time.monotonic()
    res = trio["n1"].ctl("cancel", job)
    # The workers first (a look at their processes): each `status` below is an
    # elasticctl process of its own, seconds apiece on a loaded machine.
    wait_for(lambda: not alive(workers), 10, "every node's workers to stop", interval=0.1)
    stopped = time.monotonic() - t0
    ended = {}
    for node in ("n1", "n2", "n3"):
        st = wait_for(lambda: (s := status(trio[node], job))["state"] in
                      ("CANCELLED", "FAILED", "SUCCEEDED") and s, 15, f"{node} to end the job")
        ended[node] = (st["state"], time.monotonic() - t0)
    # Witness that every node's last worker rows reached every node: all 3 say stopped.
    for viewer in ("n1", "n2", "n3"):
        wait_for(lambda: [w["state"] for w in status(trio[viewer], job)["workers"]] ==
                 ["stopped"] * 3, 15, f"{viewer} to see every worker stopped")
    return {"job": job, "cancel": res, "ended": ended, "stopped": stopped, "workers": workers}


def test_cancel_on_one_node_stops_the_job_on_every_node(cancelled_job):
    res = cancelled_job["cancel"]
    assert res.returncode == 0, (res.stdout, res.stderr)
    # It answers at once; the nodes end the job in the background.
    assert "cancelling" in res.stdout or "CANCELLED" in res.stdout, res.stdout
    assert {n: s for n, (s, _) in cancelled_job["ended"].items()} == \
        {"n1": "CANCELLED", "n2": "CANCELLED", "n3": "CANCELLED"}
    assert len(cancelled_job["workers"]) == 3
    assert cancelled_job["stopped"] < 10


def test_status_after_cancel_shows_no_worker_still_running(trio, cancelled_job):
    job = cancelled_job["job"]
    for viewer in ("n1", "n2", "n3"):
        rows = status(trio[viewer], job)["workers"]
        assert len(rows) == 3
        states = [(w["node_id"], w["state"]) for w in rows]
        assert not [s for s in states if s[1] == "running"], (viewer, states)


def test_two_jobs_at_once_do_not_mix_ranks_or_ports(trio):
    jobs = [submit(trio[node], "--nnodes", "3",
                   cmd=trio.train_cmd(f"pair-{node}", "--steps", "20"))
            for node in ("n1", "n2")]
    finals = [wait_done(trio[node], job) for node, job in zip(("n1", "n2"), jobs)]
    assert [f["state"] for f in finals] == ["SUCCEEDED", "SUCCEEDED"], finals
    masters = []
    for job in jobs:
        envs = trio.envs(job)
        node_of = check_envs(envs, job, nodes=3, nproc=1)
        masters.append((envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"]))
        log = rank_log(trio[node_of[0]], job, 0)
        assert "world size 3, all_reduce check ok" in log, log[-3000:]
    assert masters[0] != masters[1], f"both jobs were given the same master {masters[0]}"


def test_nodes_flag_pins_a_job_to_those_nodes(trio):
    # 2:3 with n2 free: only the named nodes may run it.
    job = submit(trio["n1"], "--nnodes", "2:3", "--nodes", "n1,n3",
                 cmd=trio.probe_cmd("sleep", "0.5", "0.5"))
    final = wait_done(trio["n1"], job)
    assert final["state"] == "SUCCEEDED", final
    assert {w["node_id"] for w in final["workers"]} == {"n1", "n3"}
    envs = trio.envs(job)
    assert {e["ELASTICD_NODE_ID"] for e in envs} == {"n1", "n3"}
    check_envs(envs, job, nodes=2, nproc=1)
    # n2 never adopted it: no record there, but status still shows it, from etcd.
    assert job not in trio["n2"].ctl("list").stdout
    res = trio["n2"].ctl("status", job)
    assert res.returncode == 0 and "this node does not run it; ran on n1, n3" in res.stdout, \
        (res.stdout, res.stderr)


def test_nodes_flag_excludes_the_submitting_node(trio):
    job = submit(trio["n2"], "--nnodes", "2:3", "--nodes", "n1,n3",
                 cmd=trio.probe_cmd("sleep", "0.5", "0.5"))
    final = wait_done(trio["n2"], job)
    assert final["state"] == "SUCCEEDED", final
    assert {e["ELASTICD_NODE_ID"] for e in trio.envs(job)} == {"n1", "n3"}


# ---------------------------------------------------------------- too few nodes

@pytest.fixture(scope="module")
def below_min(etcd):
    """A job needing 3 nodes on a cluster of 2 (join timeout 5 s): its outcome."""
    c = Cluster(etcd, 2, NO_SPARES + ("--set", "rendezvous.join_timeout=5"))
    try:
        t0 = time.monotonic()
        job = submit(c["n1"], "--nnodes", "3", cmd=c.probe_cmd("sleep", "0", "0"))
        waiting = status(c["n1"], job)
        res = c["n1"].ctl("wait", job, timeout=60)
        elapsed = time.monotonic() - t0
        final = status(c["n1"], job)
        other = wait_for(lambda: (s := status(c["n2"], job))["state"] == "FAILED" and s, 15,
                         "n2 to record the failure")
        yield {"job": job, "waiting": waiting, "wait": res, "elapsed": elapsed,
               "final": final, "other": other, "workers": c.envs(job)}
    finally:
        c.close()


def test_job_needing_more_nodes_than_alive_waits_then_fails(below_min):
    assert below_min["waiting"]["state"] in ("PENDING", "RENDEZVOUS")
    assert below_min["wait"].returncode == 1, below_min["wait"]
    final = below_min["final"]
    assert final["state"] == "FAILED", final
    assert below_min["elapsed"] >= 5.0, "it failed before the join timeout"
    assert below_min["elapsed"] < 30.0
    assert "2 of the 3 nodes" in final["reason"] and "5s" in final["reason"], final["reason"]
    assert below_min["other"]["reason"] == final["reason"]
    assert below_min["workers"] == [], "no worker may start below the job's min nodes"


def test_below_min_failure_names_the_nodes(below_min):
    reason = below_min["final"]["reason"]
    assert "n1" in reason and "n2" in reason, reason


# ---------------------------------------------------------------- node loss

def test_node_lost_survivors_stop_within_the_lease_ttl_and_finish_on_two(make_cluster):
    """kill -9 of a daemon whose workers hang on: only its lease says it is gone."""
    c = make_cluster(3, NO_SPARES)
    job = submit(c["n1"], "--nnodes", "2:3", "--max-restarts", "2",
                 cmd=c.probe_cmd("hold-on", "3"))
    running_on(c["n1"], job, 3)
    c.remember_children()
    victims = procs(local_rows(c["n3"], job))
    tree = descendants(c["n3"])
    survivors = procs(local_rows(c["n1"], job) + local_rows(c["n2"], job))
    assert len(victims) == 1 and len(survivors) == 2
    t0 = time.monotonic()
    c["n3"].kill()
    wait_for(lambda: not alive(victims + tree), 5, "the dead node's workers to die with it")
    wait_for(lambda: not alive(survivors), LEASE_TTL + 4, "the survivors to stop their workers")
    noticed = time.monotonic() - t0
    final = wait_done(c["n1"], job, 60)
    assert final["state"] == "SUCCEEDED", final
    assert final["restarts"] == 1, "a lost node is one restart"
    envs = c.envs(job)
    assert {e["ELASTICD_NODE_ID"] for e in envs} == {"n1", "n2"}
    check_envs(envs, job, nodes=2, nproc=1)
    moves = state_moves(events(c["n2"], job))
    lost = [i for i, (_, to, why) in enumerate(moves)
            if to == "RESTARTING" and "n3" in why and "lost" in why]
    assert lost, moves
    # (On a loaded machine n3 may join after the first round closed on two nodes: the
    # round on three is then round 2, and the one after the loss round 3.)
    assert any(to == "RUNNING" and "on 2 node(s)" in why for _, to, why in moves[lost[0]:]), \
        moves
    nodes = json.loads(ctl_ok(c["n1"], "-o", "json", "nodes").stdout)["nodes"]
    assert {n["node_id"]: n["state"] for n in nodes}.get("n3") == "lost", nodes
    print(f"survivors stopped their workers {noticed:.2f}s after kill -9")


def _train_on_three(c: Cluster, steps: int) -> str:
    """A 2:3 training job submitted on n1, once its first step is done."""
    job = submit(c["n1"], "--nnodes", "2:3", "--max-restarts", "2",
                 cmd=c.train_cmd("loss", "--steps", str(steps), "--step-time", "0.05",
                                 "--checkpoint-every", "10", "--log-every", "1000"))
    running_on(c["n1"], job, 3)
    node_of = {int(e["RANK"]): e["ELASTICD_NODE_ID"] for e in c.envs(job)}
    wait_for(lambda: "FIRST_STEP" in rank_log(c[node_of[0]], job, 0), 90,
             "the first training step", interval=0.3)
    return job


@pytest.mark.slow  # a node killed mid-training, its lease left to expire: most of a minute
def test_node_killed_mid_training_job_restarts_on_survivors_and_succeeds(make_cluster):
    c = make_cluster(3)
    job = _train_on_three(c, steps=100)
    time.sleep(1.0)  # well into training
    c.remember_children()
    victims = procs(local_rows(c["n3"], job))
    tree = descendants(c["n3"])  # its worker and, by now, maybe its warm spare
    survivors = procs(local_rows(c["n1"], job) + local_rows(c["n2"], job))
    t0 = time.monotonic()
    c["n3"].kill()
    wait_for(lambda: not alive(victims + tree), 5,
             "the dead node's workers (and spares) to die with it")
    wait_for(lambda: not alive(survivors), LEASE_TTL + 4, "the survivors to stop their workers")
    final = wait_done(c["n1"], job, 150)
    assert final["state"] == "SUCCEEDED", final
    assert 1 <= final["restarts"] <= 2
    envs = c.envs(job)
    assert {e["ELASTICD_NODE_ID"] for e in envs} == {"n1", "n2"}
    node_of = check_envs(envs, job, nodes=2, nproc=1)
    log = rank_log(c[node_of[0]], job, 0)
    assert "done: 100 steps, world size 2, all_reduce check ok" in log, log[-3000:]
    moves = state_moves(events(c["n1"], job))
    assert any(to == "RUNNING" and "of 2 on 2 node(s)" in why for _, to, why in moves), moves
    assert not alive(victims + tree)
    print(f"survivors stopped their workers; job done {time.monotonic() - t0:.1f}s after "
          f"kill -9; restarts {final['restarts']}")


def _rounds_run(d: DaemonProc, job_id: str) -> list[int]:
    """The rounds ``d``'s node started its ranks in, in order (its daemons before a
    restart included: the events are kept with the job)."""
    return [e.round for e in d.events(job_id) if e.node_id == d.node_id
            and e.kind == "state" and pb.JobState.Name(e.to_state) == "RUNNING"]


def test_a_daemon_restarted_within_its_lease_never_runs_its_last_round_again(make_cluster):
    """kill -9 of n2's daemon and a restart while its old lease lives (10 s here): the
    round its ranks died in is still closed in etcd, its old join vouching for it. The
    restarted daemon waits for n1 to see it lost and runs the next round, never that
    one again (the chaos soak's safety property 1, seen broken once in a soak)."""
    c = make_cluster(2, NO_SPARES + ("--set", "membership.lease_ttl=10"))
    job = submit(c["n1"], "--nnodes", "2", cmd=c.probe_cmd("sleep", "600", "600"))
    wait_for(lambda: all(_rounds_run(c[n], job) for n in ("n1", "n2")), 90,
             "the job running on both nodes")
    before = _rounds_run(c["n2"], job)
    c["n2"].kill()
    c["n2"].start()
    wait_for(lambda: max(_rounds_run(c["n2"], job)) > max(before), 90,
             "n2 running a later round")
    ran = _rounds_run(c["n2"], job)
    assert all(a < b for a, b in zip(ran, ran[1:])), f"n2 ran rounds {ran}"
    ctl_ok(c["n1"], "cancel", job)


@pytest.mark.slow
def test_rank0_node_killed_its_successor_logs_as_rank0(make_cluster):
    c = make_cluster(3)  # defaults: warm spares on
    job = _train_on_three(c, steps=300)
    daemon_pids = {n: c[n].proc.pid for n in ("n2", "n3")}

    def spares_ready():
        ready = 0
        for node, pid in daemon_pids.items():
            kids = psutil.Process(pid).children(recursive=True)
            ready += any("workers/warmstart.py" in " ".join(k.cmdline()) for k in kids)
        return ready == 2
    wait_for(spares_ready, 60, "warm spares on the survivors", interval=0.3)
    c.remember_children()
    c["n1"].kill()
    final = wait_done(c["n2"], job, 150)
    assert final["state"] == "SUCCEEDED", final
    node_of = check_envs(c.envs(job), job, nodes=2, nproc=1)
    assert node_of[0] == "n2"
    log = rank_log(c["n2"], job, 0)
    old = c["n2"].rank_log(job, 1)  # the rank n2 had in round 1
    assert "done: 300 steps, world size 2, all_reduce check ok" in log, \
        f"rank-0.log on n2:\n{log[-1500:]}\nrank-1.log on n2:\n{old[-1500:]}"


# ---------------------------------------------------------------- scale-up

def test_fourth_node_started_later_joins_a_running_job(make_cluster):
    c = make_cluster(3, NO_SPARES)
    job = submit(c["n1"], "--nnodes", "2:4", "--max-restarts", "1",
                 cmd=c.train_cmd("grow", "--steps", "100", "--step-time", "0.05",
                                 "--checkpoint-every", "20", "--log-every", "1000",
                                 mode="train-grow"))
    running_on(c["n1"], job, 3)
    wait_for(lambda: "FIRST_STEP" in rank_log(c["n1"], job, 0), 90, "the first step",
             interval=0.3)
    # Every round of fewer than 4 ranks trains on, however long n4 takes to start (a
    # loaded machine may also form round 1 of two nodes and round 2 of three); the
    # round with n4 finishes the 100 steps. n4 asks at once rather than after its
    # template's imports (the newcomer warm-up has its own cases below).
    c.add("n4", ("--set", "rendezvous.newcomer_warm_timeout=0"))
    final = wait_done(c["n1"], job, 150)
    assert final["state"] == "SUCCEEDED", final
    assert final["restarts"] == 0, "growing the job is not a restart"
    envs = c.envs(job)
    assert int(envs[0]["ELASTICD_ROUND"]) >= 2
    node_of = check_envs(envs, job, nodes=4, nproc=1)
    # the old members kept their ranks; the newcomer came after them
    assert node_of == {0: "n1", 1: "n2", 2: "n3", 3: "n4"}
    rows = status(c["n2"], job)["workers"]
    assert {w["node_id"] for w in rows} == {"n1", "n2", "n3", "n4"}
    assert sorted(w["rank"] for w in rows) == [0, 1, 2, 3]
    log = rank_log(c["n1"], job, 0)
    assert "world size 3" in log and "world size 4, all_reduce check ok" in log, log[-3000:]
    moves = state_moves(events(c["n4"], job))
    assert any(to == "RUNNING" and "of 4 on 4 node(s)" in why for _, to, why in moves), moves


@pytest.mark.slow
def test_a_node_joining_a_running_job_warms_its_spares_before_it_asks(make_cluster):
    """Issue 22, 3-node goodput: a node that came back (or started later) asked to
    join at once; every member restarted to let it in, and then waited in
    init_process_group while the newcomer's rank imported torch cold (seconds:
    each node that came back stalled the job for its cold start). It now starts
    its warm spares first, asks once they have imported, and its rank takes over
    a spare; the job trains on meanwhile."""
    spares_only = ("--set", "agent.worker_template=false")  # warm spares: the fallback path
    c = make_cluster(1, spares_only)
    job = submit(c["n1"], "--nnodes", "1:2",
                 cmd=c.train_cmd("warmjoin", "--steps", "100000", "--step-time", "0.05",
                                 "--checkpoint-every", "20", "--log-every", "1000"))
    running_on(c["n1"], job, 1, timeout=120)
    wait_for(lambda: "FIRST_STEP" in rank_log(c["n1"], job, 0), 120, "the first step",
             interval=0.3)
    c.add("n2")                  # the cluster's extra args: spares only there too
    wait_for(lambda: any("starting warm spares" in e.get("reason", "")
                         for e in events(c["n2"], job)), 120, "n2 to start its warm-up",
             interval=0.2)
    # A fault while n2 warms up: the round it opens expects n1 only; n2 must not
    # join it cold (its members would wait for its imports) but ask once warm.
    os.kill(local_rows(c["n1"], job)[0]["pid"], 9)
    running_on(c["n1"], job, 2, timeout=180)
    evs = events(c["n2"], job)
    asked = [e for e in evs if "; asking to join" in e.get("reason", "")]
    assert asked and "warm spares ready after" in asked[0]["reason"], evs
    ran = [e for e in evs if e["kind"] == "state" and e.get("to_state") == "RUNNING"
           and e.get("node_id") == "n2"]
    assert ran and ran[0]["time"] >= asked[0]["time"], (asked, ran)
    moves = state_moves(events(c["n1"], job))
    assert any(to == "RUNNING" and "of 1 on 1 node(s)" in why for _, to, why in moves), moves
    assert any(to == "RUNNING" and "of 2 on 2 node(s)" in why for _, to, why in moves), moves
    log = rank_log(c["n2"], job, 1)
    banners = [line for line in log.splitlines() if line.startswith("==== elasticd:")]
    assert banners and "from a warm spare" in banners[0], log[-2000:]
    ctl_ok(c["n1"], "cancel", job)
    assert wait_done(c["n1"], job, 60)["state"] == "CANCELLED"


@pytest.mark.slow
def test_a_node_joining_a_running_job_waits_for_its_worker_template(make_cluster):
    """The same with the worker template (the default): the joining node asks once its
    template has imported torch, and its rank is forked from it, never cold."""
    c = make_cluster(1)
    job = submit(c["n1"], "--nnodes", "1:2",
                 cmd=c.train_cmd("tmpljoin", "--steps", "100000", "--step-time", "0.05",
                                 "--checkpoint-every", "20", "--log-every", "1000"))
    running_on(c["n1"], job, 1, timeout=120)
    wait_for(lambda: "FIRST_STEP" in rank_log(c["n1"], job, 0), 120, "the first step",
             interval=0.3)
    c.add("n2")
    running_on(c["n1"], job, 2, timeout=180)
    evs = events(c["n2"], job)
    asked = [e for e in evs if "worker template ready; asking to join" in e.get("reason", "")]
    assert asked, evs
    ran = [e for e in evs if e["kind"] == "state" and e.get("to_state") == "RUNNING"
           and e.get("node_id") == "n2"]
    assert ran and ran[0]["time"] >= asked[0]["time"], (asked, ran)
    log = rank_log(c["n2"], job, 1)
    banners = [line for line in log.splitlines() if line.startswith("==== elasticd:")]
    assert banners and "from the worker template" in banners[0], log[-2000:]
    ctl_ok(c["n1"], "cancel", job)
    assert wait_done(c["n1"], job, 60)["state"] == "CANCELLED"


def test_a_joining_node_asks_at_once_with_the_warm_up_off(make_cluster):
    """rendezvous.newcomer_warm_timeout=0: the node asks as soon as it sees the job
    (as before issue 22's fix); its rank starts cold."""
    c = make_cluster(1)
    job = submit(c["n1"], "--nnodes", "1:2",
                 cmd=c.probe_cmd("sleep", "600", "600"))
    running_on(c["n1"], job, 1)
    c.add("n2", ("--set", "rendezvous.newcomer_warm_timeout=0"))
    running_on(c["n1"], job, 2, timeout=120)
    assert not [e for e in events(c["n2"], job) if "asking to join" in e.get("reason", "")]
    banners = [line for line in rank_log(c["n2"], job, 1).splitlines()
               if line.startswith("==== elasticd:")]
    assert banners and "from a warm spare" not in banners[0], banners
    ctl_ok(c["n1"], "cancel", job)
    assert wait_done(c["n1"], job, 60)["state"] == "CANCELLED"


# ---------------------------------------------------------------- submit vs. dispatch

class InProcessNode:
    """One node's Coordinator, JobsView and Dispatcher in this process, on a MemoryStore
    (the dispatcher is not started: tests call tick() when they want it to run)."""

    def __init__(self, root: str, node_id: str = "n1"):
        from elasticd.config import load
        from elasticd.cluster.dispatch import Dispatcher
        from elasticd.jobs.registry import JobRegistry
        from elasticd.node.coordinator import Coordinator
        from elasticd.rendezvous.view import JobsView
        from elasticd.store import MemoryStore
        from elasticd.trust.clusterkey import ephemeral
        from elasticd.trust.specs import SpecCodec

        self.cfg = load(None, env={}, overrides={
            "daemon.standalone": True, "daemon.node_id": node_id, "daemon.slots": 4,
            "daemon.state_dir": os.path.join(root, "state"),
            "daemon.socket": os.path.join(root, "c.sock"), "agent.warm_spares": False})
        self.root = root
        self.store = MemoryStore()
        self.registry = JobRegistry(self.cfg.daemon.state_dir, node_id)
        self.codec = SpecCodec(ephemeral(), self.cfg.control)
        self.view = JobsView(self.store, records=self.codec.records, retry=0.2,
                             open_spec=self.codec.open)
        self.view.start()
        node = self

        class FakeCluster:
            address = "127.0.0.1"
            store = node.store
            keeper = type("K", (), {"lease": None})()

            def drain_states(self):
                return {}

        self.cluster = FakeCluster()
        self.manager = Coordinator(self.cfg, self.registry, self.cluster, self.view,
                                  codec=self.codec)
        self.dispatcher = Dispatcher(self.cfg, self.view, self.registry, self.manager,
                                     self.cluster)

    def submit(self, *command: str, **kw):
        from elasticd.control.auth import Caller
        from elasticd.control.validation import JobRequest
        return self.manager.submit(JobRequest(command=tuple(command), cwd=self.root,
                                              env=dict(os.environ), **kw),
                                   Caller(os.geteuid(), os.getegid(), os.getpid()))

    def wait_end(self, job_id: str, timeout: float = 30.0):
        return wait_for(lambda: (j := self.registry.get(job_id)).state.value in
                        ("SUCCEEDED", "FAILED", "CANCELLED") and j, timeout, "the job to end")

    def close(self) -> None:
        self.manager.shutdown(10)
        self.view.stop()
        self.registry.close()


def _dispatch_right_after_the_store_write(node: "InProcessNode") -> list:
    """Make the submit/dispatch race deterministic: run the node's dispatcher as soon
    as submit has written the job's round state (what the watch-woken dispatcher
    thread may do). Before the fix, submit wrote to the store before creating its
    local record, the dispatcher adopted the job in between, the record was created
    twice and its agent crashed ('cannot move from PENDING to RUNNING')."""
    real_create = node.store.create
    adopted: list = []

    def create_then_dispatch(key, value, lease=None):
        rev = real_create(key, value, lease)
        if key.endswith("/state"):
            job_id = key.split("/")[-2]
            wait_for(lambda: (k := node.view.job(job_id)) is not None and k.state is not None,
                     5, "the view to see the new job")
            adopted.extend(node.dispatcher.tick())
        return rev

    node.store.create = create_then_dispatch
    return adopted


def test_submit_is_not_adopted_a_second_time_by_its_own_dispatcher(tmp_short):
    node = InProcessNode(tmp_short)
    adopted = _dispatch_right_after_the_store_write(node)
    try:
        rec = node.submit(PY, "-c", "pass")
        final = node.wait_end(rec.id)
        submitted = [e for e in node.registry.events(0, rec.id)
                     if e.reason.startswith("submitted")]
        assert final.state.value == "SUCCEEDED", final.reason
        assert len(submitted) == 1, submitted
        assert adopted == [], f"the submitting node adopted its own job: {adopted}"
    finally:
        node.close()


def test_named_submit_is_not_refused_because_of_itself(tmp_short):
    from elasticd import errors

    node = InProcessNode(tmp_short)
    _dispatch_right_after_the_store_write(node)
    try:
        try:
            rec = node.submit(PY, "-c", "pass", name="bert")
        except errors.AlreadyExists as exc:
            pytest.fail(f"submit refused a fresh name: {exc}")
        assert node.wait_end(rec.id).state.value == "SUCCEEDED"
    finally:
        node.close()


def test_an_agent_crash_ends_the_job_cluster_wide(tmp_short, monkeypatch):
    from elasticd.rendezvous.protocol import RoundState
    from elasticd.trust.sealed import Kind
    from elasticd.jobs.states import JobState

    node = InProcessNode(tmp_short)
    real = node.registry.transition

    def broken(job_id, new, reason, **changes):
        if new == JobState.RUNNING:
            raise RuntimeError("injected bug")
        return real(job_id, new, reason, **changes)

    monkeypatch.setattr(node.registry, "transition", broken)
    try:
        rec = node.submit(PY, "-c", "import time; time.sleep(30)")
        final = node.wait_end(rec.id)
        assert final.state.value == "FAILED" and "injected bug" in final.reason
        for key in (f"/v1/rounds/{rec.id}/state", f"/v1/jobs/{rec.id}/state"):  # and its copy
            state = RoundState.from_doc(node.codec.records.open(
                Kind.STATE, key, node.store.get(key).value).doc)
            assert state.final, f"{key} still says {state.status}: other nodes never hear of it"
    finally:
        node.close()


# ---------------------------------------------------------------- cost of a round

def test_a_round_costs_one_join_write_per_node_and_one_close(etcd):
    """32 nodes form a round: one join write each, one compare-and-swap closing it, one
    copy in the job list; and the joins reach the node that decides the round (and the
    first member, which lists them): about N join events in all, not N x N."""
    from elasticd.rendezvous.round import ClusterRendezvous, create_job
    from elasticd.rendezvous.protocol import JobLimits
    from elasticd.rendezvous.view import JobsView
    from elasticd.store import open_store
    from elasticd.trust.sealed import PLAIN

    import threading

    n = 32
    prefix, job_id = f"/cost-{uuid.uuid4().hex[:8]}", "cost1"
    limits = JobLimits(min_nodes=n, max_nodes=n, max_restarts=0, last_call=0.0,
                       join_timeout=600.0)
    counts = {"join": 0, "cas": 0, "copy": 0}
    delivered = [0] * n       # join events each node's watches received
    lock = threading.Lock()
    stores, views, parts = [], [], []

    def counting(fn, what):
        def call(key, *a, **kw):
            if what == "cas" or "/join" in key:   # /v1/joins/..., or where joins were
                with lock:     # the round's CAS, or its copy in the job list
                    counts["copy" if key.startswith("/v1/jobs/") else what] += 1
            return fn(key, *a, **kw)
        return call

    def watching(fn, i):
        def watch(prefix, *a, **kw):
            for ev in fn(prefix, *a, **kw):
                if "/join" in ev.key:      # /v1/joins/..., or where joins were before
                    with lock:
                        delivered[i] += 1
                yield ev
        return watch

    stop = threading.Event()
    try:
        for i in range(n):
            store = open_store("etcd3", [etcd.url], prefix=prefix, timeout=30.0)
            view = JobsView(store, records=PLAIN, retry=0.5)
            view.start()
            stores.append(store)
            views.append(view)
            lease = store.grant_lease(60)
            store.put = counting(store.put, "join")
            store.compare_and_swap = counting(store.compare_and_swap, "cas")
            store.watch = watching(store.watch, i)
            parts.append(ClusterRendezvous(store, view, job_id, f"node{i:02d}", "127.0.0.1", 1,
                                           (lambda lease=lease: lease), limits, poll=0.5))
        for v in views:
            assert v.synced.wait(30)
        create_job(stores[0], job_id, {"id": job_id, "nodes": []}, time.time(),
                   records=PLAIN)
        wait_for(lambda: all((k := v.job(job_id)) is not None and k.state is not None
                             for v in views), 30, "every view to see the job")
        pool = concurrent.futures.ThreadPoolExecutor(n)
        try:
            results = list(pool.map(lambda p: p.next_round(stop), parts, timeout=120))
        finally:  # a round that never closes must not hold the pool's shutdown
            stop.set()
            pool.shutdown(wait=True)
        assert sorted(r.place.group_rank for r in results) == list(range(n))
        assert counts == {"join": n, "cas": 1, "copy": 1}, counts
        print(f"join events received: {sum(delivered)} in all, at most {max(delivered)} "
              f"by a node ({n} nodes)")
        assert sum(delivered) <= 2 * n and sorted(delivered)[-3] == 0, delivered
    finally:
        stop.set()
        for v in views:
            v.stop()
        for s in stores:
            s.close()
