"""Hang timeouts and stragglers of jobs across nodes: two real daemons on one real etcd,
real torch gloo workers, at the default hang settings.

Each node publishes its ranks' phases and step times (hangs/phase_board.py) under the
job's keys; the other node decides on them:

* no false alarm: the rank on node n2 writes a 20 s torch.save checkpoint while
  the rank on n1 waits in its next all_reduce, silent far past the learned 10 s
  of its training phase; and the other way round (n1, the round's first member,
  reads n2's record itself; n2 reads n1's checkpoint in the digest n1 writes,
  hangs/phase_digest.py);
* a rank asleep in its step loop on n2 is killed at the learned timeout (not the
  fixed 180 s) and the job recovers across both nodes;
* a rank slowed 3x on n2 is named the job's straggler by n1's status.

Which rank runs where follows the rendezvous; the scripts pick the rank to slow
or hang by its node (ELASTICD_NODE_ID), the tests read its rank from status.
"""
from __future__ import annotations

import os
import re
import textwrap
import time

import pytest

from etcd_server import EtcdServer, etcd_binary
from test_multinode import PY, Cluster, events, rank_log, status, submit, wait_done, wait_for

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="needs an etcd binary")

# Before its first step the job waits this long, so that the warm spares (started
# agent.warm_spare_delay after the workers) have imported torch by the time of the
# fault, as in any job that ran for more than a few seconds (see test_hang_acceptance).
SPARES_WARM = 12

PREAMBLE = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist

    node = os.environ["ELASTICD_NODE_ID"]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        loss = model(torch.ones(8)).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
""")

CHECKPOINT_ON_SAVER = PREAMBLE + textwrap.dedent("""
    class SlowToSave:
        \"\"\"Pickling it takes 20 s: a checkpoint to a slow disk.\"\"\"
        def __reduce__(self):
            time.sleep(20)
            return (dict, ())

    for i in range(1, 71):
        step()
        time.sleep(0.05)
        if i == 40 and node == os.environ["SAVER"]:   # the other rank waits for it
            t = time.time()
            torch.save({"model": model.state_dict(), "slow": SlowToSave()},
                       os.path.join(os.environ["CKPT_DIR"], f"ckpt-{rank}"))
            print(f"CHECKPOINT {time.time() - t:.1f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print("DONE", flush=True)
""")

HANG_ON_N2 = PREAMBLE + textwrap.dedent("""
    if attempt == 0:
        time.sleep(float(os.environ["WARM"]))
    for i in range(100 if attempt == 0 else 20):   # after the recovery: a few steps
        if attempt == 0 and node == "n2" and i == 60:
            print(f"HANG {time.time():.3f}", flush=True)
            time.sleep(3600)
        step()
        if i == 0:
            print(f"FIRST_STEP {attempt} {time.time():.3f}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    print("DONE", flush=True)
""")

SLOW_ON_N2 = PREAMBLE + textwrap.dedent("""
    load = 0.15 if node == "n2" else 0.05   # n2's rank takes 3x as long to get its batch
    deadline = time.time() + 150
    while time.time() < deadline:
        time.sleep(load)
        step()
    dist.barrier()
    dist.destroy_process_group()
""")


CHECKPOINT_ON_N2_INPROCESS = textwrap.dedent("""
    import os, time
    import torch
    import torch.distributed as dist
    from elasticd.inprocess import Wrapper

    node = os.environ["ELASTICD_NODE_ID"]

    class SlowToSave:
        \"\"\"Pickling it takes 20 s: a checkpoint to a slow disk.\"\"\"
        def __reduce__(self):
            time.sleep(20)
            return (dict, ())

    @Wrapper(backend="gloo")
    def train(iteration):
        rank = dist.get_rank()
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for i in range(1, 71):
            loss = model(torch.ones(8)).sum()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            time.sleep(0.05)
            if i == 40 and node == "n2":   # n1's rank waits in its next all_reduce
                t = time.time()
                torch.save({"model": model.state_dict(), "slow": SlowToSave()},
                           os.path.join(os.environ["CKPT_DIR"], f"ckpt-{rank}"))
                print(f"CHECKPOINT {time.time() - t:.1f}", flush=True)
        return iteration

    print("DONE", train(), flush=True)
""")


@pytest.fixture(scope="module")
def etcd():
    with EtcdServer() as server:
        yield server


@pytest.fixture
def pair(etcd):
    c = Cluster(etcd, 2)   # the defaults: warm spares, hang settings
    yield c
    c.close()


def _script(c: Cluster, name: str, text: str) -> str:
    path = os.path.join(c.shared, name)
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o644)
    return path


def _hangs(c: Cluster, job_id: str) -> list[tuple[str, int, str]]:
    return [(d.node_id, e.get("rank", -1), e["reason"]) for d in c.nodes.values()
            for e in events(d, job_id) if e["kind"] == "hang"]


def _rank_on(st: dict, node: str) -> int:
    ranks = {w["node_id"]: w.get("rank", 0) for w in st.get("workers", [])}
    return ranks[node]


def _train_limit(st: dict) -> dict:
    return {p["phase"]: p for p in st.get("hang_timeouts", [])}.get("train", {})


@pytest.mark.slow
@pytest.mark.parametrize("saver,waiter", [("n2", "n1"), ("n1", "n2")])
def test_a_rank_waiting_for_a_checkpoint_on_another_node_is_not_killed(pair, saver, waiter):
    os.makedirs(os.path.join(pair.shared, "ckpt"))
    job = submit(pair["n1"], "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
                 "--env", f"CKPT_DIR={os.path.join(pair.shared, 'ckpt')}",
                 "--env", f"SAVER={saver}",
                 cmd=[PY, _script(pair, "ckpt.py", CHECKPOINT_ON_SAVER)])
    st = wait_done(pair["n1"], job, timeout=240)
    hangs = _hangs(pair, job)
    assert st["state"] == "SUCCEEDED", (st.get("reason"), hangs)
    assert hangs == [], hangs
    log = rank_log(pair[saver], job, _rank_on(st, saver))
    took = float(re.search(r"^CHECKPOINT ([\d.]+)$", log, re.M).group(1))
    assert took >= 19, log[-2000:]
    # The waiter ran under learned limits (a training gap of 10 s, not the fixed 180 s):
    # its rank's 20 s silence was explained by the saver's checkpoint, not a longer bound.
    train = _train_limit(status(pair[waiter], job))
    assert train.get("learned") and train["hard_seconds"] == 10, train
    assert train["longest_gap_seconds"] < 5, train   # the wait was not learned as a gap
    print(f"checkpoint on {saver}: {took:.1f}s; {waiter}'s train limit "
          f"{train['hard_seconds']}s; no hang event")


@pytest.mark.slow
def test_inprocess_a_rank_waiting_for_a_checkpoint_on_another_node_is_not_restarted(pair):
    # The wrapper sees its own phase only: the daemon widens its training limits in the
    # limits file while n2's rank is in the checkpoint (learned ones are 5 s / 10 s).
    os.makedirs(os.path.join(pair.shared, "ckpt"))
    job = submit(pair["n1"], "--inprocess", "--nnodes", "2", "--nproc-per-node", "1",
                 "--max-restarts", "0",
                 "--env", f"CKPT_DIR={os.path.join(pair.shared, 'ckpt')}",
                 cmd=[PY, _script(pair, "ckpt_inprocess.py", CHECKPOINT_ON_N2_INPROCESS)])
    st = wait_done(pair["n1"], job, timeout=240)
    hangs = _hangs(pair, job)
    assert st["state"] == "SUCCEEDED", (st.get("reason"), hangs)
    assert hangs == [], hangs
    for node in ("n1", "n2"):
        layers = status(pair[node], job).get("restarts_by_layer", {})
        assert not layers.get("inprocess"), (node, layers)
    log = rank_log(pair["n2"], job, _rank_on(st, "n2"))
    assert float(re.search(r"^CHECKPOINT ([\d.]+)$", log, re.M).group(1)) >= 19, log[-2000:]
    assert "DONE 0" in rank_log(pair["n1"], job, _rank_on(st, "n1"))
    train = _train_limit(status(pair["n1"], job))
    assert train.get("learned") and train["hard_seconds"] == 10, train


@pytest.mark.slow
def test_a_rank_hung_on_one_node_is_recovered_at_the_learned_timeout(pair):
    job = submit(pair["n1"], "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2",
                 "--env", f"WARM={SPARES_WARM}", cmd=[PY, _script(pair, "hang.py", HANG_ON_N2)])
    st = wait_done(pair["n1"], job, timeout=300)
    hangs = _hangs(pair, job)
    assert st["state"] == "SUCCEEDED", (st.get("reason"), hangs)
    kills = [why for _, _, why in hangs if "killed" in why]
    assert kills and all("learned train" in k for k in kills), hangs
    ranks = {w["node_id"]: w["rank"] for w in st["workers"]}
    log_n2 = rank_log(pair["n2"], job, ranks["n2"])
    hang_at = float(re.search(r"^HANG ([\d.]+)$", log_n2, re.M).group(1))
    log_n1 = rank_log(pair["n1"], job, ranks["n1"])
    recovered = [float(t) for a, t in re.findall(r"^FIRST_STEP (\d+) ([\d.]+)$", log_n1, re.M)
                 if int(a) >= 1]
    assert recovered, log_n1[-2000:]
    took = recovered[0] - hang_at
    print(f"hang -> first step after recovery (2 nodes, process restart, defaults): "
          f"{took:.1f}s; {kills[0]}")
    assert took < 30, (took, hangs)


@pytest.mark.slow
def test_a_rank_slowed_3x_on_another_node_is_named_by_this_nodes_status(pair):
    job = submit(pair["n1"], "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
                 cmd=[PY, _script(pair, "slow.py", SLOW_ON_N2)])
    last = {}

    def named():
        st = last["st"] = status(pair["n1"], job)
        s = st.get("straggler") or {}
        return st if s.get("nodes") == 2 and s.get("rank_node_id") == "n2" else None

    st = wait_for(named, 150, "n1's status to name n2's rank", interval=1.0)
    s = st["straggler"]
    assert s["rank"] == _rank_on(st, "n2") and s["ratio"] > 2, s
    assert s["ranks"] == 2, s
    table = pair["n1"].ctl("status", job).stdout
    assert f"straggler:    rank {s['rank']}:" in table and "runs on node n2" in table, table
    # n2, where the rank runs, records the event; n1 shows it (events are shared).
    def announced():
        return [e["reason"] for e in events(pair["n1"], job) if e["kind"] == "straggler"
                and f"rank {s['rank']} is a straggler" in e["reason"]
                and "runs on node n2" in e["reason"]]
    wait_for(announced, 60, "the straggler event on n1", interval=1.0)
    print(f"straggler named by n1: {s}")
    pair["n1"].ctl("cancel", job)
    pair["n1"].wait_job(job, timeout=120)
